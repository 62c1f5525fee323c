"""``python -m benchmarks.sdp4bit_convergence --quick`` on a generated text, 2 processes, 2 configurations."""

import json
import math
from pathlib import Path

import pytest

from benchmarks import sdp4bit_convergence
from benchmarks._common import RESULTS_DIR

pytestmark = [pytest.mark.bench, pytest.mark.slow]


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


def _stored_run(name: str, steps: int, seeds: list[int]) -> dict:
    """A run as ``main`` stores it: arguments, per-configuration results and the table derived from them."""
    import argparse

    results = []
    for k, seed in enumerate(seeds):
        for weights, grads in (("none", "none"), ("qwd", "tlq_hs")):
            loss = 2.0 + 0.01 * k + (0.02 if weights == "qwd" else 0.0)
            results.append({
                "seed": seed, "weights": weights, "grads": grads, "wall_s": 1.5 + k, "params": 1234,
                "train": [(s, loss + 1 / s) for s in range(1, steps + 1)], "val": [(steps, loss)],
                "drift": [(s, 0.003 if weights == "qwd" else 0.0) for s in range(1, steps + 1)],
                "quant_error": [{"step": steps, "qw": 0.1, "qwd": 0.002}],
                "bits": {"weight": 4.016 if weights == "qwd" else 32.0, "grad_intra": 8.25, "grad_inter": 4.25},
                "bytes_per_step": 1000 + k,
            })  # fmt: skip
    parser_defaults = {
        "data": "input.txt", "steps": steps, "world": 4, "intra": 2, "n_layer": 2, "n_head": 4, "n_embd": 96,
        "block": 64, "batch": 8, "lr": 3e-3, "warmup": 3, "val_every": steps, "val_batches": 2, "seed": seeds[0],
    }  # fmt: skip
    payload, _, fig = sdp4bit_convergence.summarise(results, argparse.Namespace(**parser_defaults))
    import matplotlib.pyplot as plt

    plt.close(fig)
    payload["machine"] = {"cpu": "Test CPU", "cores": 2, "torch": "2.x", "date": "2026-01-02T00:00:00"}
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(payload))
    return payload


def test_stored_runs_merge_into_one_current_set_with_numbers_unchanged() -> None:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    short = _stored_run("merge_src_short", 6, [11, 12])
    seeds = _stored_run("merge_src_seeds", 6, [13])
    long = _stored_run("merge_src_long", 12, [11])
    paths = sdp4bit_convergence.merge(["merge_src_short", "merge_src_seeds", "merge_src_long"], "merge_out")
    merged = json.loads(paths["json"].read_text())
    assert [s["run"] for s in merged["merged_from"]] == ["merge_src_short", "merge_src_seeds", "merge_src_long"]
    assert merged["runs"]["merge_src_long"]["table"] == long["table"]  # every stored number kept as it was
    md = paths["md"].read_text()
    assert "## 6 steps" in md and "## 12 steps" in md and md.index("## 6 steps") < md.index("## 12 steps")
    six = md[md.index("## 6 steps") : md.index("## 12 steps")]
    # the 6-step section holds the rows of both 6-step runs, formatted as the runs' own tables were
    rows = [line for line in six.splitlines() if line.startswith("| none/none") or line.startswith("| qwd/tlq_hs")]
    assert len(rows) == len(short["table"]) + len(seeds["table"]) == 6
    assert "Seeds 11, 12, 13." in six and "| merge_src_seeds | 6 | 13 |" in md
    assert paths["png"].stat().st_size > 0
    with pytest.raises(ValueError, match="not a stored run"):
        sdp4bit_convergence.merge(["merge_out"], "merge_again")
