"""The budgeted search: configurations sampled from a grid, successive halving on validation, learning-curve ranking.

Successive halving tries the configurations in short trials, keeps the better half and trains it twice as long,
until one is left. Every trial is a complete short run whose linear schedule decays to 0 inside its own share of
the time (on the clock, like the final fit, for a seconds budget), scored on the validation split only. The halves are ranked by the validation score each configuration's
trials *extrapolate* to at the final fit's length (:func:`extrapolate_recall`): the final fit is several doublings
longer than the last trial, and a larger dimension that is behind after a short schedule but gains more per
doubling is the better choice for it.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_sdp.metrics import evaluate_ranking
from lightning_sdp.models.simplex import SimpleXModule
from lightning_sdp.recipes.plan import BudgetPlan, shape_key
from lightning_sdp.recipes.runner import SimpleXRunner

_log = logging.getLogger(__name__)

#: Validation users scored to time a scoring of the whole user sample (the time grows with the users scored).
EVAL_TIMING_USERS = 1024
#: Ratio of successive gains per doubling of the schedule assumed when a configuration has only two trials (each
#: doubling of the training length buys half the previous one's gain: a power law ``a - b t^-1``).
DEFAULT_GAIN_RATIO = 0.5
#: Upper bound of a measured gain ratio: gains that do not shrink would extrapolate without limit.
MAX_GAIN_RATIO = 0.8
#: Shortest ratio of two trials' lengths that measures a gain per doubling: between closer trials (a squeezed search
#: gives rounds of nearly equal length) the difference of two noisy scores is divided by a small log2 and explodes.
MIN_SPAN_RATIO = 1.5


@dataclass
class Trial:
    """One configuration trained for ``steps`` steps (a complete linear schedule) and scored on validation."""

    config: dict[str, Any]
    round: int
    steps: int
    seconds_allowed: float
    train_seconds: float = 0.0
    fit_seconds: float = 0.0
    val_recall: float = float("nan")
    val_ndcg: float = float("nan")
    #: validation Recall extrapolated to the final fit's length, set when the round is ranked; recorded under either
    #: ``selection`` (with ``"last"`` it is for the record only and ranks nothing)
    predicted_recall: float = float("nan")


# ---------------------------------------------------------------------------------------------------- configurations
def sample_configs(
    grid: Mapping[str, Sequence[Any]], num_configs: int, seed: int = 0, lead: Sequence[dict[str, Any]] = ()
) -> list[dict[str, Any]]:
    """The anchor (first value of every list), then ``lead``, then a seeded sample of the rest of the grid's product.

    The sample is ordered to cover the grid first: each next configuration is the one (of a seeded permutation) that
    brings the most values not yet tried, until every value of every list is in; the permutation's order after
    that. A short search tries only the first few configurations, and a random few can all share a value that
    suits the data badly (on a dense catalogue the anchor's negative weight plateaus early); a space-filling start
    compares both ends of every hyper-parameter as soon as there are enough configurations to.

    Args:
        grid: :class:`SimpleXModule` argument -> candidate values.
        num_configs: how many configurations to return (at most the product's size).
        seed: seed of the sample.
        lead: configurations of the grid to place right after the anchor (counted as covering their values).

    Raises:
        ValueError: an empty grid entry, or a ``lead`` configuration that is not in the grid.
    """
    if not grid or any(len(v) == 0 for v in grid.values()):
        raise ValueError(f"sample_configs: every grid entry needs at least one value, got {grid}.")
    keys = list(grid)
    product = [dict(zip(keys, values, strict=True)) for values in itertools.product(*(grid[k] for k in keys))]
    for config in lead:
        if config not in product:
            raise ValueError(f"sample_configs: lead configuration {config} is not in the grid {dict(grid)}.")
    chosen = [product[0]] + [c for c in lead if c != product[0]]
    covered = {(k, repr(v)) for c in chosen for k, v in c.items()}
    order = np.random.default_rng(seed).permutation(len(product) - 1)
    rest = [product[1 + i] for i in order if product[1 + i] not in chosen]
    while rest and len(chosen) < num_configs:
        new_values = [sum((k, repr(v)) not in covered for k, v in c.items()) for c in rest]
        pick = new_values.index(max(new_values))  # the earliest of the most covering
        chosen.append(rest.pop(pick))
        covered |= {(k, repr(v)) for k, v in chosen[-1].items()}
    return chosen[: max(1, num_configs)]


def cheapest_shape(anchor: dict[str, Any], grid: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    """``anchor`` with the grid's smallest ``dim`` and ``num_negatives``: the most epochs a short budget can buy."""
    return {**anchor, **{k: min(grid[k]) for k in ("dim", "num_negatives") if k in grid}}


def recipe_configs(grid: Mapping[str, Sequence[Any]], num_configs: int, seed: int = 0) -> list[dict[str, Any]]:
    """The configurations :func:`~lightning_sdp.recipes.fit_simplex_within_budget` searches, in its order: the
    anchor, the anchor at the grid's cheapest shape (the two ends of the cost range), then :func:`sample_configs`'
    covering sample."""
    cheap = cheapest_shape(sample_configs(grid, 1)[0], grid)
    return sample_configs(grid, num_configs, seed, lead=[cheap])


# ---------------------------------------------------------------------------------------------------- extrapolation
def extrapolate_recall(
    steps: Sequence[float], recall: Sequence[float], final_steps: float, default_ratio: float = DEFAULT_GAIN_RATIO
) -> float:
    """Validation Recall a configuration would reach with a complete schedule of ``final_steps`` steps.

    The search's trials of one configuration are complete schedules of doubling length, so their scores trace its
    learning curve. A configuration that is behind after a short trial but gains more per doubling (a larger
    dimension, more negatives) can finish ahead after the much longer final fit; ranking on the last trial alone
    misses that. The gain per doubling ``d`` of the two longest trials is assumed to shrink by a ratio ``q`` per
    further doubling (measured from the last three trials when there are three, clipped to
    ``(0, MAX_GAIN_RATIO]``; ``default_ratio`` otherwise). Three trials whose gains grow are the rise of an
    S-shaped curve (a slow start, then take-off), which says nothing of where the curve levels off: they are not
    projected (on a dense catalogue such a projection chose a configuration that levels off far below the search's
    best trial). Only trials at least :data:`MIN_SPAN_RATIO` times shorter than the next one used count (the others
    are passed over, from the longest trial down), so a gain is never measured over a fraction of a doubling. After
    ``H = log2(final_steps / steps[-1])`` more doublings the prediction is
    ``recall[-1] + d * q (1 - q^H) / (1 - q)``: a power-law learning curve, the shape learning-curve extrapolation
    for hyper-parameter search assumes (Domhan et al., IJCAI 2015).

    Args:
        steps: the trials' schedule lengths, increasing.
        recall: their validation scores.
        final_steps: the final fit's schedule length.
        default_ratio: ``q`` when fewer than three trials measure it. Default :data:`DEFAULT_GAIN_RATIO`.

    Returns:
        The prediction; ``recall[-1]`` itself for a single trial, when no shorter trial is far enough from the
        longest, when the last doubling gained nothing or more than the one before, or when ``final_steps`` is not
        longer.

    Raises:
        ValueError: ``steps`` and ``recall`` differ in length or are empty, or ``steps`` does not increase.
    """
    if len(steps) != len(recall) or not steps:
        raise ValueError(
            f"extrapolate_recall: need as many steps as scores (>= 1), got {len(steps)} and {len(recall)}."
        )
    if any(b <= a for a, b in itertools.pairwise(steps)):
        raise ValueError(f"extrapolate_recall: trial lengths must increase, got {list(steps)}.")
    last = float(recall[-1])
    kept = [len(steps) - 1]  # from the longest trial down, each kept one MIN_SPAN_RATIO times shorter than the last
    for i in range(len(steps) - 2, -1, -1):
        if steps[i] * MIN_SPAN_RATIO <= steps[kept[-1]]:
            kept.append(i)
    steps, recall = [steps[i] for i in reversed(kept)], [recall[i] for i in reversed(kept)]
    if len(steps) < 2 or final_steps <= steps[-1]:
        return last

    def gain(i: int) -> float:  # gain per doubling between trials i-1 and i
        return (recall[i] - recall[i - 1]) / math.log2(steps[i] / steps[i - 1])

    d = gain(len(steps) - 1)
    if d <= 0:  # no gain from the last doubling: nothing to extrapolate (a loss is not projected either)
        return last
    q = default_ratio
    if len(steps) >= 3 and (previous := gain(len(steps) - 2)) > 0:
        if d >= previous:  # gains that grow: the curve is taking off, not the power law's tail; no projection
            return last
        q = min(d / previous, MAX_GAIN_RATIO)
    horizon = math.log2(final_steps / steps[-1])
    return last + d * q * (1.0 - q**horizon) / (1.0 - q)


def _predict_final(config: dict[str, Any], trials: Sequence[Trial], final_steps: float) -> float:
    """:func:`extrapolate_recall` over ``config``'s trials so far (a shorter trial after a longer one is passed over)."""
    steps: list[float] = []
    recall: list[float] = []
    for trial in sorted((t for t in trials if t.config == config), key=lambda t: t.round):
        while steps and trial.steps <= steps[-1]:
            steps.pop()
            recall.pop()
        steps.append(trial.steps)
        recall.append(trial.val_recall)
    return extrapolate_recall(steps, recall, final_steps)


# ---------------------------------------------------------------------------------------------------- rounds
def _round_sizes(num_configs: int, rounds: int, keep_anchor: bool) -> list[int]:
    """Trials per round of successive halving: the better half goes on, plus the anchor when it is kept."""
    sizes = [num_configs]
    for _ in range(rounds - 1):
        sizes.append(min(sizes[-1], max(1, sizes[-1] // 2) + int(keep_anchor)))
    return sizes


def _share_of_rest(trials_left_in_round: int, sizes_after: Sequence[int], round_index: int) -> float:
    """A trial's share of the search time (or steps) left: trials of round ``r`` weigh ``2^r``, so every round's
    trials are twice as long as the previous round's whatever the anchor hedge adds (its trial is planned for)."""
    weight = 2**round_index
    rest = trials_left_in_round * weight + sum(n * 2 ** (round_index + 1 + j) for j, n in enumerate(sizes_after))
    return weight / rest


def _num_rounds(num_configs: int) -> int:
    return max(1, math.ceil(math.log2(num_configs)))


@dataclass(frozen=True)
class ValidationScorer:
    """Scores models on the validation split by full ranking, the training items masked (:func:`evaluate_ranking`).

    Args:
        train: training CSR ``(indptr, indices)`` (its items are never ranked).
        val: validation CSR (the items to find).
        num_items: number of items.
        k: cut-off of Recall/NDCG@K.
        users: the search's seeded sample of validation users.
    """

    train: tuple[np.ndarray, np.ndarray]
    val: tuple[np.ndarray, np.ndarray]
    num_items: int
    k: int
    users: np.ndarray

    def score(self, model: SimpleXModule, users: np.ndarray | None) -> tuple[float, float]:
        """``(recall, ndcg)`` of ``model`` over ``users`` (``None``: every validation user)."""
        return evaluate_ranking(model.score, self.train, self.val, self.num_items, self.k, users)


@dataclass
class SuccessiveHalving:
    """Successive halving of configurations on validation inside the search's share of a :class:`BudgetPlan`.

    Args:
        plan: the budget; its estimates are updated by every fit.
        runner: trains the trials.
        scorer: scores them on validation.
        selection: ``"extrapolate"`` ranks by :func:`extrapolate_recall`, ``"last"`` by the last trial's score.
        keep_anchor: the anchor (first configuration) goes on to the last round whatever its rank.
        min_trial_seconds: shortest first-round trial worth scoring (seconds budgets).
        min_trial_epochs: shortest first-round trial in epochs of the anchor (seconds budgets).
        notes: what the search decided and why, appended to.
        trials: every trial, in the order run.
    """

    plan: BudgetPlan
    runner: SimpleXRunner
    scorer: ValidationScorer
    selection: str = "extrapolate"
    keep_anchor: bool = True
    min_trial_seconds: float = 0.5
    min_trial_epochs: float = 3.0
    notes: list[str] = field(default_factory=list)
    trials: list[Trial] = field(default_factory=list)
    _steps_left: int = field(default=0, init=False, repr=False)

    def run(self, configs: list[dict[str, Any]], fallback: dict[str, Any]) -> dict[str, Any]:
        """Search ``configs`` (the anchor first) and return the chosen one.

        ``fallback`` is trained instead when a seconds budget's search is too short to compare two trials; without a
        search (``search_fraction=0``, or an epoch budget with one configuration) the anchor is.
        """
        survivors = self._affordable(configs) if self.plan.search_fraction > 0 else []
        if self.plan.timed:
            for config in survivors:  # only the shapes that will run are probed
                if not self.plan.knows(config):
                    self.plan.step_seconds[shape_key(config)] = self.runner.probe(config)
        if self.plan.search_fraction > 0 and len(survivors) < 2:
            self.notes.append(
                "search skipped: the search budget is too short for two trials; the anchor's settings are used at "
                "the grid's cheapest shape (a budget that cannot compare two trials has few epochs to give)"
            )
            _log.warning("fit_simplex_within_budget: %s.", self.notes[-1])
            survivors = []
        self._steps_left = self.plan.search_steps
        rounds = _num_rounds(len(survivors)) if survivors else 0
        for r in range(rounds):
            results = self._run_round(r, rounds, survivors)
            self.trials += results
            if not results:
                break
            survivors = self._next_survivors(results, r, rounds, configs[0])
            if len(results) == 1:
                break
        if survivors:
            return survivors[0]
        return fallback if self.plan.timed and self.plan.search_fraction > 0 else configs[0]

    def _affordable(self, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The configurations (from the front) whose first-round trials the search budget can give
        ``min_trial_epochs`` of the anchor; measures the anchor's step, the Trainer's set-up and a scoring first."""
        plan, anchor = self.plan, configs[0]
        if not (plan.timed and plan.search_seconds > plan.elapsed()):
            return list(configs)
        # what a trial costs besides its steps (the Trainer's set-up, the validation scoring), measured once
        model, clock, fit_seconds = self.runner.fit(anchor, 6)
        plan.record_fit(anchor, clock, fit_seconds)
        # timed on a slice of the sample (scoring time grows with the users scored): scoring all of it only to decide
        # whether to search would cost a short budget a sizeable share of its training
        users = self.scorer.users
        timed_users = users[:EVAL_TIMING_USERS]
        scored = time.perf_counter()
        self.scorer.score(model, timed_users)
        plan.eval_seconds = (time.perf_counter() - scored) * len(users) / len(timed_users)
        left = plan.search_left()
        # a first-round trial shorter than min_trial_epochs (of the anchor's shape) says little about a
        # configuration: try only as many configurations as can have that
        epoch_seconds = self.runner.steps_per_epoch * plan.step_time(anchor)
        trial_cost = max(
            self.min_trial_seconds, plan.overhead + plan.eval_seconds + self.min_trial_epochs * epoch_seconds
        )
        affordable = len(configs)
        while affordable >= 2 and trial_cost > left * _share_of_rest(
            affordable, _round_sizes(affordable, _num_rounds(affordable), self.keep_anchor)[1:], 0
        ):
            affordable -= 1
        if affordable == len(configs):
            return list(configs)
        kept = configs[: max(0, affordable)]
        self.notes.append(
            f"search budget {plan.search_seconds:.1f}s allows {len(kept)} of {len(configs)} configurations "
            f"(a first-round trial costs ~{trial_cost:.1f}s: {self.min_trial_epochs:g} epoch(s) of the anchor, "
            "the Trainer's set-up and the validation scoring)"
        )
        return kept

    def _run_round(self, r: int, rounds: int, survivors: list[dict[str, Any]]) -> list[Trial]:
        """Round ``r``: a trial of every survivor, each sized from what is left (it stops when nothing is)."""
        results: list[Trial] = []
        later = _round_sizes(len(survivors), rounds - r, self.keep_anchor)[1:]  # the rounds after this one, planned
        for i, config in enumerate(survivors):
            share, steps = self._trial_size(config, _share_of_rest(len(survivors) - i, later, r))
            if steps < 1:
                self.notes.append(f"round {r}: no time left for {shape_key(config)}; the round stops early")
                break
            results.append(self._trial(config, r, steps, share))
        return results

    def _trial_size(self, config: dict[str, Any], fraction: float) -> tuple[float, int]:
        """``(seconds allowed, steps)`` of a trial taking ``fraction`` of the search time (or steps) left."""
        if self.plan.timed:
            left = self.plan.search_left()
            share = left * fraction if left > 0 else 0.0
            return share, self.plan.trial_steps(config, share)
        steps = int(self._steps_left * fraction)
        self._steps_left -= steps
        return float("nan"), steps

    def _trial(self, config: dict[str, Any], r: int, steps: int, share: float) -> Trial:
        """Train and score one trial. A timed trial's schedule runs on the clock for its share less the Trainer's
        set-up and the scoring (its steps are counted afterwards): a trial sized from a step-time estimate overran
        its share by up to 2.4x under load and starved the trials after it in the round, which then lost to
        configurations trained several times longer."""
        trial = Trial(dict(config), r, steps, share)
        if self.plan.timed:
            seconds = share - self.plan.overhead - self.plan.eval_seconds
            model, clock, fit_seconds = self.runner.fit(config, -1, seconds=max(seconds, 1e-3))
            trial.steps = steps = len(clock.ends)
        else:
            model, clock, fit_seconds = self.runner.fit(config, steps)
        self.plan.record_fit(config, clock, fit_seconds, steps)
        trial.train_seconds, trial.fit_seconds = clock.train_seconds, fit_seconds
        scored = time.perf_counter()
        trial.val_recall, trial.val_ndcg = self.scorer.score(model, self.scorer.users)
        self.plan.eval_seconds = time.perf_counter() - scored
        return trial

    def _next_survivors(
        self, results: list[Trial], r: int, rounds: int, anchor: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """The better half of round ``r`` (ranked by ``selection``), plus the anchor when it is kept."""
        for trial in results:
            trial.predicted_recall = _predict_final(trial.config, self.trials, self.plan.final_steps(trial.config))
        extrapolate = self.selection == "extrapolate"
        ranked = sorted(results, key=lambda t: -(t.predicted_recall if extrapolate else t.val_recall))
        survivors = [t.config for t in ranked[: max(1, len(ranked) // 2)]]
        if self.keep_anchor and r < rounds - 1 and anchor not in survivors and any(t.config == anchor for t in results):
            survivors.append(anchor)  # the hedge: the anchor goes on to the last round whatever its rank
            self.notes.append(f"round {r}: the anchor configuration was kept for the next round (keep_anchor)")
        return survivors
