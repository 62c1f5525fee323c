"""``python -m benchmarks.sdp4bit_convergence --quick`` on a generated text, 2 processes, 2 configurations."""

import json
import math
from pathlib import Path

import pytest

from benchmarks import sdp4bit_convergence
from benchmarks._common import RESULTS_DIR


def test_quick_mode_trains_and_reports_bits(tmp_path: Path) -> None:
    data = tmp_path / "input.txt"
    data.write_text("".join(chr(97 + (i * 7) % 26) + (" " if i % 5 == 0 else "") for i in range(4000)))
    sdp4bit_convergence.main(
        ["--quick", "--data", str(data), "--world", "2", "--intra", "1", "--modes", "none/none", "qwd/tlq_hs",
         "--block", "16", "--batch", "2", "--n-head", "2"]
    )  # fmt: skip
    result = json.loads((RESULTS_DIR / "sdp4bit_convergence_quick.json").read_text())
    by_mode = {f"{r['weights']}/{r['grads']}": r for r in result["results"]}
    assert set(by_mode) == {"none/none", "qwd/tlq_hs"}
    assert all(math.isfinite(r["val"][-1][1]) and r["val"][-1][0] == 12 for r in by_mode.values())
    assert by_mode["none/none"]["bits"]["weight"] == 32.0
    assert by_mode["qwd/tlq_hs"]["bits"]["weight"] == pytest.approx(4 + 32 / 2048)
    assert by_mode["qwd/tlq_hs"]["bits"]["grad_inter"] == pytest.approx(4 + 32 / 128)  # 1 rank per node: 4 bits
    assert result["quant_error"], "the qW vs qWD error of the qwd/tlq_hs run was not recorded"
