"""The SOLAR schedule: every epoch's shuffled order, computed ahead, and what each rank loads at each step.

Sun et al., "SOLAR: A Highly Optimized Data Loading Framework for Distributed Training of CNN-based Scientific
Surrogates" (arXiv 2211.00224). Because the shuffled order of every epoch follows from a seed, the loader knows the
whole future access sequence. :class:`SolarSchedule` uses it to

1. draw one permutation per epoch (``np.random.SeedSequence(seed).spawn``); the global batch of step ``t`` of
   epoch ``e`` is positions ``[t*G, (t+1)*G)`` of that permutation (``G = P*B``), exactly plain shuffling's set;
2. simulate one buffer per rank (Belady by default) from next-use positions, identically on every rank;
3. re-route a buffered sample to the rank holding it, inside its global batch;
4. split the step's storage reads evenly across ranks (variable local batch sizes, capped) and give each batch the
   loss scale ``P / G`` that keeps the DDP-averaged gradient equal to the global mean;
5. optionally order the epochs so that the end of one overlaps most with the start of the next.

Nothing here reads data: :meth:`SolarSchedule.simulate` sizes a buffer before a run.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_sdp.datamodules.solar.buffer import EVICTION_POLICIES, Buffer, make_buffer

EPOCH_ORDERS = ("identity", "tsp")
_NEVER = np.int64(2**62)
_SCHEDULE_VERSION = 2


@dataclass(frozen=True)
class RankStep:
    """What one rank does at one step.

    Attributes:
        indices: sample ids of the local batch, in the order they are returned (int64).
        hit: per sample, whether it is served from this rank's buffer (otherwise it is read from storage).
        inserts: ids that enter this rank's buffer after the step (net effect of the step).
        evicts: ids that leave this rank's buffer after the step (net effect of the step).
    """

    indices: np.ndarray
    hit: np.ndarray
    inserts: np.ndarray
    evicts: np.ndarray

    @property
    def reads(self) -> np.ndarray:
        """Ids this rank reads from storage at this step."""
        return self.indices[~self.hit]


@dataclass(frozen=True)
class StepPlan:
    """One global step: the global batch split across ranks.

    Attributes:
        epoch: epoch number (position in the epoch sequence).
        step: step within the epoch.
        global_batch_size: samples in the global batch (``P * B`` except maybe the last step).
        ranks: one :class:`RankStep` per rank.
    """

    epoch: int
    step: int
    global_batch_size: int
    ranks: tuple[RankStep, ...]

    @property
    def loss_scale(self) -> float:
        """``P / G``: multiply the *sum* of a rank's per-sample losses by this so DDP's mean is the global mean."""
        return len(self.ranks) / self.global_batch_size


@dataclass
class SimulationReport:
    """Per-epoch outcome of a schedule, computed without touching data.

    Attributes:
        hit_rate: buffer hits / samples, per epoch (all ranks together).
        bound: ``min(C, N) / N``, the most any buffer of ``C`` samples can hit per epoch after the first.
        hits_per_rank: array ``(epochs, P)`` of buffer hits.
        reads_per_rank: array ``(epochs, P)`` of samples read from storage.
        local_batch_sizes: per epoch an array ``(steps, P)`` of local batch sizes.
        sample_nbytes: bytes per sample, if given to ``simulate``.
    """

    hit_rate: list[float]
    bound: float
    hits_per_rank: np.ndarray
    reads_per_rank: np.ndarray
    local_batch_sizes: list[np.ndarray]
    sample_nbytes: int | None = None

    @property
    def storage_bytes(self) -> list[int] | None:
        """Bytes read from storage per epoch (all ranks), when ``sample_nbytes`` is known."""
        if self.sample_nbytes is None:
            return None
        return [int(r.sum()) * self.sample_nbytes for r in self.reads_per_rank]

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "hit_rate": list(self.hit_rate),
            "bound": self.bound,
            "hits_per_rank": self.hits_per_rank.tolist(),
            "reads_per_rank": self.reads_per_rank.tolist(),
            "local_batch_min": [int(s.min()) for s in self.local_batch_sizes],
            "local_batch_max": [int(s.max()) for s in self.local_batch_sizes],
            "storage_bytes": self.storage_bytes,
        }

    def summary(self) -> str:
        """A small text table, one line per epoch."""
        lines = [
            f"bound C/N = {self.bound:.4f}",
            "epoch  hit_rate  reads/rank(min..max)  local batch(min..max)",
        ]
        for e, rate in enumerate(self.hit_rate):
            reads, sizes = self.reads_per_rank[e], self.local_batch_sizes[e]
            lines.append(
                f"{e:5d}  {rate:8.4f}  {int(reads.min()):>8d}..{int(reads.max()):<8d}      "
                f"{int(sizes.min()):>4d}..{int(sizes.max()):<4d}"
            )
        return "\n".join(lines)


@dataclass
class _SimState:
    buffers: list[Buffer]
    holder: np.ndarray  # rank holding each sample (re-routing), -1 if none
    next_epoch: int = 0
    plans: dict[int, list[StepPlan]] = field(default_factory=dict)


def epoch_steps(num_samples: int, world_size: int, local_batch_size: int, drop_last: bool = False) -> int:
    """Steps per epoch: ``ceil(N / G)``, less one when the last global batch would have fewer samples than ranks
    (those samples join the step before, so that no rank gets an empty batch); ``floor(N / G)`` with ``drop_last``.

    Args:
        num_samples: samples per epoch (``N``).
        world_size: ranks (``P``).
        local_batch_size: nominal per-rank batch (``G = P * B``).
        drop_last: drop the smaller last global batch.
    """
    global_batch = world_size * local_batch_size
    full, tail = divmod(num_samples, global_batch)
    if drop_last or (0 < tail < world_size and full > 0):
        return full
    return full + (tail > 0)


def even_split(total: int, parts: int) -> np.ndarray:
    """Sizes of ``parts`` contiguous chunks of ``total`` items, as even as possible (first chunks larger)."""
    base, extra = divmod(total, parts)
    return np.array([base + (1 if r < extra else 0) for r in range(parts)], dtype=np.int64)


class SolarSchedule:
    """Pre-determined shuffled order plus the per-rank buffer plan of SOLAR.

    The same arguments give the same schedule on every rank and in every run.

    Args:
        num_samples: samples in the training set (``N``).
        num_epochs: epochs planned (``E``); the horizon of :meth:`simulate` and of ``epoch_order="tsp"``. With
            ``epoch_order="identity"`` later epochs can still be asked for (the schedule extends itself).
        world_size: ranks (``P``). Default 1.
        local_batch_size: nominal per-rank batch size (``B``); the global batch is ``G = P * B``.
        buffer_size: buffer capacity in samples for all ranks together (``C``); each rank holds ``C / P``
            (the remainder goes to the first ranks). 0 disables buffering; more than ``N`` caches everything.
        seed: seed of the permutations. Default 0.
        eviction: ``"belady"`` (default), ``"lru"``, ``"fifo"``, ``"solar"`` (consumed-first FIFO, our earlier
            reading of the artifact) or ``"artifact_fifo"`` (the artifact's rule, transcribed); see
            :mod:`lightning_sdp.datamodules.solar.buffer`.
        reroute: serve a buffered sample on the rank that holds it (within its global batch). Default True.
        balance: split each step's storage reads evenly across ranks and let local batch sizes vary. Default True.
        epoch_order: ``"identity"`` (default) or ``"tsp"``: order the ``E`` permutations to maximise the overlap
            between the end of one epoch and the start of the next (exact DP up to 10 epochs, else nearest
            neighbour + 2-opt).
        max_local_batch: cap on a rank's local batch when balancing. Default ``2 * local_batch_size``.
        drop_last: drop the last, smaller global batch of each epoch. Default False (every sample once per epoch).

    Every rank gets at least one sample at every step: a last global batch with fewer samples than ranks joins the
    step before (:func:`epoch_steps`), and a rank that re-routing and balancing would leave empty takes a sample from
    the fullest rank (it reads it from storage).
    """

    def __init__(
        self,
        num_samples: int,
        num_epochs: int,
        world_size: int = 1,
        local_batch_size: int = 32,
        buffer_size: int = 0,
        seed: int = 0,
        eviction: str = "belady",
        reroute: bool = True,
        balance: bool = True,
        epoch_order: str = "identity",
        max_local_batch: int | None = None,
        drop_last: bool = False,
    ) -> None:
        for name, value, low in (
            ("num_samples", num_samples, 1),
            ("num_epochs", num_epochs, 1),
            ("world_size", world_size, 1),
            ("local_batch_size", local_batch_size, 1),
            ("buffer_size", buffer_size, 0),
        ):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
        if epoch_order not in EPOCH_ORDERS:
            raise ValueError(f"epoch_order must be one of {EPOCH_ORDERS}, got {epoch_order!r}")
        if max_local_batch is None:
            max_local_batch = 2 * local_batch_size
        if max_local_batch < local_batch_size:
            raise ValueError(
                f"max_local_batch ({max_local_batch}) must be >= local_batch_size ({local_batch_size}), otherwise "
                "a global batch cannot be split across the ranks"
            )
        global_batch = world_size * local_batch_size
        if num_samples < world_size:
            raise ValueError(
                f"{num_samples} samples cannot give each of {world_size} ranks a sample; use fewer ranks or more data"
            )
        if drop_last and num_samples < global_batch:
            raise ValueError(
                f"drop_last=True with {num_samples} samples and a global batch of {global_batch} "
                f"({world_size} ranks x {local_batch_size}) leaves no step; lower the batch size or set drop_last=False"
            )
        self.num_samples = int(num_samples)
        self.num_epochs = int(num_epochs)
        self.world_size = int(world_size)
        self.local_batch_size = int(local_batch_size)
        self.buffer_size = int(buffer_size)
        self.seed = int(seed)
        self.eviction = eviction
        self.reroute = bool(reroute)
        self.balance = bool(balance)
        self.epoch_order = epoch_order
        self.max_local_batch = int(max_local_batch)
        self.drop_last = bool(drop_last)
        self.global_batch_size = global_batch
        self.steps_per_epoch = epoch_steps(num_samples, world_size, local_batch_size, drop_last)
        self.rank_capacity = even_split(self.buffer_size, self.world_size)
        self._perm_cache: dict[int, np.ndarray] = {}
        self._order = self._epoch_sequence()
        self._partial: tuple[int, int] | None = None
        self._state = self._fresh_state()
        self._hash: str | None = None

    # ------------------------------------------------------------------ configuration
    @property
    def config(self) -> dict[str, Any]:
        """Everything that determines the schedule (compared when resuming from a checkpoint)."""
        return {
            "num_samples": self.num_samples,
            "num_epochs": self.num_epochs,
            "world_size": self.world_size,
            "local_batch_size": self.local_batch_size,
            "buffer_size": self.buffer_size,
            "seed": self.seed,
            "eviction": self.eviction,
            "reroute": self.reroute,
            "balance": self.balance,
            "epoch_order": self.epoch_order,
            "max_local_batch": self.max_local_batch,
            "drop_last": self.drop_last,
        }

    @property
    def schedule_hash(self) -> str:
        """SHA-256 of the configuration, the epoch order and the first permutation."""
        if self._hash is None:
            h = hashlib.sha256()
            h.update(json.dumps({"v": _SCHEDULE_VERSION, **self.config}, sort_keys=True).encode())
            h.update(np.asarray(self._order, dtype=np.int64).tobytes())
            h.update(self.permutation(0).tobytes())
            self._hash = h.hexdigest()
        return self._hash

    @property
    def order_hash(self) -> str:
        """SHA-256 of what fixes every epoch's global sample order (seed, samples, epoch order): equal for schedules
        of any world size and batch size that visit the samples in the same order."""
        h = hashlib.sha256()
        h.update(json.dumps({"v": _SCHEDULE_VERSION, "num_samples": self.num_samples, "seed": self.seed}).encode())
        h.update(np.asarray(self._order, dtype=np.int64).tobytes())
        return h.hexdigest()

    def step_start(self, epoch: int, step: int) -> int:
        """Position in ``epoch``'s permutation of the first sample of ``step`` (``num_samples``: past the end)."""
        if step >= self.steps_per_epoch:
            return self.num_samples
        if self._partial is not None and self._partial[0] == epoch:
            first = self.epoch_plan(epoch)[0].step
            start = self._partial[1] + (step - first) * self.global_batch_size
            return max(start, self._partial[1])
        return step * self.global_batch_size

    def resume_at(self, epoch: int, sample: int) -> int:
        """Plan ``epoch`` from position ``sample`` of its permutation (what a checkpoint of another world size or
        batch size reached) and return the step to continue at.

        Where ``sample`` starts a step of this schedule, that step is returned and nothing changes. Otherwise the rest
        of the epoch, ``permutation(epoch)[sample:]``, is split into global batches of this schedule's size, numbered
        so that the last is step ``steps_per_epoch - 1``; later epochs are planned as usual.

        Args:
            epoch: the epoch the checkpoint is in.
            sample: samples of the epoch's permutation already trained on.
        """
        if not 0 <= sample <= self.num_samples:
            raise ValueError(f"sample position {sample} is outside 0..{self.num_samples}")
        g = self.global_batch_size
        if sample % g == 0 and sample // g < self.steps_per_epoch or sample == self.num_samples:
            if self._partial is not None and self._partial[0] == epoch:
                self._partial = None
                self._state = self._fresh_state()
            return self.steps_per_epoch if sample == self.num_samples else sample // g
        if self.num_samples - sample < self.world_size:
            raise ValueError(
                f"a resumed epoch with {self.num_samples - sample} samples left cannot give each of {self.world_size} "
                "ranks a sample; resume on fewer ranks, or from an earlier checkpoint"
            )
        if self._partial != (epoch, sample):
            self._partial = (epoch, sample)
            self._state = self._fresh_state()  # the plans from this epoch on change
        return self.epoch_plan(epoch)[0].step

    @property
    def bound(self) -> float:
        """Upper bound of the per-epoch hit rate after the first epoch: ``min(C, N) / N``."""
        return min(self.buffer_size, self.num_samples) / self.num_samples

    # ------------------------------------------------------------------ permutations
    def _raw_permutation(self, i: int) -> np.ndarray:
        if i not in self._perm_cache:
            # the i-th child of SeedSequence(seed).spawn(...), without spawning all of them
            rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(i,)))
            self._perm_cache[i] = rng.permutation(self.num_samples).astype(np.int64)
            if len(self._perm_cache) > 8:
                self._perm_cache.pop(next(iter(self._perm_cache)))
        return self._perm_cache[i]

    def _epoch_sequence(self) -> list[int]:
        if self.epoch_order == "identity" or self.num_epochs < 3 and self.buffer_size == 0:
            return list(range(self.num_epochs))
        k = min(self.buffer_size, self.num_samples)
        if k == 0:
            return list(range(self.num_epochs))
        perms = [self._raw_permutation(i) for i in range(self.num_epochs)]
        weight = epoch_overlap_matrix(perms, k)
        return order_epochs(weight)

    def permutation(self, epoch: int) -> np.ndarray:
        """The shuffled sample order of ``epoch`` (a permutation of ``range(num_samples)``)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch >= len(self._order):
            if self.epoch_order == "tsp":
                raise ValueError(
                    f"epoch {epoch} is past the {self.num_epochs} epochs planned with epoch_order='tsp'; "
                    "plan more epochs (num_epochs / max_epochs) or use epoch_order='identity'"
                )
            return self._raw_permutation(epoch)
        return self._raw_permutation(self._order[epoch])

    def global_batch(self, epoch: int, step: int) -> np.ndarray:
        """Sample ids of the global batch (positions ``[t*G, (t+1)*G)`` of the epoch's permutation)."""
        self._check_step(step)
        start, stop = self._step_bounds(step)
        return self.permutation(epoch)[start:stop]

    def _step_bounds(self, step: int) -> tuple[int, int]:
        """Positions ``[start, stop)`` of the step's global batch in the epoch's permutation (the last step runs to
        the end of the epoch, unless ``drop_last``)."""
        g = self.global_batch_size
        last = step + 1 == self.steps_per_epoch and not self.drop_last
        return step * g, self.num_samples if last else (step + 1) * g

    def _check_step(self, step: int) -> None:
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} is outside 0..{self.steps_per_epoch - 1}")

    # ------------------------------------------------------------------ simulation
    def _fresh_state(self) -> _SimState:
        return _SimState(
            buffers=[make_buffer(self.eviction, int(c)) for c in self.rank_capacity],
            holder=np.full(self.num_samples, -1, dtype=np.int64),
        )

    def epoch_plan(self, epoch: int) -> list[StepPlan]:
        """The step plans of ``epoch`` (simulating the buffers through all earlier epochs first)."""
        state = self._state
        if epoch in state.plans:
            return state.plans[epoch]
        if epoch < state.next_epoch:  # released earlier: replay from scratch
            self._state = state = self._fresh_state()
        while state.next_epoch <= epoch:
            state.plans[state.next_epoch] = self._simulate_epoch(state, state.next_epoch)
            state.next_epoch += 1
        return state.plans[epoch]

    def step_plan(self, epoch: int, step: int) -> StepPlan:
        """The plan of one global step."""
        self._check_step(step)
        plan = self.epoch_plan(epoch)
        first = plan[0].step if plan else 0
        if step < first:
            raise IndexError(f"epoch {epoch} resumes at step {first}: step {step} is not planned")
        return plan[step - first]

    def release(self, before_epoch: int) -> None:
        """Forget the plans of epochs before ``before_epoch`` (they are recomputed if asked for again)."""
        for e in [e for e in self._state.plans if e < before_epoch]:
            del self._state.plans[e]

    def _next_use_base(self, epoch: int) -> tuple[np.ndarray | None, int]:
        nxt = epoch + 1
        if self.epoch_order == "tsp" and nxt >= len(self._order):
            return None, 0
        inv = np.empty(self.num_samples, dtype=np.int64)
        inv[self.permutation(nxt)] = np.arange(self.num_samples, dtype=np.int64)
        return inv, nxt * self.num_samples

    def _epoch_steps(self, epoch: int) -> list[tuple[int, int, int]]:
        """``(step, start, stop)`` of each planned step of ``epoch`` (a resumed epoch starts at its sample)."""
        if self._partial is None or self._partial[0] != epoch:
            return [(t, *self._step_bounds(t)) for t in range(self.steps_per_epoch)]
        first = self._partial[1]
        rest = self.num_samples - first
        count = epoch_steps(rest, self.world_size, self.local_batch_size, self.drop_last)
        offset = self.steps_per_epoch - count
        g = self.global_batch_size
        bounds = [(first + t * g, first + (t + 1) * g) for t in range(count)]
        if bounds and not self.drop_last:
            bounds[-1] = (bounds[-1][0], self.num_samples)
        return [(offset + t, a, b) for t, (a, b) in enumerate(bounds)]

    def _simulate_epoch(self, state: _SimState, epoch: int) -> list[StepPlan]:
        perm = self.permutation(epoch)
        inv_next, base = self._next_use_base(epoch)
        plans = []
        prev_tail: set[int] = set()
        if self.eviction == "artifact_fifo" and epoch > 0 and self.buffer_size > 0:
            prev_tail = set(self.permutation(epoch - 1)[-self.buffer_size :].tolist())
        load_steps = self.buffer_size // self.global_batch_size if prev_tail else 0
        for t, start, stop in self._epoch_steps(epoch):
            ids = perm[start:stop]
            if self.eviction == "artifact_fifo":
                load_set = {x for x in ids.tolist() if x not in prev_tail} if t < load_steps else set()
                for buf in state.buffers:
                    buf.begin_step(load_set)  # type: ignore[attr-defined]
            positions = self._assign(state, ids)
            ranks = []
            for r, pos in enumerate(positions):
                local = ids[pos]
                buf = state.buffers[r]
                hit = np.fromiter((int(x) in buf for x in local), dtype=bool, count=len(local))
                next_use = (inv_next[local] + base) if inv_next is not None else np.full(len(local), _NEVER)
                inserted: list[int] = []
                evicted: list[int] = []
                for x, is_hit, nu in zip(local.tolist(), hit.tolist(), next_use.tolist(), strict=True):
                    if is_hit:
                        buf.hit(x, nu)
                for x, is_hit, nu in zip(local.tolist(), hit.tolist(), next_use.tolist(), strict=True):
                    if is_hit or (self.reroute and state.holder[x] >= 0):
                        continue  # buffered on another rank (cap overflow): no duplicate
                    ok, ev = buf.offer(x, nu)
                    if ev is not None:
                        state.holder[ev] = -1
                        if ev in inserted:  # in and out within the step: no net change
                            inserted.remove(ev)
                        else:
                            evicted.append(ev)
                    if ok:
                        inserted.append(x)
                        state.holder[x] = r
                ranks.append(
                    RankStep(
                        indices=local,
                        hit=hit,
                        inserts=np.asarray(inserted, dtype=np.int64),
                        evicts=np.asarray(evicted, dtype=np.int64),
                    )
                )
            plans.append(StepPlan(epoch, t, len(ids), tuple(ranks)))
        return plans

    def _assign(self, state: _SimState, ids: np.ndarray) -> list[np.ndarray]:
        """Positions (into ``ids``) that each rank processes, in shuffled order."""
        p, g = self.world_size, len(ids)
        sizes = even_split(g, p)
        home = np.repeat(np.arange(p), sizes)
        cap = [self.max_local_batch] * p if self.balance else sizes.tolist()
        local: list[list[int]] = [[] for _ in range(p)]
        if self.reroute:
            holder = state.holder[ids]
            taken = np.zeros(g, dtype=bool)
            for j in np.flatnonzero(holder >= 0).tolist():
                r = int(holder[j])
                if len(local[r]) < cap[r]:
                    local[r].append(j)
                    taken[j] = True
            misses = np.flatnonzero(~taken)
        else:
            taken = np.zeros(g, dtype=bool)
            for j in range(g):
                r = int(home[j])
                if int(ids[j]) in state.buffers[r]:
                    local[r].append(j)
                    taken[j] = True
            misses = np.flatnonzero(~taken)
        if self.balance:
            # water-fill the reads: empty ranks first, then the fewest reads, within the cap
            reads = [0] * p
            for _ in range(len(misses)):
                r = min(
                    (q for q in range(p) if len(local[q]) + reads[q] < cap[q]),
                    key=lambda q: (len(local[q]) + reads[q] > 0, reads[q], len(local[q]) + reads[q], q),
                )
                reads[r] += 1
            # each rank reads a contiguous slice of the sorted ids: fewer, longer runs on storage
            by_id = misses[np.argsort(ids[misses], kind="stable")]
            start = 0
            for r in range(p):
                local[r].extend(by_id[start : start + reads[r]].tolist())
                start += reads[r]
        else:
            need = [cap[r] - len(local[r]) for r in range(p)]
            rest = []
            for j in misses.tolist():
                r = int(home[j])
                if need[r] > 0:
                    local[r].append(j)
                    need[r] -= 1
                else:
                    rest.append(j)
            for j in rest:
                r = next(q for q in range(p) if need[q] > 0)
                local[r].append(j)
                need[r] -= 1
        _fill_empty_ranks(local, [state.buffers[r] for r in range(p)], ids)
        return [np.asarray(sorted(pos), dtype=np.int64) for pos in local]

    def simulate(self, num_epochs: int | None = None, sample_nbytes: int | None = None) -> SimulationReport:
        """Run the schedule without data and report hit rates, storage reads and local batch sizes.

        Args:
            num_epochs: epochs to report. Default: ``num_epochs`` of the schedule.
            sample_nbytes: bytes per sample, to also report storage bytes per epoch.
        """
        epochs = self.num_epochs if num_epochs is None else int(num_epochs)
        p = self.world_size
        hits = np.zeros((epochs, p), dtype=np.int64)
        reads = np.zeros((epochs, p), dtype=np.int64)
        sizes = []
        for e in range(epochs):
            plan = self.epoch_plan(e)
            s = np.zeros((len(plan), p), dtype=np.int64)
            for t, step in enumerate(plan):
                for r, rs in enumerate(step.ranks):
                    n_hit = int(rs.hit.sum())
                    hits[e, r] += n_hit
                    reads[e, r] += len(rs.indices) - n_hit
                    s[t, r] = len(rs.indices)
            sizes.append(s)
        total = sizes[0].sum() if sizes else 1
        rate = [float(hits[e].sum()) / max(int(total), 1) for e in range(epochs)]
        return SimulationReport(rate, self.bound, hits, reads, sizes, sample_nbytes)


