"""``benchmarks/sdp4bit_exchange_cost.py``: every method reduces the gradients it is timed on, at any bucket count."""

import pytest

from benchmarks.sdp4bit_exchange_cost import METHODS, measure
from tests._distributed import run_distributed

pytest.importorskip("numba")


def _every_method(rank: int, world: int) -> dict:
    return {(m, b): measure(rank, world, 3 * 2**15, b, m, steps=1) for m in METHODS for b in (1, 3)}


def test_every_method_is_timed_on_a_correct_exchange():
    for per_rank in run_distributed(_every_method, 4, timeout=300):
        for (method, buckets), got in per_rank.items():
            assert got["cpu_s"] > 0 and got["wall_s"] > 0, (method, buckets)
            if method == "qwd/tlq_hs":  # 8/4-bit codes of gradients of about 1e-3: close, not exact
                assert 0 < got["max_error"] < 4e-3, (method, buckets, got)
            else:
                assert got["max_error"] < 1e-8, (method, buckets, got)
