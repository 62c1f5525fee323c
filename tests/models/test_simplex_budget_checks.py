"""Validation checks inside the budgeted recipe's final fit: the best check's weights are returned, the end is
kept on a tie, and the number of checks follows the scoring cost (end-to-end tests: ``test_simplex_budget.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_sdp.recipes.checkpoints import MAX_VAL_CHECKS, _BestOnValidation, val_check_count


def _run_checks(scores: list[float], checks: int) -> tuple[_BestOnValidation, torch.nn.Linear, list[torch.Tensor]]:
    """Drive the callback over ``len(scores) - 1`` checks of a 100-step schedule whose weights change every step;
    the last score is the end's."""
    torch.manual_seed(np.random.randint(1 << 30))
    model = torch.nn.Linear(4, 3)
    queue = iter(scores)
    checker = _BestOnValidation(lambda m: next(queue), checks, lambda t: t.global_step / 100)
    trainer = SimpleNamespace(global_step=0, should_stop=False)
    seen: list[torch.Tensor] = []
    for step in range(1, 101):
        with torch.no_grad():
            model.weight.add_(torch.randn_like(model.weight))
        trainer.global_step = step
        before = len(checker.steps)
        checker.on_train_batch_end(trainer, model, None, None, step - 1)  # type: ignore[arg-type]
        if len(checker.steps) > before:
            seen.append(model.weight.detach().clone())
    seen.append(model.weight.detach().clone())
    checker.finish(model, 100)
    return checker, model, seen


def test_checks_are_evenly_spaced_and_the_best_check_is_returned() -> None:
    checker, model, seen = _run_checks([0.2, 0.5, 0.3, 0.4], checks=3)
    assert checker.steps == [25, 50, 75, 100]
    assert checker.val_recall == [0.2, 0.5, 0.3, 0.4]
    assert checker.chosen == 1
    torch.testing.assert_close(model.weight, seen[1], rtol=0, atol=0)


def test_the_end_is_kept_when_no_check_beats_it() -> None:
    checker, model, seen = _run_checks([0.2, 0.5, 0.5], checks=2)  # a tie goes to the end of the schedule
    assert checker.chosen == 2 and checker.steps == [34, 67, 100]  # the first step at or past 1/3, 2/3
    torch.testing.assert_close(model.weight, seen[-1], rtol=0, atol=0)


def test_check_count_follows_the_scoring_cost() -> None:
    assert val_check_count(None, None, 1.0) == MAX_VAL_CHECKS  # an epoch budget
    assert val_check_count(None, 100.0, 1.0) == 5  # 5% of 100 s in scorings of 1 s
    assert val_check_count(None, 100.0, 0.01) == MAX_VAL_CHECKS
    assert val_check_count(None, 10.0, 1.0) == 0
    assert val_check_count(3, 10.0, 1.0) == 3
    with pytest.raises(ValueError, match="val_checks must be >= 0"):
        val_check_count(-1, None, 1.0)