def _fill_empty_ranks(local: list[list[int]], buffers: list[Buffer], ids: np.ndarray) -> None:
    """Give each rank without a sample one from the fullest rank, preferring one that rank does not buffer.

    Re-routing can put a whole step on the ranks that buffer its samples; an empty local batch would make a mean loss
    ``nan`` (and some layers fail), so the sample moves and is read from storage by its new rank.
    """
    for r in range(len(local)):
        if local[r]:
            continue
        donor = max(range(len(local)), key=lambda q: (len(local[q]), -q))
        unbuffered = [j for j in local[donor] if int(ids[j]) not in buffers[donor]]
        j = unbuffered[-1] if unbuffered else local[donor][-1]
        local[donor].remove(j)
        local[r].append(j)


def epoch_overlap_matrix(perms: list[np.ndarray], k: int) -> np.ndarray:
    """``W[i, j]``: samples among the last ``k`` of epoch ``i`` that are among the first ``k`` of epoch ``j``."""
    n = len(perms)
    w = np.zeros((n, n), dtype=np.int64)
    for i in range(n):
        tail = np.zeros(len(perms[i]), dtype=bool)
        tail[perms[i][-k:]] = True
        for j in range(n):
            if i != j:
                w[i, j] = int(tail[perms[j][:k]].sum())
    return w


