"""A time-budgeted SimpleX / MF-CCL recipe: size the schedule to the budget and pick hyper-parameters on validation.

HEAT's fused kernel (Zhang et al., ICS 2023) trains with per-sample SGD whose rate must decay to reach a good optimum,
and with the tile sampler the model is poor until the last part of the decay. So a run has to know its length up
front. :func:`fit_simplex_within_budget` turns a wall-clock (or epoch) budget into a step count:

1. **probe**: a few fused steps per candidate shape (``dim`` x ``num_negatives``) measure the time per step;
2. **search** (``search_fraction`` of the budget, default 30 %, probes and validation included): successive halving
   over a seeded sample of a small grid (``dim``, ``num_negatives``, ``margin``, ``negative_weight``, ``lr``), led by
   the anchor configuration and the anchor at the grid's cheapest shape (smallest ``dim`` and ``num_negatives``),
   so that a short search still compares a configuration for long budgets with one that can do many epochs
   (:mod:`lightning_sdp.recipes.search`);
3. **fit**: the winner trains for the rest of the budget with a rate that decays linearly to 0 *on the clock*
   (:class:`~lightning_sdp.recipes.clocks._WallClockLinearDecay`: a step's rate is set from the training time
   elapsed, and the fit stops when it reaches 0), so the schedule ends with the budget however the step time drifts
   (an epoch budget counts steps instead). With ``cycles > 1`` the fit is a series of warm restarts (Loshchilov &
   Hutter, SGDR) of doubling length, each decaying to 0 and scored on validation, and the best snapshot is kept: so
   the training length is chosen on validation too (a longer schedule is not always better). Without restarts the
   final fit trains on the training *and* validation interactions (``refit``): validation has done its job once the
   configuration is chosen, and the interactions it holds are worth training on. A final fit that keeps validation
   held out (``refit=False``) is scored on it at a few points of its schedule, and the best weights are returned
   (:mod:`lightning_sdp.recipes.checkpoints`).

The recipe never receives the test split: it carves validation out of the training interactions (or uses the
datamodule's ``val_csr``), so the test split can be scored once, afterwards. :class:`BudgetPlan` holds the budget's
arithmetic, :class:`SuccessiveHalving` the search; this module only wires them together.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_sdp.datamodules.interactions import merge_csr, split_validation
from lightning_sdp.models.simplex import SimpleXModule
from lightning_sdp.models.simplex.auto import auto_grid, explain
from lightning_sdp.recipes.checkpoints import _BestOnValidation, val_check_count
from lightning_sdp.recipes.clocks import _FitClock, schedule_progress
from lightning_sdp.recipes.plan import BudgetPlan, shape_key
from lightning_sdp.recipes.runner import SimpleXRunner, default_batch_size
from lightning_sdp.recipes.search import (
    SuccessiveHalving,
    Trial,
    ValidationScorer,
    cheapest_shape,
    recipe_configs,
    sample_configs,
)

_log = logging.getLogger(__name__)
_EVAL_WARMUP_USERS = 256
_CSR = tuple[np.ndarray, np.ndarray]


@dataclass
class BudgetedFit:
    """What :func:`fit_simplex_within_budget` did: the trained model, the chosen settings and the time spent.

    ``cycle_steps`` and ``cycle_val_recall`` describe the final fit's warm-restart cycles (validation recall on the
    search's user sample; without restarts, one entry: the final validation recall), ``chosen_cycle`` the snapshot
    returned. With ``refit`` the final model trained on validation too (``train_positives`` counts what it trained
    on), so ``val_recall`` / ``val_ndcg`` are the chosen configuration's last search trial's instead of its own
    (NaN when there was no search). ``max_steps`` and ``cycle_steps`` count the final fit's steps: planned for an
    epoch budget, counted for a seconds budget (whose schedule runs on the clock). The final model's
    ``hparams.lr_schedule`` is then ``"constant"``: the decay was applied by the fit's callback, not the module.
    ``grid`` is the search space used (given, or chosen for ``data_stats``, the training split's statistics).
    ``check_steps`` / ``check_val_recall`` are the final fit's validation checks (its end last; empty when it had
    none) and ``chosen_check`` the one whose weights were returned (``-1``: no checks).
    """

    model: SimpleXModule
    config: dict[str, Any]
    max_steps: int
    batch_size: int
    budget_seconds: float | None
    budget_epochs: float | None
    search_seconds: float
    fit_seconds: float
    train_seconds: float
    final_lr: float
    val_recall: float
    val_ndcg: float
    trials: list[Trial] = field(default_factory=list)
    seconds_per_step: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    cycle_steps: list[int] = field(default_factory=list)
    cycle_val_recall: list[float] = field(default_factory=list)
    chosen_cycle: int = 0
    refit: bool = False
    train_positives: int = 0
    selection: str = "extrapolate"
    grid: dict[str, list[Any]] = field(default_factory=dict)
    data_stats: dict[str, Any] = field(default_factory=dict)
    check_steps: list[int] = field(default_factory=list)
    check_val_recall: list[float] = field(default_factory=list)
    chosen_check: int = -1

    def summary(self) -> dict[str, Any]:
        """JSON-friendly summary (no model)."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("model", "trials")}
        out["trials"] = [t.__dict__ for t in self.trials]
        return out


