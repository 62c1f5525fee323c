"""Overlap and pipelining of SDP4Bit's collectives (the paper's runtime optimisation, Jia et al. 2024, Sec. 4).

Two FIFO worker threads carry every bucket's exchange: the first runs what uses the intra-node group (quantise,
8-bit all-to-all, dequantise + sum + re-quantise) or the weight all-gather, the second what uses the inter-node
group (4-bit all-to-all, dequantise + sum + inverse Hadamard) or the weight decoding. While the training thread
runs the backward of early layers, the first thread quantises and exchanges the gradients of late layers and the
second one sends the previous bucket between nodes: compute, intra-node and inter-node traffic overlap, as DDP's
reducer and Megatron's ``overlap_grad_reduce`` do for one level. Every process group is used by one thread only,
and buckets enter the threads in the same order on every rank, so the collectives match across ranks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Done(Generic[T]):
    """A finished job run on the calling thread (the non-overlapped path): the same interface as a ``Future``."""

    def __init__(self, value: T) -> None:
        self._value = value

    def result(self) -> T:
        """The value."""
        return self._value

    def done(self) -> bool:
        """Always ``True``."""
        return True


class Pipeline:
    """Runs ``first`` then ``second`` of each job: on two FIFO threads (``threaded=True``) or inline.

    Args:
        threaded: run the stages on the two worker threads (overlap) instead of the calling thread.
    """

    def __init__(self, threaded: bool) -> None:
        self.threaded = threaded
        self._stages: list[ThreadPoolExecutor] = []
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # Lightning pickles the strategy to start processes with "spawn": the threads and lock stay behind
        return {"threaded": self.threaded}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["threaded"])  # type: ignore[misc]

    def _executors(self) -> list[ThreadPoolExecutor]:
        with self._lock:
            if not self._stages:
                self._stages = [
                    ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sdp4bit-comm{i}") for i in (1, 2)
                ]
            return self._stages

    def submit(self, first: Callable[[], Any], second: Callable[[], T]) -> Future[T] | Done[T]:
        """Queue one job; ``second`` starts once ``first`` is done and the previous job's ``second`` is done."""
        if not self.threaded:
            first()
            return Done(second())
        one, two = self._executors()
        started = one.submit(first)

        def run_second() -> T:
            started.result()  # re-raises what ``first`` raised
            return second()

        return two.submit(run_second)

    def shutdown(self) -> None:
        """Stop the worker threads (idempotent; they are started again on the next ``submit``)."""
        with self._lock:
            stages, self._stages = self._stages, []
        for ex in stages:
            ex.shutdown(wait=True)