def order_epochs(weight: np.ndarray) -> list[int]:
    """An open path through all epochs maximising the summed overlap ``weight[a, b]`` of consecutive epochs.

    Exact (Held-Karp dynamic programme) up to 10 epochs, nearest neighbour from every start plus 2-opt above.
    Ties keep the identity order.
    """
    n = len(weight)
    identity = list(range(n))
    if n <= 2 or not weight.any():
        return identity
    path = _held_karp_path(weight) if n <= 10 else _two_opt(weight, _best_nearest_neighbour_path(weight))
    return path if _path_value(weight, path) > _path_value(weight, identity) else identity


def _path_value(weight: np.ndarray, path: list[int]) -> int:
    """Summed ``weight[a, b]`` over consecutive epochs ``a, b`` of ``path``."""
    return int(sum(weight[a, b] for a, b in itertools.pairwise(path)))


def _held_karp_path(weight: np.ndarray) -> list[int]:
    """The best open path, exactly: ``best[mask, v]`` is the best path visiting ``mask`` and ending at ``v``."""
    n = len(weight)
    full = 1 << n
    best = np.full((full, n), -1, dtype=np.int64)
    parent = np.full((full, n), -1, dtype=np.int64)
    for v in range(n):
        best[1 << v, v] = 0
    for mask in range(full):
        for v in range(n):
            cur = best[mask, v]
            if cur < 0 or not mask >> v & 1:
                continue
            for u in range(n):
                if mask >> u & 1:
                    continue
                nm = mask | 1 << u
                cand = cur + weight[v, u]
                if cand > best[nm, u]:
                    best[nm, u] = cand
                    parent[nm, u] = v
    end = int(np.argmax(best[full - 1]))
    path, mask = [end], full - 1
    while parent[mask, path[-1]] >= 0:
        prev = int(parent[mask, path[-1]])
        mask ^= 1 << path[-1]
        path.append(prev)
    path.reverse()
    return path


def _best_nearest_neighbour_path(weight: np.ndarray) -> list[int]:
    """The best of the greedy paths from every start (each step to the unvisited epoch of largest overlap)."""
    n = len(weight)
    path = list(range(n))
    for start in range(n):
        cand, left = [start], set(range(n)) - {start}
        while left:
            nxt = max(sorted(left), key=lambda u: weight[cand[-1], u])
            cand.append(nxt)
            left.remove(nxt)
        if _path_value(weight, cand) > _path_value(weight, path):
            path = cand
    return path


def _two_opt(weight: np.ndarray, path: list[int]) -> list[int]:
    """Reverse sub-paths of ``path`` while that raises its value (2-opt local search)."""
    n = len(path)
    improved = True
    while improved:
        improved = False
        for i in range(n - 1):
            for j in range(i + 1, n):
                cand = path[:i] + path[i : j + 1][::-1] + path[j + 1 :]
                if _path_value(weight, cand) > _path_value(weight, path):
                    path, improved = cand, True
    return path
