"""Validation checks inside the recipe's final fit: score the schedule at a few points, return the best weights.

A long schedule can over-fit: on a dense catalogue a 30-minute final fit ended below the validation score its own
2-minute search trial had reached. Stopping a linear-decay schedule early would cut the part of it that converges
(the rate reaches 0 only at the end, and with the tile sampler the validation score stays low until the last ~15%
of the steps), so the checks never stop the fit: they keep a copy of the best weights seen, and the fit returns
them when they beat the schedule's end on validation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from typing_extensions import override

#: Most checks inside one final fit (plus its end).
MAX_VAL_CHECKS = 8
#: Share of the final fit's time the checks may spend scoring.
VAL_CHECK_TIME_SHARE = 0.05


def val_check_count(requested: int | None, fit_seconds: float | None, eval_seconds: float) -> int:
    """How many checks a final fit gets: ``requested``, or (``None``) as many as cost at most
    :data:`VAL_CHECK_TIME_SHARE` of ``fit_seconds`` (all :data:`MAX_VAL_CHECKS` for an epoch budget, ``None``).

    Raises:
        ValueError: ``requested`` is negative.
    """
    if requested is not None:
        if requested < 0:
            raise ValueError(f"fit_simplex_within_budget: val_checks must be >= 0 (0: none), got {requested}.")
        return requested
    if fit_seconds is None:
        return MAX_VAL_CHECKS
    affordable = int(VAL_CHECK_TIME_SHARE * fit_seconds / max(eval_seconds, 1e-6))
    return min(MAX_VAL_CHECKS, affordable)


class _BestOnValidation(Callback):
    """Scores the model at ``checks`` evenly spaced points of its schedule and keeps the best weights seen.

    Check ``i`` (1-based) runs after the first step at which ``progress(trainer)`` reaches ``i / (checks + 1)``;
    :meth:`finish` scores the end of the schedule and loads the best check's weights into the model when they score
    higher. The weights are copied on the CPU (a SimpleX model's embeddings and aggregator), never written to disk.

    Args:
        score: the validation score of a model (higher is better).
        checks: checks inside the schedule (its end is scored by :meth:`finish`).
        progress: the share of the schedule done, from 0 to 1 (the clock's share for a schedule on the clock).
    """

    def __init__(self, score: Callable[[Any], float], checks: int, progress: Callable[[Trainer], float]) -> None:
        self.score, self.checks, self.progress = score, checks, progress
        self.steps: list[int] = []
        self.val_recall: list[float] = []
        self.chosen = -1
        self._best: dict[str, torch.Tensor] | None = None

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if len(self.steps) >= self.checks or trainer.should_stop:
            return
        if self.progress(trainer) < (len(self.steps) + 1) / (self.checks + 1):
            return
        value = float(self.score(pl_module))
        if not self.val_recall or value > max(self.val_recall):
            self._best = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.steps.append(int(trainer.global_step))
        self.val_recall.append(value)

    def finish(self, model: Any, steps: int) -> None:
        """Score the end of the schedule (``steps`` steps) and load the best check's weights if they are better."""
        end = float(self.score(model))
        best = max(range(len(self.val_recall)), key=self.val_recall.__getitem__, default=None)
        if best is not None and self._best is not None and self.val_recall[best] > end:
            model.load_state_dict(self._best)
            self.chosen = best
        else:
            self.chosen = len(self.val_recall)
        self.steps.append(int(steps))
        self.val_recall.append(end)
        self._best = None
