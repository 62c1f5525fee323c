"""``python -m benchmarks.sdp4bit_kernels --quick``: the script runs on the CPU interpreter and its checks pass."""

import json

import pytest

from benchmarks import sdp4bit_kernels
from benchmarks._common import RESULTS_DIR

pytestmark = [pytest.mark.triton, pytest.mark.bench]


def test_quick_mode_checks_every_kernel_against_the_reference() -> None:
    sdp4bit_kernels.main(["--quick"])  # raises SystemExit when a kernel disagrees with the reference
    result = json.loads((RESULTS_DIR / "sdp4bit_kernels_quick.json").read_text())
    assert len(result["checks"]) == 5 and all(result["checks"].values())
    assert [row["kernel"] for row in result["rows"]][0] == "copy fp32 (baseline)"
    assert len(result["rows"]) == 6 and all(row["GB/s"] > 0 for row in result["rows"])
    assert (RESULTS_DIR / "sdp4bit_kernels_quick.md").exists()