@dataclass
class _FinalFit:
    """The final fit's restart cycles: a snapshot (model and clock) per cycle, and what each was measured at."""

    snapshots: list[tuple[SimpleXModule, _FitClock]]
    cycle_steps: list[int]
    cycle_val_recall: list[float]
    fit_seconds: float
    check_steps: list[int]
    check_val_recall: list[float]
    chosen_check: int

    @property
    def chosen(self) -> int:
        """The cycle returned: the best on validation when there are several."""
        return int(np.argmax(self.cycle_val_recall)) if len(self.snapshots) > 1 else 0


def _check_options(
    budget_seconds: float | None,
    budget_epochs: float | None,
    search_fraction: float,
    selection: str,
    cycles: int,
    refit: bool | None,
    val_checks: int | None = None,
) -> bool:
    """Raise on a bad budget or option; return ``refit`` resolved (``None``: refit unless there are restarts)."""
    if (budget_seconds is None) == (budget_epochs is None):
        raise ValueError(
            "fit_simplex_within_budget: give exactly one of budget_seconds (wall clock) or budget_epochs, got "
            f"budget_seconds={budget_seconds}, budget_epochs={budget_epochs}."
        )
    if budget_seconds is not None and not (math.isfinite(budget_seconds) and budget_seconds > 0):
        raise ValueError(f"fit_simplex_within_budget: budget_seconds must be a positive number, got {budget_seconds}.")
    if budget_epochs is not None and not (math.isfinite(budget_epochs) and budget_epochs > 0):
        raise ValueError(f"fit_simplex_within_budget: budget_epochs must be positive, got {budget_epochs}.")
    if not 0.0 <= search_fraction < 1.0:
        raise ValueError(
            f"fit_simplex_within_budget: search_fraction must be in [0, 1) (0 skips the search), got {search_fraction}."
        )
    if selection not in ("extrapolate", "last"):
        raise ValueError(f"fit_simplex_within_budget: selection must be 'extrapolate' or 'last', got {selection!r}.")
    if cycles < 1:
        raise ValueError(f"fit_simplex_within_budget: cycles must be at least 1, got {cycles}.")
    if refit and cycles > 1:
        raise ValueError(
            f"fit_simplex_within_budget: cycles={cycles} chooses its snapshot on validation, so the final fit cannot "
            "train on validation; pass refit=False (or cycles=1)."
        )
    refit = cycles == 1 if refit is None else refit
    val_check_count(val_checks, None, 1.0)  # refuses a negative count before the search spends the budget
    if val_checks and (refit or cycles > 1):
        raise ValueError(
            f"fit_simplex_within_budget: val_checks={val_checks} scores the final fit on validation, which "
            f"{'it trains on (refit)' if refit else 'the restart cycles already choose from'}; pass refit=False and "
            "cycles=1, or leave val_checks=None."
        )
    return refit


