"""``"auto"`` compression: the formats that make this run's step shortest, chosen from what the run measures.

How much compression pays depends on the link (a 50 Mbit/s link between nodes wants 4-bit codes, a 10 Gbit/s one
may not), on the CPU or GPU that runs the codec, and on the model. :class:`AutoCompression` therefore measures:

1. At set-up, :func:`probe_links` times an all-to-all on each level's process group (intra-node, inter-node), all
   ranks at once as in training, doubling the message until it takes long enough to time; with the exact bytes
   each format sends (:func:`wire_bytes`), every candidate gets a lower bound on its step: its time on the wire.
2. Over the first optimizer steps the candidate with the least wire time runs for ``trial_steps`` steps (after two
   to settle); the candidates whose wire time alone exceeds its step are not tried. It and the others then run in
   rounds of one step each, ``trial_steps`` rounds after one to settle, so that a machine whose speed drifts
   slows every candidate alike. A turn that switches between DDP's exchange and a sharded one starts with one
   step that is not timed: the first step after the optimizer state changes layout pays for memory the switch
   freed and allocated, which later steps do not.
   Every step time is agreed across ranks (the slowest rank's), so every rank decides the same from the same
   numbers.
3. A compressed (lossy) candidate is kept only when it wins by more than the noise of the trials. Each candidate is
   compared with the fastest round by round; it ties when the median of its step minus the fastest one's is within
   the spread of those differences (:func:`trial_spread`) or 3%, and so is its extra wire time. A tie that only the
   scatter of a few rounds makes (slower by more than 3% in every round but at most one: one round of another
   job's burst widens the spread) is tried for as many rounds again, and loses if it was slower in all of them, or
   in all but an outlier (the median difference beyond 3 times the differences' median absolute deviation). Of the
   fastest and those tying with it, the least compressed is kept (as fast, and cheaper to trust); of equally exact
   ones, the one with less CPU per step. Trials are repeated every ``recheck_every`` steps.

Every trial step is a real training step; only its format differs. The time the training loop spends outside the
steps (validation, checkpoints) is taken out of the step it falls in (:meth:`AutoCompression.exclude`). Nothing here
imports Lightning.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_sdp.kernels.quantization import QuantFormat
from lightning_sdp.plugins.sdp4bit.config import SDP4BitConfig
from lightning_sdp.plugins.sdp4bit.formats import GradientFormat, WeightFormat
from lightning_sdp.plugins.sdp4bit.topology import Topology

# Step times this close are one another's noise on a shared machine even when the trials scatter less; the less
# compressed of two such is then preferred (same speed, exact values).
EQUAL_WITHIN = 0.03
# A trial step this many times its candidate's median is a hiccup (a garbage collection, another job's burst), not the
# machine's noise: its round is left out of the spreads (the medians ignore it anyway).
HICCUP = 2.0
# A probe message is timed once it takes at least this long (or reaches the largest size).
_PROBE_SECONDS = 0.05
_PROBE_BYTES = (2**16, 2**24)

Agree = Callable[[Sequence[float]], list[float]]


@dataclass(frozen=True)
class Candidate:
    """One weight format and one gradient format used together, or (``replicated``) DDP's exchange: an fp32
    all-reduce of the gradients and a replicated optimizer (then the formats are the uncompressed ones)."""

    weight: WeightFormat
    gradient: GradientFormat
    replicated: bool = False

    def describe(self) -> str:
        """In words, e.g. ``"weights 4-bit qwd, gradients 8-bit intra / 4-bit inter, Hadamard 32"``."""
        if self.replicated:
            return "DDP's exchange (fp32 all-reduce, optimizer state replicated)"
        return f"weights {self.weight.describe()}, gradients {self.gradient.describe()}"

    @property
    def exactness(self) -> tuple[int, int]:
        """Larger for less compression: bits per weight value, bits per gradient value between nodes."""
        weight = 32 if not self.weight.quantized else self.weight.bits
        gradient = 32 if not self.gradient.quantized else (self.gradient.inter_bits or 32)
        return weight, gradient

    @property
    def trust(self) -> tuple[int, int]:
        """Larger for the candidate to keep among equally fast ones: the least compressed. Equally exact candidates
        (the sharded and the replicated fp32 exchange) are told apart by their CPU time per step instead: the noise
        margin guards against lossy formats, not against the cheaper of two exact ones."""
        return self.exactness


@dataclass(frozen=True)
class LinkSpeeds:
    """Bytes per second each rank moved at each level while every rank sent at once (``None``: no such level)."""

    intra: float | None
    inter: float | None

    def describe(self) -> str:
        """In words, in Mbit/s per rank."""
        levels = (("intra-node", self.intra), ("inter-node", self.inter))
        parts = [f"{name} {speed * 8 / 1e6:,.0f} Mbit/s" for name, speed in levels if speed is not None]
        # the ranks of a node share its links: each rank's share, not the link's rate
        return ", ".join(parts) + " per rank" if parts else "no link"


def probe_links(topo: Topology, device: torch.device, agree: Agree) -> LinkSpeeds:
    """Time an all-to-all on each level's group, all ranks at once (a collective on every rank).

    Args:
        topo: the process topology (its intra- and inter-node groups).
        device: where the messages live (the strategy's root device).
        agree: element-wise maximum of a list of floats over all ranks (so every rank reads the slowest time).
    """

    def level(group: Any, size: int) -> float | None:
        if group is None or size < 2:
            return None
        nbytes = _PROBE_BYTES[0]
        warm = True
        while True:
            numel = max(size, nbytes // 4 // size * size)
            send = torch.zeros(numel, device=device)
            recv = torch.empty_like(send)
            if warm:  # the first collective on a group sets up its connections
                dist.all_to_all_single(recv, send, group=group)
                warm = False
            agree([0.0])  # start together, so the ranks share the link as they do in training
            start = time.perf_counter()
            dist.all_to_all_single(recv, send, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = agree([time.perf_counter() - start])[0]
            moved = 4 * numel * (size - 1) / size
            if elapsed >= _PROBE_SECONDS or 4 * numel >= _PROBE_BYTES[1]:
                return moved / max(elapsed, 1e-9)
            nbytes *= 4

    inter_group = topo.inter_group if topo.intra_size > 1 else topo.world_group
    return LinkSpeeds(level(topo.intra_group, topo.intra_size), level(inter_group, topo.inter_size))


def wire_bytes(
    candidate: Candidate,
    topo: Topology,
    shard_sizes: Sequence[int],
    weight_itemsize: int,
    gradient_group: int,
    replicated_bytes: int | None = None,
) -> tuple[float, float]:
    """Bytes this rank sends per optimizer step at each level, ``(intra, inter)``, as the exchange sends them.

    Args:
        candidate: the formats.
        topo: the process topology.
        shard_sizes: values per rank of every bucket.
        weight_itemsize: bytes of one model weight (uncompressed all-gather).
        gradient_group: values per gradient scale.
        replicated_bytes: bytes DDP's exchange all-reduces (DDP's reducer sends the trainable parameters'
            gradients, in their dtype); ``None``: the zero-padded fp32 buckets (the strategy's own all-reduce).
    """
    nodes, local, world = topo.inter_size, topo.intra_size, topo.world_size
    if candidate.replicated:
        # a ring all-reduce over the ranks, node by node: each rank sends 2 (W - 1) / W of the buffer, and one rank
        # per node sends across nodes (counted per rank, as the links' speeds are)
        nbytes = 4 * sum(world * s for s in shard_sizes) if replicated_bytes is None else replicated_bytes
        total = 2 * (world - 1) / world * nbytes
        return (total * (local - 1) / local, total / local) if nodes > 1 else (total, 0.0)
    weight = candidate.weight
    weight_value = (
        QuantFormat(weight.bits, weight.group_size).bits_per_value / 8 if weight.quantized else weight_itemsize
    )
    intra, inter = gradient_wire_bytes(candidate.gradient, topo, shard_sizes, gradient_group)
    for s in shard_sizes:
        row = s * weight_value
        if nodes > 1 and local > 1:
            inter += (nodes - 1) * row
            intra += (local - 1) * nodes * row
        elif nodes > 1:
            inter += (world - 1) * row
        else:
            intra += (world - 1) * row
    return intra, inter


def gradient_wire_bytes(
    grad: GradientFormat, topo: Topology, shard_sizes: Sequence[int], gradient_group: int
) -> tuple[float, float]:
    """Bytes this rank sends per optimizer step in the gradient exchange, ``(intra, inter)`` (see :func:`wire_bytes`)."""
    nodes, local, world = topo.inter_size, topo.intra_size, topo.world_size

    def grad_bytes(values: float, bits: int | None) -> float:
        return 4.0 * values if bits is None else values * QuantFormat(bits, gradient_group).bits_per_value / 8

    intra = inter = 0.0
    for s in shard_sizes:
        if local > 1:
            intra += (local - 1) / local * grad_bytes(world * s, grad.intra_bits)
            if nodes > 1:
                inter += (nodes - 1) / nodes * grad_bytes(nodes * s, grad.inter_bits)
        elif nodes > 1:
            inter += (nodes - 1) / nodes * grad_bytes(world * s, grad.inter_bits)
    return intra, inter


def agree_max(topo: Topology, device: torch.device) -> Agree:
    """Element-wise maximum of a list of floats over all ranks (a collective; the identity with one process)."""

    def agree(values: Sequence[float]) -> list[float]:
        tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized() and topo.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    return agree


def distinct_candidates(
    weights: Sequence[WeightFormat], gradients: Sequence[GradientFormat], topo: Topology, replicated: bool = False
) -> list[Candidate]:
    """Every pair of formats, without those that would send the same codes on this topology (with one node the
    inter-node bits are never used), and with ``replicated`` DDP's exchange last (when uncompressed weights and
    gradients are among the formats)."""
    seen: dict[tuple[Any, ...], Candidate] = {}
    for w in weights:
        for g in gradients:
            intra = g.intra_bits if topo.intra_size > 1 else None
            inter = g.inter_bits if topo.inter_size > 1 else None
            key = (w, intra, inter, g.hadamard)
            seen.setdefault(key, Candidate(w, g))
    exact = [c for c in seen.values() if not c.weight.quantized and not c.gradient.quantized]
    if replicated and exact:
        return [*seen.values(), Candidate(exact[0].weight, exact[0].gradient, replicated=True)]
    return list(seen.values())


def _median_deviation(samples: Sequence[float]) -> float:
    """The median absolute deviation from the median (one outlier does not move it)."""
    median = statistics.median(samples)
    return statistics.median(abs(x - median) for x in samples)


def trial_spread(samples: Sequence[float]) -> float:
    """How far trial step times (or their differences) scatter: their range (0 for fewer than two)."""
    return max(samples) - min(samples) if len(samples) > 1 else 0.0


@dataclass
class Decision:
    """One choice of ``"auto"``: when, what, and the step times (s) it was chosen from, their spreads and CPU time."""

    step: int
    chosen: Candidate
    measured: dict[str, float]
    links: LinkSpeeds
    skipped: list[str] = field(default_factory=list)
    spread: dict[str, float] = field(default_factory=dict)
    note: str = ""
    cpu: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        """The decision in words, as logged."""

        def details(name: str) -> str:
            parts = [f"spread {self.spread[name]:.3f} s"] if name in self.spread else []
            parts += [f"CPU {self.cpu[name]:.3f} s"] if name in self.cpu else []
            return f" ({', '.join(parts)})" if parts else ""

        others = "; ".join(f"{name}: {seconds:.3f} s{details(name)}" for name, seconds in self.measured.items())
        text = f"SDP4Bit auto (step {self.step}): {self.chosen.describe()}. Step times tried: {others}."
        if self.skipped:
            text += f" Not tried: {'; '.join(self.skipped)}."
        text += f" Links: {self.links.describe()}."
        return f"{text} {self.note}" if self.note else text


class AutoCompression:
    """Tries the candidate formats over the first optimizer steps and keeps the fastest (see the module docstring).

    Call :meth:`observe` on every rank at the start of every optimizer step, then exchange with the formats it
    returns (:attr:`active`).

    Args:
        candidates: the formats to choose from.
        wire_seconds: each candidate's time on the wire per step (a lower bound on its step).
        trial_steps: steps timed per candidate.
        recheck_every: optimizer steps between a decision and the next round of trials (0: never).
        agree: element-wise maximum of a list of floats over all ranks.
        links: the measured link speeds (reported with each decision).
        remeasure: called before a recheck; returns fresh ``(wire_seconds, links)``.
        fits: for a ``replicated`` candidate that may be tried, whether its optimizer state fits and the bytes in
            words (called on every rank at the same step; may be a collective); ``None``: it always fits.

    Attributes:
        clock: the seconds :meth:`observe` reads when it is given no time (``time.perf_counter``); measure what you
            pass to :meth:`exclude` with it.
        cpu_clock: the process's CPU seconds, all threads (``time.process_time``), read with :attr:`clock`.
    """

    def __init__(
        self,
        candidates: Sequence[Candidate],
        wire_seconds: Sequence[float],
        trial_steps: int,
        recheck_every: int,
        agree: Agree,
        links: LinkSpeeds,
        remeasure: Callable[[], tuple[list[float], LinkSpeeds]] | None = None,
        fits: Callable[[Candidate], tuple[bool, str]] | None = None,
    ) -> None:
        if not candidates or len(candidates) != len(wire_seconds):
            raise ValueError("AutoCompression needs one wire time per candidate, and at least one candidate.")
        self.candidates, self.wire = list(candidates), list(wire_seconds)
        self.trial_steps, self.recheck_every = trial_steps, recheck_every
        self.agree, self.links, self.remeasure, self.fits = agree, links, remeasure, fits
        self.decisions: list[Decision] = []
        self.clock: Callable[[], float] = time.perf_counter
        self.cpu_clock: Callable[[], float] = time.process_time
        self._last: float | None = None
        self._last_cpu = 0.0
        self._excluded, self._paused, self._paused_at = 0.0, 0, 0.0
        self._excluded_cpu, self._paused_at_cpu = 0.0, 0.0
        self._start_trials(warm_up=True)

    @property
    def trialling(self) -> bool:
        """Whether candidates are being timed (the formats may change at the next step)."""
        return self._schedule is not None

    def _start_trials(self, warm_up: bool) -> None:
        # replicated last among equals: its memory is checked before it runs (after the first candidate's steps)
        self._order = sorted(
            range(len(self.candidates)), key=lambda i: (self.wire[i], self.candidates[i].replicated, i)
        )
        # first the candidate with the least wire time alone (after the fit's slow first steps), for pruning
        first = self._order[0]
        settle = 2 if warm_up else 1
        self._schedule: list[int] | None = [first] * (settle + self.trial_steps)
        self._timed, self._position = [False] * settle + [True] * self.trial_steps, 0
        self._samples: dict[int, list[float]] = {}
        self._cpu_samples: dict[int, list[float]] = {}
        self._measured: dict[int, float] = {}
        self._cpu: dict[int, float] = {}
        self._skipped: dict[int, str] = {}
        self._memory: dict[int, str] = {}
        self._pruned = self._extended = False
        self.active = self.candidates[first]
        self._decided_at: int | None = None

    def exclude(self, seconds: float, cpu_seconds: float = 0.0) -> None:
        """Leave ``seconds`` (and ``cpu_seconds`` of CPU time) out of the step that is running (time the training
        loop spent outside the step: validation, checkpoints, the strategy re-arranging its state)."""
        self._excluded += seconds
        self._excluded_cpu += cpu_seconds

    def pause(self) -> None:
        """Stop counting the running step's time until the matching :meth:`resume` (pauses nest: a checkpoint
        saved during validation is left out once)."""
        if self._paused == 0:
            self._paused_at, self._paused_at_cpu = self.clock(), self.cpu_clock()
        self._paused += 1

    def resume(self) -> None:
        """Count the step's time again (see :meth:`pause`)."""
        self._paused -= 1
        if self._paused == 0:
            self.exclude(self.clock() - self._paused_at, self.cpu_clock() - self._paused_at_cpu)

    def observe(self, step: int, now: float | None = None, cpu: float | None = None) -> Candidate:
        """Note that optimizer step ``step`` starts (a collective when a trial ends); returns the formats to use.

        ``now`` and ``cpu``: the clocks' readings (default: :attr:`clock` and :attr:`cpu_clock`)."""
        now = self.clock() if now is None else now
        cpu = self.cpu_clock() if cpu is None else cpu
        elapsed = None if self._last is None else max(0.0, now - self._last - self._excluded)
        cpu_elapsed = max(0.0, cpu - self._last_cpu - self._excluded_cpu)
        self._last, self._excluded, self._last_cpu, self._excluded_cpu = now, 0.0, cpu, 0.0
        if self._schedule is None:
            if self.recheck_every and self._decided_at is not None and step - self._decided_at >= self.recheck_every:
                if self.remeasure is not None:
                    self.wire, self.links = self.remeasure()
                self._start_trials(warm_up=False)
            return self.active
        if elapsed is None:  # the first step of the fit: nothing ran yet
            return self.active
        # the step that just ended ran the candidate at the current position of the schedule
        if self._timed[self._position]:
            self._samples.setdefault(self._schedule[self._position], []).append(elapsed)
            self._cpu_samples.setdefault(self._schedule[self._position], []).append(cpu_elapsed)
        self._position += 1
        if self._position == len(self._schedule):
            self._end_of_schedule(step)
        if self._schedule is not None:
            self.active = self.candidates[self._schedule[self._position]]
        return self.active

    def _end_of_schedule(self, step: int) -> None:
        """Agree on the step times; after the first candidate, prune by wire time and interleave the rest with it."""
        ids = list(self._samples)
        # one collective for both clocks: the slowest rank's step, and the busiest rank's CPU
        agreed = iter(
            self.agree([t for samples in (self._samples, self._cpu_samples) for i in ids for t in samples[i]])
        )
        self._samples = {i: [next(agreed) for _ in self._samples[i]] for i in ids}
        self._cpu_samples = {i: [next(agreed) for _ in self._cpu_samples[i]] for i in ids}
        self._measured = {i: statistics.median(self._samples[i]) for i in ids}
        self._cpu = {i: statistics.median(self._cpu_samples[i]) for i in ids}
        fastest = min(self._measured, key=lambda i: (self._measured[i], i))
        best = self._measured[fastest]
        if not self._pruned:
            self._pruned = True
            rest = self._order[1:]
            self._skipped = {i: f"wire time {self.wire[i]:.3f} s" for i in rest if self.wire[i] >= best}
            survivors = [i for i in rest if i not in self._skipped and self._fits(i)]
            if survivors:
                # rounds of one step per candidate, the first round to settle: a machine whose speed drifts slows
                # every candidate alike
                self._schedule, self._timed = self._rounds([self._order[0], *survivors], self._order[0])
                self._position, self._samples, self._cpu_samples = 0, {}, {}
                return
        if not self._extended:
            self._extended = True
            doubtful = self._slower_in_nearly_every_round(fastest)
            if doubtful:
                # a tie only by the trials' scatter, yet slower in every round but one: as many rounds again for
                # these (the samples so far are kept), then the tie must not be slower in two of twice the rounds
                assert self._schedule is not None
                self._schedule, self._timed = self._rounds([fastest, *doubtful], self._schedule[-1])
                self._position = 0
                return
        chosen = self._choose(fastest)
        self.active, self._schedule, self._decided_at = self.candidates[chosen], None, step
        order = sorted(self._measured, key=lambda i: self._measured[i])
        measured = {self.candidates[i].describe(): self._measured[i] for i in order}
        spread = {self.candidates[i].describe(): trial_spread(self._against(i, fastest)) for i in order}
        cpu = {self.candidates[i].describe(): self._cpu[i] for i in order}
        skipped = [f"{self.candidates[i].describe()} ({why})" for i, why in self._skipped.items()]
        note = ""
        if self.active.replicated:
            note = (
                f"The optimizer state is replicated: {self._memory.get(chosen, 'sharding is off')}; that is the memory sharding saved. "
                "Pass optimizer_state='shard' to keep it sharded."
            )
        self.decisions.append(Decision(step, self.active, measured, self.links, skipped, spread, note, cpu))

    def _rounds(self, ring: list[int], previous: int) -> tuple[list[int], list[bool]]:
        """The interleaved schedule: ``1 + trial_steps`` rounds of one timed step per candidate of ``ring`` (the
        first round untimed), each turn that switches the optimizer state's layout preceded by an untimed step
        (``previous``: the candidate of the step before)."""
        schedule, timed = [previous], [False]
        for round_ in range(1 + self.trial_steps):
            for i in ring:
                if self.candidates[schedule[-1]].replicated != self.candidates[i].replicated:
                    schedule.append(i)
                    timed.append(False)
                schedule.append(i)
                timed.append(round_ > 0)
        return schedule[1:], timed[1:]

    def _slower_in_nearly_every_round(self, fastest: int) -> list[int]:
        """The candidates that would be kept over the fastest (as exact or more, tying with it; see :meth:`_choose`)
        although every round but at most one measured them slower by more than :data:`EQUAL_WITHIN`: the scatter of
        a few rounds made them ties (one round of another job's burst is enough to)."""
        trust = self.candidates[fastest].trust
        return [
            i
            for i in self._measured
            if i != fastest
            and self.candidates[i].trust >= trust
            and self._ties(i, fastest)
            and self._rounds_not_slower(i, fastest) <= 1
        ]

    def _rounds_not_slower(self, i: int, fastest: int) -> int:
        """Rounds in which candidate ``i`` was not slower than the fastest by more than :data:`EQUAL_WITHIN`
        (all of them when they were never timed in the same rounds)."""
        floor = EQUAL_WITHIN * self._measured[fastest]
        differences = self._against(i, fastest)
        return sum(d <= floor for d in differences) if differences else self.trial_steps

    def _ties(self, i: int, fastest: int) -> bool:
        """Whether candidate ``i`` is as fast as the fastest within the noise (see :meth:`_choose`)."""
        if i == fastest:
            return True
        best = self._measured[fastest]
        differences = self._against(i, fastest) or [self._measured[i] - best]
        margin = max(trial_spread(differences), EQUAL_WITHIN * best)
        # twice the rounds (a hiccup's round left out at most), never the first rounds alone
        doubled = len(differences) > self.trial_steps and len(differences) >= 2 * self.trial_steps - 1
        if self._extended and doubled:
            # slower in each of twice the rounds, or in all but one and by more than 3 times the differences' usual
            # deviation (which the one round does not move): not the scatter
            not_slower, median = self._rounds_not_slower(i, fastest), statistics.median(differences)
            if not_slower == 0 or (not_slower == 1 and median > 3 * _median_deviation(differences)):
                return False
        return statistics.median(differences) <= margin and self.wire[i] - self.wire[fastest] <= margin

    def _fits(self, i: int) -> bool:
        """Whether candidate ``i`` may be tried: always, unless it replicates an optimizer state that does not fit."""
        if not self.candidates[i].replicated:
            return True
        fits, words = self.fits(self.candidates[i]) if self.fits is not None else (True, "")
        self._memory[i] = words
        if not fits:
            self._skipped[i] = f"its optimizer state would not fit: {words}"
        return fits

    def _against(self, i: int, fastest: int) -> list[float]:
        """Candidate ``i``'s step minus the fastest one's, round by round, without the rounds where either had a
        hiccup (its own steps when ``i`` is the fastest)."""

        def usual(k: int) -> list[float | None]:
            return [t if t <= HICCUP * self._measured[k] else None for t in self._samples[k]]

        mine, theirs = usual(i), usual(fastest)
        if i == fastest:
            return [a for a in mine if a is not None]
        if len(mine) != len(theirs):  # not timed in the same rounds: against the fastest one's median
            return [a - self._measured[fastest] for a in mine if a is not None]
        return [a - b for a, b in zip(mine, theirs, strict=True) if a is not None and b is not None]

    def _choose(self, fastest: int) -> int:
        """The least compressed candidate that the fastest one does not beat by more than the noise.

        A candidate ties with the fastest when, round by round, its step is longer by a median of at most the
        spread of those differences (or 3% of the fastest step), and so is its wire time: trial steps can all be
        slow (the fit's first steps), which hides a wire-time difference that every later step would pay. Round by
        round, a machine whose speed drifts adds no spread. Of the ties, the least compressed; of equally exact ones,
        the one with the least CPU per step (the busiest rank's median).
        """
        close = [i for i in self._measured if self._ties(i, fastest)]
        # equally fast and exact (sharded and replicated fp32): the one that costs less CPU per step, which the clock
        # of a shared or CPU-bound machine scatters less than the step; then the sharded one (it saves memory)
        return max(
            close,
            key=lambda i: (
                self.candidates[i].trust,
                -round(self._cpu[i], 3),
                -self._measured[i],
                not self.candidates[i].replicated,
            ),
        )

    def metrics(self) -> dict[str, float]:
        """``sdp4bit/auto_*`` scalars: whether candidates are being tried, the links in Mbit/s per rank."""
        out = {"sdp4bit/auto_trialling": float(self.trialling), "sdp4bit/replicated": float(self.active.replicated)}
        for name, speed in (("intra", self.links.intra), ("inter", self.links.inter)):
            if speed is not None:
                out[f"sdp4bit/link_{name}_mbit_s"] = speed * 8 / 1e6
        return out


