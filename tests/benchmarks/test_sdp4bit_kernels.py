"""``python -m benchmarks.sdp4bit_kernels --quick``: the script runs (Triton's CPU interpreter, numba) and its checks pass."""

import json

import pytest

from benchmarks import sdp4bit_kernels
from benchmarks._common import RESULTS_DIR

pytestmark = pytest.mark.bench


@pytest.mark.parametrize(
    "backend,stem",
    [
        pytest.param("triton", "sdp4bit_kernels_quick", marks=pytest.mark.triton),
        pytest.param("numba", "sdp4bit_kernels_cpu_quick", marks=pytest.mark.numba),
    ],
)
def test_quick_mode_checks_every_kernel_against_the_reference(backend: str, stem: str) -> None:
    if backend == "numba":
        pytest.importorskip("numba")
    sdp4bit_kernels.main(["--quick", "--backend", backend])  # raises SystemExit when a kernel disagrees
    result = json.loads((RESULTS_DIR / f"{stem}.json").read_text())
    assert len(result["checks"]) == 5 and all(result["checks"].values())
    assert [row["kernel"] for row in result["rows"]][0] == "copy fp32 (baseline)"
    assert len(result["rows"]) == 6 and all(row["GB/s"] > 0 for row in result["rows"])
    assert (RESULTS_DIR / f"{stem}.md").exists()