def _csr_of(source: Any, name: str) -> _CSR | None:
    """``source.<name>`` (a CSR tuple such as ``InteractionsDataModule.train_csr``) as int64 arrays, or ``None``."""
    value = getattr(source, name, None)
    return None if value is None else (np.asarray(value[0], np.int64), np.asarray(value[1], np.int64))


def _split_data(
    data: Any, val: _CSR | None, val_fraction: float, seed: int, notes: list[str]
) -> tuple[_CSR, _CSR, int]:
    """``(train, val, num_items)`` from a datamodule or a train CSR; the test split is never read."""
    train: _CSR | None
    num_items: int | None
    if isinstance(data, tuple):
        train, num_items = (np.asarray(data[0], np.int64), np.asarray(data[1], np.int64)), None
        if val is not None:
            val = (np.asarray(val[0], np.int64), np.asarray(val[1], np.int64))
    else:
        if getattr(data, "num_items", None) is None and hasattr(data, "setup"):
            data.setup("fit")
        train, val, num_items = _csr_of(data, "train_csr"), _csr_of(data, "val_csr"), data.num_items
        if train is None:
            raise TypeError(
                "fit_simplex_within_budget: data must be an InteractionsDataModule or a (indptr, indices) train CSR, "
                f"got {type(data).__name__}."
            )
    if val is None or len(val[1]) == 0:
        train_part, val_part = split_validation(train[0], train[1], val_fraction, seed)
        train, val = (train_part[0], train_part[1]), (val_part[0], val_part[1])
        notes.append(
            f"validation carved from the training interactions (split_validation, fraction {val_fraction}, seed "
            f"{seed}); the search trains on the rest"
        )
    if num_items is None:
        num_items = int(max(train[1].max(initial=-1), val[1].max(initial=-1))) + 1
    if len(val[1]) == 0:
        raise ValueError(
            "fit_simplex_within_budget: the validation split is empty (every user has fewer than 2 training items?); "
            "raise val_fraction or use data with more interactions per user."
        )
    return train, val, int(num_items)


def _user_sample(val: _CSR, max_users: int, seed: int) -> np.ndarray:
    """Validation users with an item, a seeded sample of ``max_users`` of them when there are more."""
    users = np.flatnonzero(np.diff(val[0]) > 0)
    if len(users) > max_users:
        users = np.sort(np.random.default_rng(seed).choice(users, max_users, replace=False))
    return users


def _warm_up(runner: SimpleXRunner, scorer: ValidationScorer, grid: Mapping[str, Sequence[Any]]) -> None:
    """Compile the kernel (once, cached on disk) and warm the scoring path before the budget's clock starts.

    The scoring path's first call in a process costs more than a later one (allocator and thread-pool warm-up): paid
    here, like the compilation, so that the scoring time the search measures is what each trial will pay.
    """
    warm, _, _ = runner.fit(sample_configs(grid, 1)[0], 1)
    scorer.score(warm, scorer.users[:_EVAL_WARMUP_USERS])


