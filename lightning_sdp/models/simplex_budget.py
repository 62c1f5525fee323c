"""A time-budgeted SimpleX / MF-CCL recipe: size the schedule to the budget and pick hyper-parameters on validation.

HEAT's fused kernel (Zhang et al., ICS 2023) trains with per-sample SGD whose rate must decay to reach a good optimum,
and with the tile sampler the model is poor until the last ~15 % of the decay. So a run has to know its length up
front. :func:`fit_simplex_within_budget` turns a wall-clock (or epoch) budget into a step count:

1. **probe**: a few fused steps per candidate shape (``dim`` x ``num_negatives``) measure the time per step;
2. **search** (``search_fraction`` of the budget, default 30 %, probes and validation included): successive halving
   over a seeded sample of a small grid (``dim``, ``num_negatives``, ``margin``, ``negative_weight``, ``lr``), led by
   the anchor configuration and the anchor at the grid's cheapest shape (smallest ``dim`` and ``num_negatives``),
   so that a short search still compares a configuration for long budgets with one that can do many epochs. Every
   trial is a complete short run whose linear schedule decays to 0 inside its own share of the time, scored on the
   validation split only; the better half goes on with twice the time. The halves are ranked by the validation
   score each configuration's trials *extrapolate* to at the final fit's length (:func:`extrapolate_recall`): the
   final fit is several doublings longer than the last trial, and a larger dimension that is behind after a short
   schedule but gains more per doubling is the better choice for it;
3. **fit**: the winner trains for the rest of the budget with a rate that decays linearly to 0 *on the clock*
   (:class:`_WallClockLinearDecay`: a step's rate is set from the training time elapsed, and the fit stops when
   it reaches 0), so the schedule ends with the budget however the step time drifts (an epoch budget counts steps
   instead). With ``cycles > 1`` the fit is a series of warm
   restarts (Loshchilov & Hutter, SGDR) of doubling length, each decaying to 0 and scored on validation, and the best
   snapshot is kept: so the training length is chosen on validation too (a longer schedule is not always better).
   Without restarts the final fit trains on the training *and* validation interactions (``refit``): validation has
   done its job once the configuration is chosen, and on Gowalla the 10 % it holds are worth +0.01 test Recall@20.

The recipe never receives the test split: it carves validation out of the training interactions (or uses the
datamodule's ``val_csr``), so the test split can be scored once, afterwards.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lightning_sdp.datamodules.interactions import PositivePairs, merge_csr, split_validation
from lightning_sdp.datamodules.sampling import EpochSeededBatchSampler
from lightning_sdp.metrics import NDCGAtK, RecallAtK, csr_rows_coo, csr_rows_mask, topk_hits
from lightning_sdp.models.simplex import SimpleXModule
from lightning_sdp.plugins.heat import HEATAccelerator, set_cpu_threads

_log = logging.getLogger(__name__)

#: The grid the search samples from (keys are :class:`SimpleXModule` arguments); the first value of each list is the
#: anchor configuration, always tried first (the Gowalla recipe of ``docs/heat.md`` at a smaller dimension).
DEFAULT_GRID: dict[str, list[Any]] = {
    "dim": [128, 64, 256],
    "num_negatives": [200, 64],
    "margin": [0.9, 0.8],
    "negative_weight": [150.0, 50.0],
    "lr": [0.1, 0.3],
}
#: The default grid plus light negative terms and low margins. On a dense catalogue (60 of 1,500 items per user)
#: the recipe with it reached test Recall@20 0.48 where the default grid gives 0.26; on Gowalla its short search
#: trials favour the light weights, which learn fast early and end low (0.045 at a 60 s budget against 0.163),
#: so it is not the default (docs/heat.md, benchmarks/results/heat_vs_peers_wide_grid.md).
WIDE_GRID: dict[str, list[Any]] = {
    **DEFAULT_GRID,
    "margin": [0.9, 0.8, 0.5, 0.0],
    "negative_weight": [150.0, 50.0, 10.0, 1.0],
}
#: Settings shared by every configuration (unit-norm rows make a row's step ``lr`` whatever its norm).
BASE_SETTINGS: dict[str, Any] = {"g": 1.0, "optimizer": "sgd", "row_norm": 1.0, "init_std": 0.1, "max_history": 100}
#: Validation users scored to time a scoring of the whole user sample (the time grows with the users scored).
EVAL_TIMING_USERS = 1024
_EVAL_WARMUP_USERS = 256


def _csr_of(source: Any, name: str) -> tuple[np.ndarray, np.ndarray] | None:
    """``source.<name>`` (a CSR tuple such as ``InteractionsDataModule.train_csr``) as int64 arrays, or ``None``."""
    value = getattr(source, name, None)
    return None if value is None else (np.asarray(value[0], np.int64), np.asarray(value[1], np.int64))


# ---------------------------------------------------------------------------------------------------- evaluation
def evaluate_ranking(
    score: Callable[[torch.Tensor], torch.Tensor],
    known: tuple[np.ndarray, np.ndarray],
    target: tuple[np.ndarray, np.ndarray],
    num_items: int,
    k: int = 20,
    users: np.ndarray | None = None,
    batch_size: int | None = None,
) -> tuple[float, float]:
    """Recall@K and NDCG@K of any scorer by full ranking, the known (training) items masked.

    The same protocol as :class:`SimpleXModule`'s evaluation (``RecallAtK`` / ``NDCGAtK``), for any model that can
    score users against every item (the benchmarks score the peers with it).

    Args:
        score: maps a ``(B,)`` LongTensor of users to ``(B, num_items)`` scores.
        known: CSR ``(indptr, indices)`` of the items never ranked (the items the model trained on).
        target: CSR of the held-out items to find (validation or test).
        num_items: number of items.
        k: cut-off. Default 20.
        users: users to score (a subset, e.g. for cheap validation); ``None`` takes every user with a target item.
        batch_size: users per scoring batch; ``None`` keeps a batch's scores near 16 MB (``2**22 // num_items``
            users, 32 to 1024): larger score matrices are fresh memory the allocator maps and faults in at every
            batch, which made 1024-user batches 1.3x slower on Gowalla (41k items) than the default 102-user ones.

    Returns:
        ``(recall, ndcg)`` averaged over the scored users that have target items.
    """
    target_counts = np.diff(target[0])
    if users is None:
        users = np.flatnonzero(target_counts > 0)
    users = np.asarray(users, dtype=np.int64)
    users = users[target_counts[users] > 0]
    if len(users) == 0:
        raise ValueError("evaluate_ranking: no user has a target item; the validation/test split is empty.")
    if batch_size is None:
        batch_size = int(np.clip(2**22 // max(1, num_items), 32, 1024))
    recall, ndcg = RecallAtK(k), NDCGAtK(k)
    for start in range(0, len(users), batch_size):
        rows = users[start : start + batch_size]
        preds = score(torch.from_numpy(rows)).float()
        if preds.shape != (len(rows), num_items):
            raise ValueError(
                f"evaluate_ranking: score() returned {tuple(preds.shape)}, expected {(len(rows), num_items)}."
            )
        known_mask = csr_rows_mask(*known, rows, num_items)
        target_rows, target_items = csr_rows_coo(*target, rows)
        target_mask = torch.zeros_like(known_mask)
        target_mask[target_rows, target_items] = True
        # counted on the sparse rows (each item once): the relevant items are the target items that are not known
        fresh = ~known_mask[target_rows, target_items]
        pairs = torch.unique(target_rows[fresh] * num_items + target_items[fresh])
        relevant = torch.bincount(pairs // num_items, minlength=len(rows))
        hits, relevant = topk_hits(preds, target_mask, k, known_mask, num_relevant=relevant)
        recall.update(topk_hits=hits, num_relevant=relevant)
        ndcg.update(topk_hits=hits, num_relevant=relevant)
    return float(recall.compute()), float(ndcg.compute())


# ---------------------------------------------------------------------------------------------------- training
class _FitClock(Callback):
    """Wall time of the training batches (first batch start to last batch end) and the learning rate at the end."""

    def __init__(self) -> None:
        self.first_start: float | None = None
        self.last_end = 0.0
        self.ends: list[float] = []
        self.final_lr = float("nan")

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.first_start is None:
            self.first_start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.last_end = time.perf_counter()
        self.ends.append(self.last_end)
        self.final_lr = float(trainer.optimizers[0].param_groups[0]["lr"])

    @property
    def train_seconds(self) -> float:
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

    def _set(self, trainer: Trainer, fraction: float) -> None:
        for optimizer, base in zip(trainer.optimizers, self.base, strict=True):
            for group, lr in zip(optimizer.param_groups, base, strict=True):
                group["lr"] = lr * fraction

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.base = [[float(g["lr"]) for g in opt.param_groups] for opt in trainer.optimizers]
        self.start, self.steps = None, 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.start is None:
            self.start = self.clock()
        self._set(trainer, self._fraction_left())

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps += 1
        left = self._fraction_left()
        if left <= 0.0:
            trainer.should_stop = True
        self._set(trainer, left)  # the rate the next step would use: 0 once the time is up


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

    def summary(self) -> dict[str, Any]:
        """JSON-friendly summary (no model)."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("model", "trials")}
        out["trials"] = [t.__dict__ for t in self.trials]
        return out