def build_auto(
    config: SDP4BitConfig,
    topo: Topology,
    shard_sizes: Sequence[int],
    weight_itemsize: int,
    device: torch.device,
    before_probe: Callable[[], None] = lambda: None,
    links: LinkSpeeds | None = None,
    fits: Callable[[Candidate], tuple[bool, str]] | None = None,
    replicated_bytes: int | None = None,
) -> AutoCompression:
    """Probe the links (a collective) and return the controller that chooses among the config's candidate formats.

    Args:
        config: the strategy's options (candidate formats, gradient group size, trial steps, re-check interval).
        topo: the process topology.
        shard_sizes: values per rank of every bucket.
        weight_itemsize: bytes of one model weight.
        device: the strategy's root device.
        before_probe: called before a recheck's probe (wait for the exchanges in flight).
        links: links this set-up already probed (every rank passes them or none does); ``None``: probe them.
        fits: see :class:`AutoCompression` (DDP's exchange is a candidate with ``optimizer_state="auto"``).
        replicated_bytes: see :func:`wire_bytes`.
    """
    replicated = config.optimizer_state == "auto"
    candidates = distinct_candidates(config.weight_candidates, config.gradient_candidates, topo, replicated)
    agree = agree_max(topo, device)

    def measure(known: LinkSpeeds | None = None) -> tuple[list[float], LinkSpeeds]:
        links = known or probe_links(topo, device, agree)
        seconds = []
        for candidate in candidates:
            group = config.gradient_group_size
            intra, inter = wire_bytes(candidate, topo, shard_sizes, weight_itemsize, group, replicated_bytes)
            seconds.append(intra / (links.intra or float("inf")) + inter / (links.inter or float("inf")))
        return seconds, links

    def remeasure() -> tuple[list[float], LinkSpeeds]:
        before_probe()
        return measure()

    seconds, probed = measure(links)
    trials, recheck = config.auto_trial_steps, config.auto_recheck_every_n_steps
    return AutoCompression(candidates, seconds, trials, recheck, agree, probed, remeasure, fits)
