"""The clock callbacks of the budgeted search: the time a fit's batches take, and a rate that decays on the clock.

:class:`_FitClock` measures a fit (the search sizes its trials and the final fit from what it reads);
:class:`_WallClockLinearDecay` decays the learning rate with the training time elapsed and stops the fit when the
time is up, so that a schedule ends with its budget however the step time drifts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Callback, Trainer
from typing_extensions import override


class _FitClock(Callback):
    """Wall time of the training batches (first batch start to last batch end) and the learning rate at the end."""

    def __init__(self) -> None:
        self.first_start: float | None = None
        self.last_end = 0.0
        self.ends: list[float] = []
        self.final_lr = float("nan")

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.first_start is None:
            self.first_start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.last_end = time.perf_counter()
        self.ends.append(self.last_end)
        self.final_lr = float(trainer.optimizers[0].param_groups[0]["lr"])

    @property
    def train_seconds(self) -> float:
        """Seconds from the start of the first batch to the end of the last one (0 before any batch)."""
        return 0.0 if self.first_start is None else self.last_end - self.first_start

    @property
    def seconds_per_step(self) -> float:
        """Between the ends of the first and the last batch (the first one warms up); needs two batches."""
        return max(1e-6, (self.ends[-1] - self.ends[0]) / (len(self.ends) - 1))


class _WallClockLinearDecay(Callback):
    """Decays every parameter group's rate linearly from its initial value to 0 over ``seconds`` of training.

    A step-counted schedule sized from a probe's step time misses the budget when the step time changes: a fused
    step costs more as training goes on (more negatives pass the margin and get updated; a fresh model's probe
    steps are the cheapest), and one slow interval in a short probe can double its estimate. A schedule on the
    clock ends at ``seconds`` however the step time moves: the rate of each step is set from the time elapsed since
    the first batch started, and the fit stops after the step that reaches ``seconds`` (the last step's rate is
    then within one step of 0).

    Args:
        seconds: training time (first batch start to last batch end) over which the rate decays.
        clock: the time source (tests pass a fake one).

    Raises:
        ValueError: ``seconds`` is not a positive number.
    """

    def __init__(self, seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"_WallClockLinearDecay: seconds must be a positive number, got {seconds}.")
        self.seconds, self.clock = float(seconds), clock
        self.start: float | None = None
        self.base: list[list[float]] = []
        self.steps = 0

    def _fraction_left(self) -> float:
        assert self.start is not None  # set at the first batch start
        return max(0.0, 1.0 - (self.clock() - self.start) / self.seconds)

    @property
    def progress(self) -> float:
        """The share of the schedule's time elapsed (0 before the first batch, 1 at its end)."""
        return 0.0 if self.start is None else 1.0 - self._fraction_left()

    def _set(self, trainer: Trainer, fraction: float) -> None:
        for optimizer, base in zip(trainer.optimizers, self.base, strict=True):
            for group, lr in zip(optimizer.param_groups, base, strict=True):
                group["lr"] = lr * fraction

    @override
    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.base = [[float(g["lr"]) for g in opt.param_groups] for opt in trainer.optimizers]
        self.start, self.steps = None, 0

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.start is None:
            self.start = self.clock()
        self._set(trainer, self._fraction_left())

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps += 1
        left = self._fraction_left()
        if left <= 0.0:
            trainer.should_stop = True
        self._set(trainer, left)  # the rate the next step would use: 0 once the time is up


def schedule_progress(trainer: Trainer) -> float:
    """The share of a fit's schedule done: its :class:`_WallClockLinearDecay`'s clock when it has one, else its
    steps over ``max_steps``."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, _WallClockLinearDecay):
            return callback.progress
    return trainer.global_step / max(1, trainer.max_steps)