#: Ratio of successive gains per doubling of the schedule assumed when a configuration has only two trials (each
#: doubling of the training length buys half the previous one's gain: a power law ``a - b t^-1``).
DEFAULT_GAIN_RATIO = 0.5
#: Upper bound of a measured gain ratio: gains that do not shrink would extrapolate without limit.
MAX_GAIN_RATIO = 0.8
#: Shortest ratio of two trials' lengths that measures a gain per doubling: between closer trials (a squeezed search
#: gives rounds of 120 and 150 steps) the difference of two noisy scores is divided by a small log2 and explodes.
MIN_SPAN_RATIO = 1.5


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
    projected (on a dense catalogue, trials at 0.009 / 0.115 / 0.358 were projected to 0.79, where the best trial
    of the search had 0.48 and the configuration levels off at 0.36). Only trials at least
    :data:`MIN_SPAN_RATIO` times shorter than the next one used count (the others are passed over, from the
    longest trial down), so a gain is never measured over a fraction of a doubling. After
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


def _shape_key(config: dict[str, Any]) -> str:
    return f"d{config['dim']}_n{config['num_negatives']}"


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


def _cheapest_shape(anchor: dict[str, Any], grid: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    """``anchor`` with the grid's smallest ``dim`` and ``num_negatives``: the most epochs a short budget can buy."""
    return {**anchor, **{k: min(grid[k]) for k in ("dim", "num_negatives") if k in grid}}


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


def sample_configs(
    grid: Mapping[str, Sequence[Any]], num_configs: int, seed: int = 0, lead: Sequence[dict[str, Any]] = ()
) -> list[dict[str, Any]]:
    """The anchor (first value of every list), then ``lead``, then a seeded sample of the rest of the grid's product.

    The sample is ordered to cover the grid first: each next configuration is the one (of a seeded permutation) that
    brings the most values not yet tried, until every value of every list is in; the permutation's order after
    that. A short search tries only the first few configurations, and a random few can all share a value that
    suits the data badly (on a dense catalogue, the anchor's negative weight plateaus early: ``docs/heat.md``); a
    space-filling start compares both ends of every hyper-parameter as soon as there are enough configurations to.

    Args:
        grid: :class:`SimpleXModule` argument -> candidate values.
        num_configs: how many configurations to return (at most the product's size).
        seed: seed of the sample.
        lead: configurations of the grid to place right after the anchor (counted as covering their values).
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


def recipe_configs(grid: Mapping[str, Sequence[Any]], num_configs: int, seed: int = 0) -> list[dict[str, Any]]:
    """The configurations :func:`fit_simplex_within_budget` searches, in its order: the anchor, the anchor at the
    grid's cheapest shape (the two ends of the cost range), then :func:`sample_configs`' covering sample."""
    cheap = _cheapest_shape(sample_configs(grid, 1)[0], grid)
    return sample_configs(grid, num_configs, seed, lead=[cheap])


def default_batch_size(num_positives: int) -> int:
    """Positives per step when none is given: ``clip(num_positives // 64, 1024, 16384)``."""
    return int(np.clip(num_positives // 64, 1024, 16384))


class SimpleXRunner:
    """Builds and trains fused SimpleX models on one training CSR with a fixed batch size and thread count.

    Args:
        train: training CSR ``(indptr, indices)``.
        num_items: number of items.
        batch_size: positives per step.
        threads: threads for torch and the kernel; ``None``: every core.
        seed: seed of the models and the shuffles.
        model_kwargs: fixed :class:`SimpleXModule` arguments under every configuration.
    """

    def __init__(
        self,
        train: tuple[np.ndarray, np.ndarray],
        num_items: int,
        batch_size: int,
        threads: int | None,
        seed: int,
        model_kwargs: dict[str, Any],
    ) -> None:
        self.train, self.num_items, self.batch_size = train, num_items, batch_size
        self.threads, self.seed, self.model_kwargs = threads, seed, model_kwargs
        self.num_users = len(train[0]) - 1
        self.pairs = PositivePairs.from_csr(*train)
        self.steps_per_epoch = math.ceil(len(self.pairs) / batch_size)

    def model(self, config: dict[str, Any], lr_schedule: Literal["constant", "linear"] = "linear") -> SimpleXModule:
        settings = {**BASE_SETTINGS, **self.model_kwargs, **config}
        if settings.get("sampler") is None:  # HEAT's tile sampler pays off only when the tile is a small share
            settings["sampler"] = "tile" if self.num_items >= 8 * 512 else "uniform"
        model = SimpleXModule(
            self.num_users, self.num_items, backend="fused", lr_schedule=lr_schedule, seed=self.seed, **settings
        )
        model.set_interactions(*self.train)
        return model

    def fit(
        self,
        config: dict[str, Any],
        steps: int,
        max_seconds: float | None = None,
        init: SimpleXModule | None = None,
        cycle: int = 0,
        seconds: float | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> tuple[SimpleXModule, _FitClock, float]:
        """Train ``config`` for ``steps`` steps (the linear decay reaches 0 at the last one), or for ``seconds``.

        ``max_seconds`` is a guard (Lightning's ``max_time``) against a step-time estimate gone wrong; a fit it cuts
        ends before its schedule does, which the returned clock's ``final_lr`` shows. ``init`` warm-starts the new
        model from another one's weights and sampler state (a warm restart, ``init`` is left unchanged); ``cycle``
        numbers the restart so that it sees a new data order. With ``seconds`` the rate decays linearly with the
        training time instead of the step count (:class:`_WallClockLinearDecay`) and the fit stops when it reaches
        0; ``steps`` is then only a cap. ``callbacks`` are added to the fit's own.
        """
        model = self.model(config, lr_schedule="linear" if seconds is None else "constant")
        if init is not None:
            model.load_state_dict(init.state_dict())
        clock = _FitClock()
        # the decay sets the rate before the clock reads it, so the clock's final_lr is the rate after the last step
        own: list[Callback] = [clock] if seconds is None else [_WallClockLinearDecay(seconds), clock]
        order = EpochSeededBatchSampler(len(self.pairs), self.batch_size, self.seed + 1_000_003 * cycle)
        loader = DataLoader(self.pairs, batch_size=None, sampler=order)
        trainer = Trainer(
            accelerator=HEATAccelerator(num_threads=self.threads),
            devices=1,
            max_steps=steps,
            max_epochs=-1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[*own, *callbacks],
            max_time=None if max_seconds is None else timedelta(seconds=max(1.0, max_seconds)),
        )
        start = time.perf_counter()
        trainer.fit(model, train_dataloaders=loader)
        return model, clock, time.perf_counter() - start

    def fit_for_seconds(self, config: dict[str, Any], seconds: float) -> tuple[SimpleXModule, int, float, float]:
        """Train ``config`` with a linear schedule sized (from a probe) to end within ``seconds`` of training.

        Returns:
            ``(model, steps, train_seconds, final_lr)``.
        """
        steps = int(seconds * 0.95 / self.probe(config))
        if steps < 1:
            raise ValueError(f"SimpleXRunner: {seconds}s is shorter than one training step; raise the budget.")
        model, clock, _ = self.fit(config, steps)
        return model, steps, clock.train_seconds, clock.final_lr

    def probe(self, config: dict[str, Any], steps: int = 6) -> float:
        """Seconds per training step of ``config`` through the Trainer (kernel and Lightning's per-step cost).

        Measured between the ends of the first and the last of ``steps`` batches (the first one warms up).
        """
        _, clock, _ = self.fit(config, max(2, steps))
        return clock.seconds_per_step


def _set_threads(n: int | None) -> int:
    """Use ``n`` threads (numba and torch) unless ``None``; returns torch's previous count."""
    saved = torch.get_num_threads()
    if n is not None:
        set_cpu_threads(n)
    return saved


def _check_budget(budget_seconds: float | None, budget_epochs: float | None, search_fraction: float) -> None:
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


def _split_data(
    data: Any, val: tuple | None, val_fraction: float, seed: int, notes: list[str]
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], int]:
    """``(train, val, num_items)`` from a datamodule or a train CSR; the test split is never read."""
    train: tuple[np.ndarray, np.ndarray] | None
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
        grid: :class:`SimpleXModule` argument -> candidates; default :data:`DEFAULT_GRID`.
        num_configs: configurations tried: the anchor, the anchor at the grid's smallest ``dim`` and
            ``num_negatives``, then a seeded sample of the rest of the grid that covers every value first
            (:func:`sample_configs`); fewer (from the front) when the search
            budget cannot give each at least ``min_trial_seconds`` / ``min_trial_epochs``. Default 8.
        min_trial_seconds: shortest first-round trial worth scoring (seconds budgets). Default 0.5.
        min_trial_epochs: shortest first-round trial, in epochs of the anchor configuration (seconds budgets):
            fewer configurations are tried when the search budget cannot give each this much after the Trainer's
            set-up and the validation scoring (both measured on a short fit of the anchor). When not even two fit,
            the search is skipped and the anchor's settings train at the grid's smallest ``dim`` and
            ``num_negatives``. Default 3: on Gowalla the anchor and the cheap anchor (lr 0.1) scored 0.015 and
            0.011 on validation after trials of 1.3 and 1.5 epochs (a trained model: 0.16-0.19), noise that chose
            the slower one at a 30-s budget; after 3.4 and 8.5 epochs they scored 0.083 and 0.146, the order of
            their longer trials (``benchmarks/results/heat_vs_peers_refit_clock_trial1ep.json``).
        val: validation CSR to use with a training CSR ``data`` (e.g. a benchmark's shared split); ``None`` carves one.
        num_items: number of items with a training CSR ``data`` (``None``: the largest id seen + 1).
        val_fraction: share of each user's items carved out for validation when there is no validation split.
            Default 0.1.
        max_eval_users: validation users scored per trial (a seeded subset; the final model is scored on all).
            Default 5000.
        batch_size: positives per step; ``None`` picks ``clip(num_positives // 64, 1024, 16384)``.
        threads: threads for torch and the kernel (``HEATAccelerator(num_threads=...)``); ``None``: every core.
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
            each configuration's trials extrapolate to at the final fit's length (:func:`extrapolate_recall`), so a
            configuration that learns slower but further is not cut for being behind after a short trial;
            ``"last"`` by the last trial's validation Recall.
        keep_anchor: the anchor configuration (the grid's first values, the documented recipe) is never cut before
            the last round, where it competes with the others on equal terms. Successive halving's first rounds
            are short and cut configurations that start slowly but end ahead (a larger dimension), the weakness
            Hyperband (Li et al., JMLR 2018) hedges with a bracket of few configurations trained long; keeping
            the prior's best guess is that hedge at the cost of at most one trial per round. Default ``True``.

    Returns:
        A :class:`BudgetedFit` with the trained model, its settings, ``max_steps`` and every trial.

    Raises:
        ValueError: a missing, non-positive or doubled budget, a ``search_fraction`` outside ``[0, 1)``, or a budget
            too short for even one training step after the probe, ``cycles < 1``, ``refit=True`` with
            ``cycles > 1``, or an unknown ``selection``.
    """
    _check_budget(budget_seconds, budget_epochs, search_fraction)
    if selection not in ("extrapolate", "last"):
        raise ValueError(f"fit_simplex_within_budget: selection must be 'extrapolate' or 'last', got {selection!r}.")
    if cycles < 1:
        raise ValueError(f"fit_simplex_within_budget: cycles must be at least 1, got {cycles}.")
    if refit is None:
        refit = cycles == 1
    elif refit and cycles > 1:
        raise ValueError(
            f"fit_simplex_within_budget: cycles={cycles} chooses its snapshot on validation, so the final fit cannot "
            "train on validation; pass refit=False (or cycles=1)."
        )
    notes: list[str] = []
    train, val, found_items = _split_data(data, val, val_fraction, seed, notes)
    num_items = num_items if num_items is not None else found_items
    num_positives = len(train[1])
    if batch_size is None:
        batch_size = default_batch_size(num_positives)
    runner = SimpleXRunner(train, num_items, batch_size, threads, seed, dict(model_kwargs or {}))
    eval_users = np.flatnonzero(np.diff(val[0]) > 0)
    if len(eval_users) > max_eval_users:
        eval_users = np.sort(np.random.default_rng(seed).choice(eval_users, max_eval_users, replace=False))
    warm, _, _ = runner.fit(sample_configs(grid or DEFAULT_GRID, 1)[0], 1)  # compiles the kernel (once, cached)
    # the scoring path's first call in a process costs ~1.7x a later one (allocator and thread-pool warm-up): paid
    # here, like the compilation, so that the scoring time measured below is what each trial will pay
    evaluate_ranking(warm.score, train, val, num_items, k, eval_users[:_EVAL_WARMUP_USERS])
    call_start = time.perf_counter()  # the budget starts after loading and the one-time warm-ups
    search_grid: Mapping[str, Sequence[Any]] = grid or DEFAULT_GRID
    configs = recipe_configs(search_grid, num_configs, seed)
    cheap = _cheapest_shape(configs[0], search_grid)  # the fallback when the search is skipped

    def score_on_val(model: SimpleXModule, users: np.ndarray | None) -> tuple[float, float]:
        return evaluate_ranking(model.score, train, val, num_items, k, users)

    step_seconds: dict[str, float] = {}
    overhead = 0.5  # Trainer set-up and tear-down per fit; replaced by the measured value after the first fit
    eval_seconds = 1.0  # one validation scoring of the user sample; replaced by the measured value

    def steps_for(config: dict[str, Any], seconds: float) -> int:  # a trial's steps: its share less set-up and scoring
        return int((seconds - overhead - eval_seconds) / step_seconds[_shape_key(config)])

    def final_steps_for(config: dict[str, Any]) -> float:  # the final fit's planned length, for extrapolation
        if budget_seconds is None:
            return float(total_steps - search_steps)
        return budget_seconds * (1.0 - search_fraction) / step_seconds[_shape_key(config)]

    trials: list[Trial] = []
    if budget_seconds is not None:
        search_budget = budget_seconds * search_fraction
    else:
        assert budget_epochs is not None  # _check_budget: exactly one of the two budgets is given
        total_steps = max(1, round(budget_epochs * runner.steps_per_epoch))
        search_steps = int(total_steps * search_fraction)

    # ------------------------------------------------------------------ successive halving on validation
    survivors = configs if search_fraction > 0 else []
    if survivors:
        rounds = max(1, math.ceil(math.log2(len(survivors))))
        if budget_seconds is not None and search_budget > (time.perf_counter() - call_start):
            # what a trial costs besides its steps (the Trainer's set-up, the validation scoring), measured once
            model, clock, fit_wall = runner.fit(configs[0], 6)
            step_seconds[_shape_key(configs[0])] = clock.seconds_per_step
            overhead = max(0.0, fit_wall - clock.train_seconds)
            # timed on a slice of the sample (scoring time grows with the users scored): scoring all of it (2-3 s
            # on Gowalla) only to decide whether to search would cost a 30-s budget a tenth of its training
            timed_users = eval_users[:EVAL_TIMING_USERS]
            scored = time.perf_counter()
            score_on_val(model, timed_users)
            eval_seconds = (time.perf_counter() - scored) * len(eval_users) / len(timed_users)
            left = search_budget - (time.perf_counter() - call_start)
            # a first-round trial shorter than min_trial_epochs (of the anchor's shape) says little about a
            # configuration: try only as many configurations as can have that
            epoch_seconds = runner.steps_per_epoch * step_seconds[_shape_key(configs[0])]
            trial_cost = max(min_trial_seconds, overhead + eval_seconds + min_trial_epochs * epoch_seconds)
            affordable = len(survivors)
            while affordable >= 2 and trial_cost > left * _share_of_rest(
                affordable, _round_sizes(affordable, math.ceil(math.log2(affordable)), keep_anchor)[1:], 0
            ):
                affordable -= 1
            if affordable < len(survivors):
                survivors = survivors[: max(0, affordable)]
                rounds = max(1, math.ceil(math.log2(max(2, len(survivors)))))
                notes.append(
                    f"search budget {search_budget:.1f}s allows {len(survivors)} of {len(configs)} configurations "
                    f"(a first-round trial costs ~{trial_cost:.1f}s: {min_trial_epochs:g} epoch(s) of the anchor, "
                    "the Trainer's set-up and the validation scoring)"
                )
        if budget_seconds is not None:
            for config in survivors:  # only the shapes that will run are probed
                if _shape_key(config) not in step_seconds:
                    step_seconds[_shape_key(config)] = runner.probe(config)
        if len(survivors) < 2:
            notes.append(
                "search skipped: the search budget is too short for two trials; the anchor's settings are used at "
                "the grid's cheapest shape (a budget that cannot compare two trials has few epochs to give)"
            )
            _log.warning("fit_simplex_within_budget: %s.", notes[-1])
            survivors = []
        steps_left = 0 if budget_seconds is not None else search_steps
        for r in range(rounds if survivors else 0):
            results: list[Trial] = []
            later = _round_sizes(len(survivors), rounds - r, keep_anchor)[1:]  # the rounds after this one, planned
            for i, config in enumerate(survivors):
                fraction = _share_of_rest(len(survivors) - i, later, r)
                if budget_seconds is not None:
                    left = search_budget - (time.perf_counter() - call_start)
                    share = left * fraction if left > 0 else 0.0
                    steps = steps_for(config, share)
                else:
                    share = float("nan")
                    steps = int(steps_left * fraction)
                    steps_left -= steps
                if steps < 1:
                    notes.append(f"round {r}: no time left for {_shape_key(config)}; the round stops early")
                    break
                trial = Trial(dict(config), r, steps, share)
                model, clock, fit_wall = runner.fit(config, steps)
                overhead = max(0.0, fit_wall - clock.train_seconds)
                step_seconds[_shape_key(config)] = clock.train_seconds / steps
                trial.train_seconds, trial.fit_seconds = clock.train_seconds, fit_wall
                scored = time.perf_counter()
                trial.val_recall, trial.val_ndcg = score_on_val(model, eval_users)
                eval_seconds = time.perf_counter() - scored
                results.append(trial)
            trials += results
            if not results:
                break
            for trial in results:
                trial.predicted_recall = _predict_final(trial.config, trials, final_steps_for(trial.config))
            results.sort(key=lambda t: -(t.predicted_recall if selection == "extrapolate" else t.val_recall))
            survivors = [t.config for t in results[: max(1, len(results) // 2)]]
            if (
                keep_anchor
                and r < rounds - 1
                and configs[0] not in survivors
                and any(t.config == configs[0] for t in results)
            ):
                survivors.append(configs[0])  # the hedge: the anchor goes on to the last round whatever its rank
                notes.append(f"round {r}: the anchor configuration was kept for the next round (keep_anchor)")
            if len(results) == 1:
                break
    if survivors:
        best = survivors[0]
    elif budget_seconds is not None and search_fraction > 0:
        best = cheap
    else:
        best = configs[0]
    search_seconds = time.perf_counter() - call_start

    # ------------------------------------------------------------------ final fit, sized to what is left
    # the same batch size, so the step times measured in the search still hold for the larger refit data
    final_runner = (
        SimpleXRunner(merge_csr(train, val), num_items, batch_size, threads, seed, dict(model_kwargs or {}))
        if refit
        else runner
    )
    weights = [2**i for i in range(cycles)]
    cycle_seconds: list[float | None] = [None] * cycles
    if budget_seconds is not None:
        left = budget_seconds - (time.perf_counter() - call_start)
        if _shape_key(best) not in step_seconds:
            step_seconds[_shape_key(best)] = runner.probe(best)
            left = budget_seconds - (time.perf_counter() - call_start)
        # the schedule runs on the clock (the step time drifts as training goes on), so the margin only covers the
        # Trainer's set-up, one step past the end and a scoring per restart cycle
        train_time = (left - cycles * overhead - (cycles - 1) * eval_seconds) * 0.98 - step_seconds[_shape_key(best)]
        if train_time <= step_seconds[_shape_key(best)] * cycles:
            raise ValueError(
                f"fit_simplex_within_budget: the budget of {budget_seconds:g}s leaves {left:.2f}s after the probe "
                f"and search, less than one step ({step_seconds[_shape_key(best)]:.3f}s) plus the Trainer's set-up "
                f"({overhead:.2f}s); raise budget_seconds, lower search_fraction or lower batch_size."
            )
        cycle_seconds = [train_time * w / sum(weights) for w in weights]
        cycle_steps = [-1] * cycles  # set by the clock, counted below
    else:
        max_steps = total_steps - search_steps
        cycle_steps = [max_steps * w // sum(weights) for w in weights]
        cycle_steps[-1] += max_steps - sum(cycle_steps)
        if min(cycle_steps) < 1:
            raise ValueError(
                f"fit_simplex_within_budget: {max_steps} steps cannot make {cycles} restart cycles; lower cycles or "
                "raise the budget."
            )
    snapshots: list[tuple[SimpleXModule, _FitClock]] = []
    cycle_val: list[float] = []
    fit_wall = 0.0
    for i, (steps, seconds) in enumerate(zip(cycle_steps, cycle_seconds, strict=True)):
        guard = None
        if budget_seconds is not None:
            guard = 2.0 * max(1.0, budget_seconds - (time.perf_counter() - call_start))
        model, clock, wall = final_runner.fit(
            best, steps, guard, init=snapshots[-1][0] if snapshots else None, cycle=i, seconds=seconds
        )
        cycle_steps[i] = len(clock.ends)
        fit_wall += wall
        if clock.final_lr > 0:
            notes.append(f"cycle {i} was cut at {guard:.0f}s before its schedule ended (the step time rose under load)")
            _log.warning("fit_simplex_within_budget: %s.", notes[-1])
        snapshots.append((model, clock))
        if cycles > 1:
            cycle_val.append(score_on_val(model, eval_users)[0])
    max_steps = sum(cycle_steps)
    chosen = int(np.argmax(cycle_val)) if cycles > 1 else 0
    model, clock = snapshots[chosen]
    if refit:  # the model has seen validation: report what the search measured for its configuration
        best_trials = [t for t in trials if t.config == best]
        val_recall, val_ndcg = (
            (best_trials[-1].val_recall, best_trials[-1].val_ndcg) if best_trials else (math.nan, math.nan)
        )
        notes.append(
            "the final model trained on train + validation (refit); val_recall is its configuration's last search trial"
        )
    else:
        val_recall, val_ndcg = score_on_val(model, None)
        notes.append("the final model trained on train minus validation (refit=False)")
    if cycles == 1:
        cycle_val = [val_recall]
    return BudgetedFit(
        model=model,
        config=dict(best),
        max_steps=max_steps,
        batch_size=batch_size,
        budget_seconds=budget_seconds,
        budget_epochs=budget_epochs,
        search_seconds=search_seconds,
        fit_seconds=fit_wall,
        train_seconds=sum(c.train_seconds for _, c in snapshots),
        final_lr=clock.final_lr,
        val_recall=val_recall,
        val_ndcg=val_ndcg,
        trials=trials,
        seconds_per_step=step_seconds,
        notes=notes,
        cycle_steps=cycle_steps,
        cycle_val_recall=cycle_val,
        chosen_cycle=chosen,
        refit=refit,
        train_positives=len(final_runner.pairs),
        selection=selection,
    )


__all__ = [
    "BASE_SETTINGS",
    "DEFAULT_GRID",
    "MIN_SPAN_RATIO",
    "WIDE_GRID",
    "BudgetedFit",
    "SimpleXRunner",
    "Trial",
    "evaluate_ranking",
    "extrapolate_recall",
    "default_batch_size",
    "fit_simplex_within_budget",
    "recipe_configs",
    "sample_configs",
]
