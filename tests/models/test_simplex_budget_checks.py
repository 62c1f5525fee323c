"""Validation checks inside the budgeted recipe's final fit: the best weights on validation are returned, the
schedule is never cut, and the checks are refused where validation is not held out."""

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


pytest.importorskip("numba", reason="the fused backend needs the cpu extra (numba)")

from lightning_sdp.datamodules.interactions import InteractionsDataModule  # noqa: E402
from lightning_sdp.metrics import evaluate_ranking  # noqa: E402
from lightning_sdp.recipes import fit_simplex_within_budget  # noqa: E402

TINY_GRID = {"dim": [16], "num_negatives": [8], "lr": [0.3], "margin": [0.9], "loss": ["ccl"]}


def _data() -> InteractionsDataModule:
    dm = InteractionsDataModule(num_users=200, num_items=120, interactions_per_user=15, val_fraction=0.2)
    dm.setup("fit")
    return dm


def test_a_held_out_final_fit_returns_its_best_check_on_validation() -> None:
    dm = _data()
    fit = fit_simplex_within_budget(
        dm, budget_epochs=6, search_fraction=0.0, grid=TINY_GRID, threads=1, batch_size=128, refit=False, val_checks=4
    )
    assert len(fit.check_steps) == 5 and fit.check_steps[-1] == fit.max_steps
    assert all(a < b for a, b in zip(fit.check_steps, fit.check_steps[1:], strict=False))
    best = max(fit.check_val_recall)
    assert fit.check_val_recall[fit.chosen_check] == best
    assert fit.chosen_check == len(fit.check_steps) - 1 or best > fit.check_val_recall[-1]
    # the model returned scores what its check scored (the search's user sample is every validation user here)
    recall, _ = evaluate_ranking(fit.model.score, dm.train_csr, dm.val_csr, dm.num_items, 20)
    assert recall == pytest.approx(best, abs=1e-6)
    assert fit.final_lr == 0.0  # the checks never cut the schedule


def test_checks_are_refused_where_validation_is_not_held_out() -> None:
    dm = _data()
    refit = fit_simplex_within_budget(dm, budget_epochs=2, search_fraction=0.0, grid=TINY_GRID, threads=1)
    assert refit.refit and refit.check_steps == [] and refit.chosen_check == -1
    with pytest.raises(ValueError, match="which it trains on"):
        fit_simplex_within_budget(dm, budget_epochs=2, grid=TINY_GRID, val_checks=2)
    with pytest.raises(ValueError, match="restart cycles already choose"):
        fit_simplex_within_budget(dm, budget_epochs=2, grid=TINY_GRID, val_checks=2, cycles=2)