def _fit_final(
    plan: BudgetPlan,
    search_runner: SimpleXRunner,
    runner: SimpleXRunner,
    scorer: ValidationScorer,
    config: dict[str, Any],
    cycles: int,
    val_checks: int | None,
    notes: list[str],
) -> _FinalFit:
    """Train ``config`` for what is left of the budget as ``cycles`` warm restarts on ``runner``'s data.

    One schedule on held-out data (no restarts, no refit) is scored on validation at ``val_checks`` points and at
    its end, and the best weights are kept (:class:`~lightning_sdp.recipes.checkpoints._BestOnValidation`).
    """
    if plan.timed and not plan.knows(config):
        plan.step_seconds[shape_key(config)] = search_runner.probe(config)
    cycle_steps, cycle_seconds = plan.final_cycles(config, cycles)
    held_out = runner is search_runner and cycles == 1
    checks = val_check_count(val_checks, cycle_seconds[0], plan.eval_seconds) if held_out else 0
    checker = _BestOnValidation(lambda m: scorer.score(m, scorer.users)[0], checks, schedule_progress)
    snapshots: list[tuple[SimpleXModule, _FitClock]] = []
    cycle_val: list[float] = []
    fit_seconds = 0.0
    for i, (steps, seconds) in enumerate(zip(cycle_steps, cycle_seconds, strict=True)):
        guard = None if plan.budget_seconds is None else 2.0 * max(1.0, plan.budget_seconds - plan.elapsed())
        model, clock, wall = runner.fit(
            config,
            steps,
            guard,
            init=snapshots[-1][0] if snapshots else None,
            cycle=i,
            seconds=seconds,
            callbacks=[checker] if checks else (),
        )
        cycle_steps[i] = len(clock.ends)
        fit_seconds += wall
        if clock.final_lr > 0:
            notes.append(f"cycle {i} was cut at {guard:.0f}s before its schedule ended (the step time rose under load)")
            _log.warning("fit_simplex_within_budget: %s.", notes[-1])
        snapshots.append((model, clock))
        if cycles > 1:
            cycle_val.append(scorer.score(model, scorer.users)[0])
    if checks:
        checker.finish(snapshots[0][0], cycle_steps[0])
        if checker.chosen < len(checker.steps) - 1:
            notes.append(
                f"the final fit's validation check at step {checker.steps[checker.chosen]} of {cycle_steps[0]} "
                f"scored {checker.val_recall[checker.chosen]:.4f} against {checker.val_recall[-1]:.4f} at the end: "
                "its weights are returned"
            )
            _log.info("fit_simplex_within_budget: %s.", notes[-1])
    return _FinalFit(snapshots, cycle_steps, cycle_val, fit_seconds, checker.steps, checker.val_recall, checker.chosen)


def _validation_of(
    final: _FinalFit, scorer: ValidationScorer, trials: list[Trial], best: dict[str, Any], refit: bool, notes: list[str]
) -> tuple[float, float]:
    """The validation scores to report: the final model's, or after a refit (the model has seen validation) the
    chosen configuration's last search trial's (NaN without a search)."""
    if refit:
        best_trials = [t for t in trials if t.config == best]
        notes.append(
            "the final model trained on train + validation (refit); val_recall is its configuration's last search trial"
        )
        return (best_trials[-1].val_recall, best_trials[-1].val_ndcg) if best_trials else (math.nan, math.nan)
    notes.append("the final model trained on train minus validation (refit=False)")
    return scorer.score(final.snapshots[final.chosen][0], None)


