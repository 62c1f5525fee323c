"""The time-budgeted SimpleX recipe (``lightning_sdp.recipes``): schedule length from the budget, choices on validation
only, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba", reason="the fused backend needs the cpu extra (numba)")

from lightning_sdp.datamodules.interactions import InteractionsDataModule
from lightning_sdp.recipes import (
    MIN_SPAN_RATIO,
    SimpleXRunner,
    extrapolate_recall,
    fit_simplex_within_budget,
    sample_configs,
)


def test_the_recipe_and_its_evaluator_are_public_where_users_look() -> None:
    import importlib

    import lightning_sdp.metrics
    import lightning_sdp.models
    import lightning_sdp.recipes

    assert lightning_sdp.models.fit_simplex_within_budget is lightning_sdp.recipes.fit_simplex_within_budget
    assert lightning_sdp.recipes.evaluate_ranking is lightning_sdp.metrics.evaluate_ranking
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("lightning_sdp.models.simplex_budget")


TINY_GRID = {"dim": [16], "num_negatives": [8], "lr": [0.1, 0.3, 1.0], "margin": [0.9], "loss": ["ccl"]}


class _NoTestData(InteractionsDataModule):
    """Fails loudly if anything reads the test split."""

    @property
    def test_csr(self):  # type: ignore[override]
        raise AssertionError("the recipe read the test split")

    def test_dataloader(self):  # type: ignore[override]
        raise AssertionError("the recipe read the test split")


def _data() -> InteractionsDataModule:
    dm = _NoTestData(num_users=200, num_items=120, interactions_per_user=15, val_fraction=0.2)
    dm.setup("fit")
    return dm


def test_epoch_budget_decays_to_zero_and_splits_the_steps() -> None:
    dm = _data()
    fit = fit_simplex_within_budget(
        dm, budget_epochs=8, search_fraction=0.5, grid=TINY_GRID, num_configs=3, threads=1, batch_size=128
    )
    steps_per_epoch = -(-len(dm.train_csr.indices) // fit.batch_size)
    total = 8 * steps_per_epoch
    assert fit.final_lr == 0.0  # the linear schedule reached its end at the last step
    assert fit.max_steps == total - int(total * 0.5)
    assert sum(t.steps for t in fit.trials) <= int(total * 0.5)
    assert {t.round for t in fit.trials} == {0, 1}  # successive halving: 3 configs, then the better one
    assert fit.config in [t.config for t in fit.trials if t.round == 1]
    assert 0.0 < fit.val_recall <= 1.0


@pytest.mark.slow
def test_seconds_budget_ends_decayed_inside_the_budget() -> None:
    dm = _data()
    budget = 6.0
    fit = fit_simplex_within_budget(
        dm, budget_seconds=budget, grid=TINY_GRID, num_configs=3, threads=1, batch_size=128, min_trial_seconds=0.2
    )
    assert fit.final_lr == 0.0
    # the plan keeps a 5 % margin; the factor 2 is slack for a loaded host (this is a behaviour test, not a timing one)
    assert fit.search_seconds + fit.fit_seconds <= budget * 2.0
    assert fit.max_steps >= 1


def test_search_picks_by_validation_only() -> None:
    dm = _data()  # its test split raises when read
    fit = fit_simplex_within_budget(
        dm, budget_epochs=6, search_fraction=0.5, grid=TINY_GRID, num_configs=3, threads=1, batch_size=128
    )
    last_round = max(t.round for t in fit.trials)
    best = max((t for t in fit.trials if t.round == last_round), key=lambda t: t.val_recall)
    assert fit.config == best.config
    assert all(np.isfinite(t.val_recall) for t in fit.trials)


def test_restart_cycles_double_in_length_and_keep_the_best_snapshot_on_validation() -> None:
    dm = _data()
    fit = fit_simplex_within_budget(
        dm, budget_epochs=8, search_fraction=0.0, grid=TINY_GRID, threads=1, batch_size=128, cycles=3
    )
    steps_per_epoch = -(-len(dm.train_csr.indices) // fit.batch_size)
    assert sum(fit.cycle_steps) == fit.max_steps == 8 * steps_per_epoch
    first = fit.cycle_steps[0]
    assert fit.cycle_steps[1] in (2 * first, 2 * first + 1) and fit.cycle_steps[2] >= 4 * first
    assert len(fit.cycle_val_recall) == 3 and fit.chosen_cycle == int(np.argmax(fit.cycle_val_recall))
    assert fit.final_lr == 0.0
    with pytest.raises(ValueError, match="cycles must be at least 1"):
        fit_simplex_within_budget(dm, budget_epochs=1, grid=TINY_GRID, cycles=0)


def test_a_warm_restart_starts_from_the_given_weights() -> None:
    dm = _data()
    runner = SimpleXRunner(tuple(np.asarray(a) for a in dm.train_csr), dm.num_items, 128, 1, 0, {})
    config = {k: v[0] for k, v in TINY_GRID.items()}
    trained, _, _ = runner.fit(config, 20)
    fresh = runner.model(config)
    restarted, _, _ = runner.fit({**config, "lr": 1e-12}, 1, init=trained, cycle=1)  # a step too small to move
    for name, value in trained.state_dict().items():
        if value.is_floating_point() and name.endswith("weight"):
            torch.testing.assert_close(restarted.state_dict()[name], value, rtol=1e-6, atol=1e-9)
            assert not torch.equal(fresh.state_dict()[name], value)


def test_carves_validation_from_a_training_csr() -> None:
    dm = _data()
    indptr, indices = dm.train_csr
    fit = fit_simplex_within_budget(
        (indptr, indices), budget_epochs=2, search_fraction=0.0, grid=TINY_GRID, num_items=dm.num_items, threads=1
    )
    assert any("carved" in note for note in fit.notes)
    assert fit.trials == [] and fit.final_lr == 0.0
    assert fit.model.num_items == dm.num_items


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of budget_seconds"),
        ({"budget_seconds": 5.0, "budget_epochs": 2.0}, "exactly one of budget_seconds"),
        ({"budget_seconds": -1.0}, "budget_seconds must be a positive"),
        ({"budget_seconds": float("nan")}, "budget_seconds must be a positive"),
        ({"budget_epochs": 0.0}, "budget_epochs must be positive"),
        ({"budget_epochs": 2.0, "search_fraction": 1.0}, "search_fraction must be in"),
    ],
)
def test_bad_budgets_raise(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_simplex_within_budget(_data(), **kwargs)


def test_budget_too_short_for_one_step_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="raise budget_seconds"):
        fit_simplex_within_budget(_data(), budget_seconds=1e-3, grid=TINY_GRID, threads=1)


def test_sample_configs_starts_with_the_anchor() -> None:
    configs = sample_configs({"dim": [64, 128], "lr": [0.1, 0.3]}, 3, seed=0)
    assert configs[0] == {"dim": 64, "lr": 0.1} and len(configs) == 3 and len({str(c) for c in configs}) == 3


@pytest.mark.parametrize("seed", range(5))
def test_sample_configs_covers_every_value_as_early_as_possible(seed: int) -> None:
    grid = {"dim": [128, 64, 256], "neg": [200, 64], "margin": [0.9, 0.8], "w": [150.0, 50.0], "lr": [0.1, 0.3]}
    cheap = {"dim": 64, "neg": 64, "margin": 0.9, "w": 150.0, "lr": 0.1}
    configs = sample_configs(grid, 8, seed=seed, lead=[cheap])
    assert configs[:2] == [{k: v[0] for k, v in grid.items()}, cheap] and len({str(c) for c in configs}) == 8
    # after the anchor and the cheap shape only dim 256, margin 0.8, w 50 and lr 0.3 are untried: the third
    # configuration brings all four, and the rest of the sample is the seeded permutation's order
    assert {k: configs[2][k] for k in ("dim", "margin", "w", "lr")} == {"dim": 256, "margin": 0.8, "w": 50.0, "lr": 0.3}
    assert [str(c) for c in sample_configs(grid, 8, seed=seed, lead=[cheap])] == [str(c) for c in configs]
    assert len({str(sample_configs(grid, 8, seed=s, lead=[cheap])) for s in range(5)}) > 1  # the seed matters
    with pytest.raises(ValueError, match="not in the grid"):
        sample_configs(grid, 3, lead=[{**cheap, "dim": 32}])


def test_refit_trains_the_final_model_on_train_and_validation() -> None:
    dm = _data()  # its test split raises when read
    n_train, n_val = len(dm.train_csr.indices), len(dm.val_csr.indices)
    kwargs = dict(budget_epochs=4, search_fraction=0.5, grid=TINY_GRID, num_configs=2, threads=1, batch_size=128)
    refit = fit_simplex_within_budget(dm, **kwargs)
    assert refit.refit and refit.train_positives == n_train + n_val
    last = [t for t in refit.trials if t.config == refit.config][-1]
    assert refit.val_recall == last.val_recall  # the search's score: the refit model has seen validation
    held_out = fit_simplex_within_budget(dm, **kwargs, refit=False)
    assert not held_out.refit and held_out.train_positives == n_train
    assert held_out.config == refit.config and held_out.max_steps == refit.max_steps  # same search, same plan
    # restarts choose their snapshot on validation, so they keep it held out; asking for both is refused
    cycles = fit_simplex_within_budget(dm, budget_epochs=4, search_fraction=0.0, grid=TINY_GRID, threads=1, cycles=2)
    assert not cycles.refit
    with pytest.raises(ValueError, match="pass refit=False"):
        fit_simplex_within_budget(dm, budget_epochs=4, grid=TINY_GRID, cycles=2, refit=True)


def _power_law(t: float, a: float = 0.3, b: float = 0.2) -> float:
    return a - b / t  # gains per doubling halve: the curve extrapolate_recall assumes by default


def test_extrapolate_recall_recovers_a_power_law() -> None:
    steps = [100.0, 200.0, 400.0]
    recall = [_power_law(s / 100) for s in steps]
    for final in (800.0, 6400.0, 1e6):
        assert extrapolate_recall(steps, recall, final) == pytest.approx(_power_law(final / 100), abs=1e-9)
        assert extrapolate_recall(steps[1:], recall[1:], final) == pytest.approx(_power_law(final / 100), abs=1e-9)


def test_extrapolation_prefers_the_configuration_that_gains_more_per_doubling() -> None:
    steps = [100.0, 200.0, 400.0]
    fast_start = [0.190, 0.196, 0.199]  # ahead after the last trial, but nearly flat
    slow_start = [0.170, 0.184, 0.193]  # behind, still gaining 0.009 a doubling
    assert fast_start[-1] > slow_start[-1]
    assert extrapolate_recall(steps, slow_start, 12_800) > extrapolate_recall(steps, fast_start, 12_800)
    # with no doublings left, the ranking is the last trial's
    assert extrapolate_recall(steps, slow_start, 400) == slow_start[-1]


@pytest.mark.parametrize(
    ("steps", "recall", "expected"),
    [
        ([100.0], [0.2], 0.2),  # one trial: no slope
        ([100.0, 200.0], [0.2, 0.19], 0.19),  # a loss is not projected
        ([100.0, 200.0, 400.0], [0.1, 0.1, 0.12], None),  # a flat start does not cancel a later gain
        # gains that grow (an S-curve taking off: the anchor's trials on dense data at 60 s, which had levelled off
        # at 0.36 and were projected to 0.79) and gains that stay equal are not projected
        ([70.0, 144.0, 339.0], [0.0092, 0.1149, 0.3583], 0.3583),
        ([100.0, 200.0, 400.0], [0.1, 0.15, 0.2], 0.2),
    ],
)
def test_extrapolate_recall_edge_cases(steps: list, recall: list, expected: float | None) -> None:
    got = extrapolate_recall(steps, recall, 1600.0)
    if expected is None:
        assert recall[-1] < got < recall[-1] + 0.02 * 2  # default ratio 0.5: at most one more gain of 0.02
    else:
        assert got == expected


def test_extrapolate_recall_measures_gains_only_over_a_long_enough_span() -> None:
    # the trials of a squeezed search (the anchor on dense data at 60 s): 122 -> 151 steps is 0.3 doublings, and the
    # noisy 0.075 between them made 0.24 per doubling and a prediction of 0.78 against 0.52 for the real winner
    steps, recall = [74.0, 122.0, 151.0], [0.0107, 0.0628, 0.1374]
    got = extrapolate_recall(steps, recall, 4136.0)
    # 122 is passed over: the slope is measured over 74 -> 151 with the default ratio, as from those two trials alone
    assert got == pytest.approx(extrapolate_recall([74.0, 151.0], [0.0107, 0.1374], 4136.0))
    assert recall[-1] < got < 0.3
    # no shorter trial far enough from the longest: nothing is projected
    assert extrapolate_recall([100.0, 140.0], [0.1, 0.3], 1e4) == 0.3
    # at exactly MIN_SPAN_RATIO the pair counts
    assert extrapolate_recall([100.0, 100.0 * MIN_SPAN_RATIO], [0.1, 0.2], 1e4) > 0.2


def test_extrapolate_recall_rejects_bad_trials() -> None:
    with pytest.raises(ValueError, match="as many steps"):
        extrapolate_recall([1.0, 2.0], [0.1], 8.0)
    with pytest.raises(ValueError, match="must increase"):
        extrapolate_recall([2.0, 2.0], [0.1, 0.2], 8.0)


def test_selection_ranks_trials_by_extrapolation_or_last_score() -> None:
    dm = _data()
    grid = {**TINY_GRID, "lr": [0.1, 0.3, 1.0, 3.0]}  # 4 configurations: rounds of 4 and 2 trials
    kwargs = dict(budget_epochs=12, search_fraction=0.5, grid=grid, num_configs=4, threads=1, batch_size=128)
    for selection, score in (("extrapolate", "predicted_recall"), ("last", "val_recall")):
        fit = fit_simplex_within_budget(dm, **kwargs, selection=selection, keep_anchor=False)
        assert fit.selection == selection
        first, second = ([t for t in fit.trials if t.round == r] for r in range(2))
        assert (len(first), len(second)) == (4, 2)
        assert all(t.predicted_recall == t.val_recall for t in first)  # one trial each: nothing to extrapolate
        assert all(t.predicted_recall >= t.val_recall for t in second)  # losses are not projected
        # round 1 goes on with the best two of round 0, and the best of round 1 is the final configuration
        assert [t.config for t in second] == [t.config for t in sorted(first, key=lambda t: -getattr(t, score))[:2]]
        assert fit.config == max(second, key=lambda t: getattr(t, score)).config
    with pytest.raises(ValueError, match="selection must be"):
        fit_simplex_within_budget(dm, **kwargs, selection="best")


@pytest.mark.slow
def test_keep_anchor_takes_the_anchor_to_the_last_round() -> None:
    dm = _data()
    # the anchor (lr 0.01) learns least in a short trial, so plain successive halving cuts it in round 0
    grid = {**TINY_GRID, "lr": [0.01, 0.3, 1.0, 3.0]}
    kwargs = dict(budget_epochs=40, search_fraction=0.5, grid=grid, num_configs=4, threads=1, batch_size=128)
    anchor = {k: v[0] for k, v in grid.items()}
    plain = fit_simplex_within_budget(dm, **kwargs, keep_anchor=False)
    assert anchor not in [t.config for t in plain.trials if t.round == 1]
    hedged = fit_simplex_within_budget(dm, **kwargs)
    last_round = [t.config for t in hedged.trials if t.round == 1]
    assert anchor in last_round and len(last_round) == 3  # the best two and the anchor
    assert any("keep_anchor" in note for note in hedged.notes)
    assert hedged.config == max((t for t in hedged.trials if t.round == 1), key=lambda t: t.predicted_recall).config


@pytest.mark.slow
def test_a_budget_too_short_to_search_trains_the_anchor_at_the_cheapest_shape() -> None:
    grid = {"dim": [32, 16], "num_negatives": [16, 8], "lr": [0.3, 0.1], "margin": [0.9]}
    # no first-round trial can have 10^4 epochs: the search is skipped
    fit = fit_simplex_within_budget(
        _data(), budget_seconds=4.0, grid=grid, threads=1, batch_size=128, min_trial_epochs=1e4
    )
    assert fit.trials == [] and any("search skipped" in note for note in fit.notes)
    assert fit.config == {"dim": 16, "num_negatives": 8, "lr": 0.3, "margin": 0.9}
    assert fit.model.item_embedding.weight.shape[1] == 16 and fit.final_lr == 0.0


def test_the_search_starts_with_the_anchor_at_both_ends_of_the_cost_range() -> None:
    grid = {"dim": [32, 16], "num_negatives": [16, 8], "lr": [0.3, 0.1], "margin": [0.9]}
    fit = fit_simplex_within_budget(_data(), budget_epochs=6, grid=grid, num_configs=3, threads=1, batch_size=128)
    first = [t.config for t in fit.trials if t.round == 0]
    assert first[:2] == [
        {"dim": 32, "num_negatives": 16, "lr": 0.3, "margin": 0.9},
        {**first[0], "dim": 16, "num_negatives": 8},
    ]
    assert len(first) == 3 and len({str(c) for c in first}) == 3


def test_round_shares_double_even_when_the_anchor_is_kept() -> None:
    from lightning_sdp.recipes.search import _round_sizes, _share_of_rest

    assert _round_sizes(8, 3, keep_anchor=True) == [8, 5, 3]
    assert _round_sizes(8, 3, keep_anchor=False) == [8, 4, 2]
    assert _round_sizes(3, 2, keep_anchor=True) == [3, 2]
    # 8 + 5 * 2 + 3 * 4 = 30 units: a first-round trial gets 1/30 of the search, a second-round one twice that
    assert _share_of_rest(8, [5, 3], 0) == pytest.approx(1 / 30)
    assert _share_of_rest(5, [3], 1) == pytest.approx(2 / 22)
    assert _share_of_rest(1, [], 2) == 1.0  # the last trial of the search takes whatever is left


@pytest.mark.slow
def test_kept_anchor_does_not_shorten_the_last_round() -> None:
    dm = _data()
    grid = {**TINY_GRID, "lr": [0.01, 0.3, 1.0, 3.0]}  # the anchor (lr 0.01) is cut in round 0 and kept
    fit = fit_simplex_within_budget(
        dm, budget_epochs=40, search_fraction=0.5, grid=grid, num_configs=4, threads=1, batch_size=128
    )
    first, second = ([t.steps for t in fit.trials if t.round == r] for r in range(2))
    assert len(first) == 4 and len(second) == 3
    assert min(second) >= 2 * max(first) - 1  # twice the steps (less integer rounding), not 4/3 as before


def test_wall_clock_decay_sets_each_rate_from_the_time_elapsed_and_stops_at_zero() -> None:
    from lightning_sdp.recipes.clocks import _WallClockLinearDecay

    class _Trainer:
        def __init__(self) -> None:
            self.optimizers = [torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.4)]
            self.optimizers[0].add_param_group({"params": [torch.zeros(1, requires_grad=True)], "lr": 0.04})
            self.should_stop = False

    now = [100.0]
    decay = _WallClockLinearDecay(10.0, clock=lambda: now[0])
    trainer = _Trainer()
    decay.on_train_start(trainer, None)
    used = []
    for _ in range(20):
        decay.on_train_batch_start(trainer, None, None, 0)
        used.append([g["lr"] for g in trainer.optimizers[0].param_groups])
        now[0] += 3.0  # each step takes 3 s: steps start at 0, 3, 6 and 9 s of a 10-s schedule
        decay.on_train_batch_end(trainer, None, None, None, 0)
        if trainer.should_stop:
            break
    np.testing.assert_allclose(used, [[0.4 * f, 0.04 * f] for f in (1.0, 0.7, 0.4, 0.1)])
    assert decay.steps == 4 and trainer.should_stop  # the step that passed 10 s was the last
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == [0.0, 0.0]  # what a next step would use
    with pytest.raises(ValueError, match="positive"):
        _WallClockLinearDecay(0.0)


def test_seconds_budget_schedule_runs_on_the_clock() -> None:
    dm = _data()
    runner = SimpleXRunner(tuple(np.asarray(a) for a in dm.train_csr), dm.num_items, 16, 1, 0, {})
    config = {k: v[0] for k, v in TINY_GRID.items()}
    model, clock, _ = runner.fit(config, -1, seconds=0.6)
    assert clock.final_lr == 0.0 and len(clock.ends) > 2  # stopped by the decay, not by a step count
    assert 0.6 <= clock.train_seconds < 0.6 + 10 * clock.seconds_per_step + 0.5
    assert model.hparams.lr_schedule == "constant"  # the decay came from the fit's callback


def test_the_search_can_choose_between_the_losses() -> None:
    """HEAT's softmax loss (with gradient clipping) is a grid value like any other SimpleXModule argument."""
    dm = _data()
    grid = {**TINY_GRID, "loss": ["ccl", "softmax"], "grad_clip": [0.1]}
    fit = fit_simplex_within_budget(
        dm, budget_epochs=6, search_fraction=0.5, grid=grid, num_configs=2, threads=1, batch_size=128
    )
    assert {t.config["loss"] for t in fit.trials} == {"ccl", "softmax"}
    assert fit.model.config.loss == fit.config["loss"] and fit.model.config.grad_clip == 0.1
    assert fit.final_lr == 0.0 and 0.0 < fit.val_recall <= 1.0


def test_timed_trials_run_on_the_clock_whatever_the_step_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial sized from a wrong step-time estimate (here a million steps) still ends inside its share of the
    search: its schedule decays on the clock, and its steps are counted afterwards."""
    from lightning_sdp.recipes.plan import BudgetPlan

    monkeypatch.setattr(BudgetPlan, "trial_steps", lambda self, config, seconds: 10**6 if seconds > 0 else 0)
    fit = fit_simplex_within_budget(
        _data(), budget_seconds=5.0, grid=TINY_GRID, num_configs=2, threads=1, batch_size=128, min_trial_seconds=0.2
    )
    assert fit.trials
    for trial in fit.trials:
        assert 1 <= trial.steps < 10**6
        assert trial.train_seconds <= trial.seconds_allowed + 0.5  # one step past the end at most, plus slack
    assert fit.final_lr == 0.0


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
    from lightning_sdp.metrics import evaluate_ranking

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
