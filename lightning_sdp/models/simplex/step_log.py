"""Training statistics of :class:`SimpleXModule` summed over the steps between two logged steps.

Lightning's ``LightningModule.log`` is costly on a CPU (it moves the stored result objects at every call), and a
step of HEAT's fused kernel is short, so three calls a step cost the fused path a sizeable share of its throughput
(``benchmarks/heat_trainer_overhead.py`` measures it). Lightning hands on-step values to the loggers only every
``log_every_n_steps`` steps anyway, so the module sums what it measures here and logs the window's means on those
steps, on the last batch of an epoch and on the last step of the fit (so ``callback_metrics`` hold the final values
when a fit ends).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


def is_log_step(trainer: Trainer) -> bool:
    """Whether the step that just finished (``trainer.global_step`` counts it) is one whose values are logged.

    Args:
        trainer: the running trainer, read after the step's optimizer step.
    """
    step = trainer.global_step
    every = int(getattr(trainer, "log_every_n_steps", 50))  # set by Lightning's logger connector, not declared
    if every > 0 and step % every == 0:
        return True
    last_of_fit = trainer.max_steps is not None and 0 < trainer.max_steps <= step
    return bool(trainer.is_last_batch or last_of_fit or trainer.should_stop)


class StepLogWindow:
    """Positives, seconds and summed per-sample losses of the steps since the last logged one."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start a new window."""
        self.positives = 0
        self.seconds = 0.0
        self.loss_sum = 0.0
        self.loss_positives = 0
        self.lr = math.nan

    def add_loss(self, mean_loss: float, positives: int, lr: float) -> None:
        """Record one step's mean per-sample loss over ``positives`` positives and the rate it used."""
        self.loss_sum += mean_loss * positives
        self.loss_positives += positives
        self.lr = lr

    def add_batch(self, positives: int, seconds: float) -> None:
        """Record one step's positives and its time (batch start to batch end)."""
        self.positives += positives
        self.seconds += seconds

    def flush(self) -> dict[str, float]:
        """The window's statistics (``train/positives_per_sec``, ``train/loss``, ``train/lr`` when recorded); resets.

        ``train/loss`` is the mean per-sample loss over the window's positives, ``train/lr`` the last step's rate.
        """
        stats: dict[str, float] = {}
        if self.seconds > 0:
            stats["train/positives_per_sec"] = self.positives / self.seconds
        if self.loss_positives > 0:
            stats["train/loss"] = self.loss_sum / self.loss_positives
        if not math.isnan(self.lr):
            stats["train/lr"] = self.lr
        self.reset()
        return stats