def fit_simplex_within_budget(
    data: Any,
    budget_seconds: float | None = None,
    budget_epochs: float | None = None,
    search_fraction: float = 0.3,
    grid: dict[str, Sequence[Any]] | None = None,
    num_configs: int = 8,
    min_trial_seconds: float = 0.5,
    min_trial_epochs: float = 3.0,
    val: tuple[np.ndarray, np.ndarray] | None = None,
    num_items: int | None = None,
    val_fraction: float = 0.1,
    max_eval_users: int = 5000,
    batch_size: int | None = None,
    threads: int | None = None,
    model_kwargs: dict[str, Any] | None = None,
    k: int = 20,
    seed: int = 0,
    cycles: int = 1,
    refit: bool | None = None,
    selection: str = "extrapolate",
    keep_anchor: bool = True,
    val_checks: int | None = None,
) -> BudgetedFit:
    """Choose SimpleX hyper-parameters on validation and train the winner so that its schedule ends in the budget.

    Args:
        data: an :class:`~lightning_sdp.datamodules.InteractionsDataModule` (its ``train_csr``, and ``val_csr`` when
            it has a validation split; its test split is never read) or a training CSR ``(indptr, indices)``.
        budget_seconds: wall-clock budget of the probe, the search and the final fit (the clock starts after the
            data is split and the kernel compiled, a one-time cost cached on disk); or
        budget_epochs: budget in epochs over the training positives (deterministic; no probe).
        search_fraction: share of the budget spent on the search; ``0`` trains the anchor configuration directly.
            Default 0.3.
        grid: :class:`SimpleXModule` argument -> candidates; ``None`` (default) chooses it from the training data
            (:func:`~lightning_sdp.models.simplex.auto.auto_grid`: HEAT's softmax loss from 0.15% density up, the
            cosine contrastive loss's :data:`~lightning_sdp.recipes.CCL_GRID` below), said in ``notes``.
        num_configs: configurations tried: the anchor, the anchor at the grid's smallest ``dim`` and
            ``num_negatives``, then a seeded sample of the rest of the grid that covers every value first
            (:func:`~lightning_sdp.recipes.sample_configs`); fewer (from the front) when the search
            budget cannot give each at least ``min_trial_seconds`` / ``min_trial_epochs``. Default 8.
        min_trial_seconds: shortest first-round trial worth scoring (seconds budgets). Default 0.5.
        min_trial_epochs: shortest first-round trial, in epochs of the anchor configuration (seconds budgets):
            fewer configurations are tried when the search budget cannot give each this much after the Trainer's
            set-up and the validation scoring (both measured on a short fit of the anchor). When not even two fit,
            the search is skipped and the anchor's settings train at the grid's smallest ``dim`` and
            ``num_negatives``. Default 3: after trials of about one epoch, validation scores are mostly noise and
            can rank two configurations the other way round from longer trials of them.
        val: validation CSR to use with a training CSR ``data`` (e.g. a benchmark's shared split); ``None`` carves one.
        num_items: number of items with a training CSR ``data`` (``None``: the largest id seen + 1).
        val_fraction: share of each user's items carved out for validation when there is no validation split.
            Default 0.1.
        max_eval_users: validation users scored per trial (a seeded subset; the final model is scored on all).
            Default 5000.
        batch_size: positives per step; ``None`` picks ``clip(num_positives // 64, 1024, 16384)``.
        threads: threads for torch and the kernel (``HEATAccelerator(num_threads=...)``); ``None``: ``OMP_NUM_THREADS``
            when it is set, else every core.
        model_kwargs: further fixed :class:`SimpleXModule` arguments (e.g. ``g=0.8``, ``sampler="uniform"``).
        k: cut-off of Recall/NDCG@K. Default 20.
        seed: seed of the models, the shuffles, the config sample and the validation split. Default 0.
        cycles: the final fit as this many warm restarts of doubling length (steps in the ratio 1 : 2 : 4 ...),
            each decaying to 0 and scored on validation; the best snapshot is returned. ``1`` (default): one
            schedule over the whole rest of the budget.
        refit: train the final model on the training and validation interactions together, once validation has
            chosen the configuration (nothing is scored on validation afterwards). ``None`` (default): ``True``
            unless ``cycles > 1``, whose snapshots are chosen on validation, which must then stay held out.
        selection: how successive halving ranks its trials: ``"extrapolate"`` (default) by the validation Recall
            each configuration's trials extrapolate to at the final fit's length
            (:func:`~lightning_sdp.recipes.extrapolate_recall`), so a configuration that learns slower but further
            is not cut for being behind after a short trial; ``"last"`` by the last trial's validation Recall.
        keep_anchor: the anchor configuration (the grid's first values, the documented recipe) is never cut before
            the last round, where it competes with the others on equal terms. Successive halving's first rounds
            are short and cut configurations that start slowly but end ahead (a larger dimension), the weakness
            Hyperband (Li et al., JMLR 2018) hedges with a bracket of few configurations trained long; keeping
            the prior's best guess is that hedge at the cost of at most one trial per round. Default ``True``.
        val_checks: validation checks inside a final fit on held-out data (``refit=False``, ``cycles=1``): the
            schedule is scored at this many evenly spaced points and at its end, and the best weights are returned
            (the fit is never cut short: the end of a linear decay is where it converges). ``None`` (default): up to
            8, as many as cost at most 5% of the final fit's time in scoring; none with ``refit`` or restarts.

    Returns:
        A :class:`BudgetedFit` with the trained model, its settings, ``max_steps`` and every trial.

    Raises:
        ValueError: a missing, non-positive or doubled budget, a ``search_fraction`` outside ``[0, 1)``, or a budget
            too short for even one training step after the probe, ``cycles < 1``, ``refit=True`` with
            ``cycles > 1``, an unknown ``selection``, or ``val_checks`` negative or given with ``refit`` or
            restarts.
        TypeError: ``data`` is neither an interactions datamodule nor a CSR tuple.
    """
    refit = _check_options(budget_seconds, budget_epochs, search_fraction, selection, cycles, refit, val_checks)
    notes: list[str] = []
    train, val, found_items = _split_data(data, val, val_fraction, seed, notes)
    num_items = num_items if num_items is not None else found_items
    batch_size = default_batch_size(len(train[1])) if batch_size is None else batch_size
    runner = SimpleXRunner(train, num_items, batch_size, threads, seed, dict(model_kwargs or {}))
    scorer = ValidationScorer(train, val, num_items, k, _user_sample(val, max_eval_users, seed))
    if grid is None:
        notes.append(f"grid chosen for the training data: {explain(runner.stats)}")
        _log.info("fit_simplex_within_budget: %s.", notes[-1])
    search_grid: Mapping[str, Sequence[Any]] = auto_grid(runner.stats) if grid is None else grid
    _warm_up(runner, scorer, search_grid)
    # the budget starts after loading and the one-time warm-ups
    plan = BudgetPlan.create(budget_seconds, budget_epochs, search_fraction, runner.steps_per_epoch)
    configs = recipe_configs(search_grid, num_configs, seed)
    search = SuccessiveHalving(plan, runner, scorer, selection, keep_anchor, min_trial_seconds, min_trial_epochs, notes)
    best = search.run(configs, fallback=cheapest_shape(configs[0], search_grid))
    search_seconds = plan.elapsed()
    # the same batch size, so the step times measured in the search still hold for the larger refit data
    final_runner = (
        SimpleXRunner(merge_csr(train, val), num_items, batch_size, threads, seed, dict(model_kwargs or {}))
        if refit
        else runner
    )
    final = _fit_final(plan, runner, final_runner, scorer, best, cycles, val_checks, notes)
    val_recall, val_ndcg = _validation_of(final, scorer, search.trials, best, refit, notes)
    model, clock = final.snapshots[final.chosen]
    return BudgetedFit(
        model=model,
        config=dict(best),
        max_steps=sum(final.cycle_steps),
        batch_size=batch_size,
        budget_seconds=budget_seconds,
        budget_epochs=budget_epochs,
        search_seconds=search_seconds,
        fit_seconds=final.fit_seconds,
        train_seconds=sum(c.train_seconds for _, c in final.snapshots),
        final_lr=clock.final_lr,
        val_recall=val_recall,
        val_ndcg=val_ndcg,
        trials=search.trials,
        seconds_per_step=plan.step_seconds,
        notes=notes,
        cycle_steps=final.cycle_steps,
        cycle_val_recall=final.cycle_val_recall if cycles > 1 else [val_recall],
        chosen_cycle=final.chosen,
        refit=refit,
        train_positives=len(final_runner.pairs),
        selection=selection,
        grid={k: list(v) for k, v in search_grid.items()},
        data_stats=runner.stats.to_dict(),
        check_steps=final.check_steps,
        check_val_recall=final.check_val_recall,
        chosen_check=final.chosen_check,
    )
