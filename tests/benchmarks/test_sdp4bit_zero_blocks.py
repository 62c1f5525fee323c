"""``python -m benchmarks.sdp4bit_zero_blocks --quick``: aligned Hadamard blocks keep absent tokens' rows exact."""

import json

import pytest

from benchmarks import sdp4bit_zero_blocks
from benchmarks._common import RESULTS_DIR

pytestmark = [pytest.mark.bench, pytest.mark.slow]


def test_quick_mode_aligned_blocks_leave_zero_gradient_rows_alone() -> None:
    sdp4bit_zero_blocks.main(["--quick"])
    rows = json.loads((RESULTS_DIR / "sdp4bit_zero_blocks_quick.json").read_text())["rows"]
    by_config = {r["config"]: r for r in rows}
    assert set(by_config) == {"none/none", "tlq_hs unaligned", "tlq_hs aligned"}
    absent = len(sdp4bit_zero_blocks.absent_ids())
    # n_embd 32: every row is one whole Hadamard block, so aligned TLq-HS leaves the zero rows exactly as DDP does
    assert by_config["none/none"]["absent_rows_unchanged"] == absent
    assert by_config["tlq_hs aligned"]["absent_rows_unchanged"] == absent
    assert by_config["tlq_hs unaligned"]["absent_rows_max_abs_change"] > 0
    assert all(r["present_rows_mean_abs_change"] > 0 for r in rows)
