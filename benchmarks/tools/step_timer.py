"""A callback that records the wall and process-CPU time of every training batch."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch import Callback


class StepTimer(Callback):
    """Wall and process-CPU time at the start and end of every training batch.

    Put it first in ``callbacks`` so that its ``on_train_batch_start`` runs before any other callback's.
    """

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.cpu_starts: list[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ends.append(time.perf_counter())

    def per_step(self, first: int = 0, last: int = -1) -> float:
        """Mean seconds per step from the start of batch ``first`` to the end of batch ``last``."""
        last = last % len(self.ends)
        return (self.ends[last] - self.starts[first]) / (last - first + 1)

    def intervals(self) -> list[float]:
        """Wall seconds from each batch's start to the next batch's start."""
        return [b - a for a, b in zip(self.starts[:-1], self.starts[1:], strict=True)]

    def durations(self) -> list[float]:
        """Wall seconds from each batch's start to its end."""
        # A batch whose end never came (fit stopped inside it) has a start but no end: it has no duration.
        return [e - s for s, e in zip(self.starts, self.ends, strict=False)]
