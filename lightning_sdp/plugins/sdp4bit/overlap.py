"""Overlap and pipelining of SDP4Bit's collectives (the paper's runtime optimisation, Jia et al. 2024, Sec. 4).

Three parts, each used by :class:`~lightning_sdp.plugins.sdp4bit.SDP4BitStrategy`:

- :class:`Pipeline`: two FIFO worker threads carry every bucket's exchange. The first runs what uses the intra-node
  group (quantise, 8-bit all-to-all, dequantise + sum + re-quantise) or the weight all-gather, the second what uses
  the inter-node group (4-bit all-to-all, dequantise + sum + inverse Hadamard) or the weight decoding. Every process
  group is used by one thread only, and buckets enter the threads in the same order on every rank, so the
  collectives match across ranks.
- :class:`GradientOverlap`: post-accumulate-grad hooks launch each bucket's gradient reduce-scatter as soon as
  backward has produced all its gradients (DDP's reducer, Megatron's ``overlap_grad_reduce``). While the training
  thread runs the backward of early layers, the first thread exchanges the gradients of late layers and the second
  one sends the previous bucket between nodes: compute, intra-node and inter-node traffic overlap.
- :class:`WeightOverlap`: the weight all-gathers after the optimizer step, pipelined per bucket; with
  ``overlap_param_gather`` the step returns at once and forward pre-hooks make each module wait only for the
  bucket(s) holding its own parameters (Megatron's ``overlap_param_gather``).

Nothing here imports Lightning.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from lightning_sdp.kernels import quantization
from lightning_sdp.plugins.sdp4bit.config import SDP4BitConfig
from lightning_sdp.plugins.sdp4bit.exchange import (
    AllReduceExchange,
    Codec,
    CommStats,
    GradientExchange,
    RoundingRNG,
    TorchOps,
    WeightExchange,
    first_level_bits,
    max_safe_scale,
)
from lightning_sdp.plugins.sdp4bit.formats import ActiveFormats, GradientFormat
from lightning_sdp.plugins.sdp4bit.sharding import FlatBucket, all_reduce_sum
from lightning_sdp.plugins.sdp4bit.topology import Topology

T = TypeVar("T")


class Done(Generic[T]):
    """A finished job run on the calling thread (the non-overlapped path): the same interface as a ``Future``."""

    def __init__(self, value: T) -> None:
        self._value = value

    def result(self) -> T:
        """The value."""
        return self._value

    def done(self) -> bool:
        """Always ``True``."""
        return True


class Pipeline:
    """Runs ``first`` then ``second`` of each job: on two FIFO threads (``threaded=True``) or inline.

    Args:
        threaded: run the stages on the two worker threads (overlap) instead of the calling thread.
    """

    def __init__(self, threaded: bool) -> None:
        self.threaded = threaded
        self._stages: list[ThreadPoolExecutor] = []
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # Lightning pickles the strategy to start processes with "spawn": the threads and lock stay behind
        return {"threaded": self.threaded}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["threaded"])  # type: ignore[misc]

    def _executors(self) -> list[ThreadPoolExecutor]:
        with self._lock:
            if not self._stages:
                self._stages = [
                    ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sdp4bit-comm{i}") for i in (1, 2)
                ]
            return self._stages

    def submit(self, first: Callable[[], Any], second: Callable[[], T]) -> Future[T] | Done[T]:
        """Queue one job; ``second`` starts once ``first`` is done and the previous job's ``second`` is done."""
        if not self.threaded:
            first()
            return Done(second())
        one, two = self._executors()
        started = one.submit(first)

        def run_second() -> T:
            started.result()  # re-raises what ``first`` raised
            return second()

        return two.submit(run_second)

    def shutdown(self) -> None:
        """Stop the worker threads (idempotent; they are started again on the next ``submit``)."""
        with self._lock:
            stages, self._stages = self._stages, []
        for ex in stages:
            ex.shutdown(wait=True)


@dataclass
class ExchangeContext:
    """What every exchange of one ``fit`` shares; the strategy builds it at set-up.

    Attributes:
        config: the strategy's options.
        topology: intra/inter-node process groups.
        world_size: data-parallel world size.
        device: where the agreement tensors live (the strategy's root device).
        rng: stochastic rounding streams (reset every optimizer step).
        ops: torch or Triton kernels.
        stats: the strategy's byte accounting.
        pipeline: the worker threads (or the inline pipeline).
        formats: the formats of the next exchanges (switched between steps by ``"auto"``).
    """

    config: SDP4BitConfig
    topology: Topology
    world_size: int
    device: torch.device
    rng: RoundingRNG
    ops: TorchOps
    stats: CommStats
    pipeline: Pipeline
    formats: ActiveFormats


@dataclass
class ReducedGradients:
    """The outcome of one optimizer step's gradient exchange, agreed on by every rank.

    Attributes:
        shards: the reduced fp32 shard of each exchanged bucket, keyed by ``id(bucket)``.
        grad_counts: per bucket (in the optimizer's order), per parameter: on how many ranks it had a gradient.
        nonfinite: whether some rank had a NaN/Inf gradient (then ``shards`` is unusable), or a bucket exchanged
            again uncompressed still summed to one.
        bad_names: this rank's offending parameters (for the error message).
        redone: how many buckets' quantised exchanges gave a non-finite or overflowing value from finite gradients
            and were exchanged again uncompressed (the divergence guard).
    """

    shards: dict[int, Tensor]
    grad_counts: list[list[float]]
    nonfinite: bool
    bad_names: list[str]
    redone: int = 0


class _GradJob:
    """One bucket's gradient exchange in flight: its result, its checks, and what it was launched with."""

    def __init__(self, bucket: FlatBucket, exchange: GradientExchange | AllReduceExchange) -> None:
        self.bucket = bucket
        self.exchange = exchange
        self.future: Any = None
        self.finite = True  # the gradients going in
        self.overflow: list[str] = []  # parameters whose quantisation scale is non-finite or too large
        self.result_finite = True  # the quantised exchange's result
        # the gradient tensors and their version counters when the bucket was copied
        self.launched = [(p.grad, p.grad._version) if p.grad is not None else None for p in bucket.params]

    @property
    def needs_redo(self) -> bool:
        """Whether finite gradients gave a non-finite scale, an overflow or a non-finite sum: exchange them again
        uncompressed."""
        return self.finite and (bool(self.overflow) or not self.result_finite)

    def dirty(self) -> bool:
        """Whether a gradient of the bucket was replaced or edited in place after the bucket was launched."""
        for p, seen in zip(self.bucket.params, self.launched, strict=True):
            if seen is None:
                if p.grad is not None:
                    return True
            elif p.grad is not seen[0] or p.grad._version != seen[1]:
                return True
        return False


def launch_order(buckets: list[list[Tensor]], first_use: dict[int, int]) -> list[int]:
    """The order in which backward completes the buckets' gradients, predicted from the module's parameter order.

    A parameter's gradient is complete once backward has gone back past its first use in forward, and modules
    usually register their parameters in the order forward uses them. So a bucket completes when backward reaches
    its earliest-registered parameter: the bucket whose earliest parameter comes last completes first. Buckets are
    cut per param group, so a group that spans the whole model (e.g. the biases and norms of a weight-decay split)
    completes only at the end of backward; queueing it first, as the reverse of the optimizer's order would, holds
    back every exchange until backward is over. The order is the same on every rank (collectives must match).

    Args:
        buckets: each bucket's parameters, in the optimizer's bucket order.
        first_use: ``id(param) -> position`` in ``module.parameters()``; a parameter not found counts as first
            (it may complete last).

    Returns:
        Bucket indices, first to complete first; ties keep the reverse of the optimizer's order.
    """

    def earliest(i: int) -> int:
        return min((first_use.get(id(p), -1) for p in buckets[i]), default=-1)

    return sorted(range(len(buckets)), key=lambda i: (earliest(i), i), reverse=True)


class GradientOverlap:
    """Launches each bucket's gradient reduce-scatter as soon as backward has produced its gradients.

    :meth:`start` arms a post-accumulate-grad hook on every trainable parameter (threaded pipeline only); the hook
    launches, in the order backward completes them (:func:`launch_order`), every bucket whose gradients are all
    complete. :meth:`finish` launches the buckets still waiting (unused parameters, manual optimization,
    ``overlap=False``), then one small all-reduce agrees on NaN/overflow, on buckets whose gradients changed after
    they were launched (exchanged again on every rank) and on which parameters have a gradient on any rank.

    Attributes:
        buckets_launched_in_backward: how many buckets left for the exchange while backward was still running.
    """

    def __init__(self) -> None:
        self.buckets_launched_in_backward = 0
        self._ctx: ExchangeContext | None = None
        self._hooks: dict[int, Any] = {}
        # the buckets of the optimizer being stepped, in launch order (None: not collecting), the parameters each
        # one still waits for, the position of each parameter's bucket, and the jobs launched so far
        self._order: list[FlatBucket] | None = None
        self._pending: list[set[int]] = []
        self._position: dict[int, int] = {}
        self._jobs: list[_GradJob | None] = []
        self._next_launch = 0
        # each parameter's place in the module's parameter order; each bucket's index in its optimizer
        self._first_use: dict[int, int] = {}
        self._key: dict[int, int] = {}

    def setup(self, ctx: ExchangeContext) -> None:
        """Use ``ctx`` for the exchanges of this ``fit``."""
        self._ctx = ctx

    def teardown(self) -> None:
        """Remove the hooks and forget the context."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks = {}
        self._ctx = None

    def index(self, module: Module) -> None:
        """Remember the module's parameter order, from which :meth:`start` predicts when each bucket completes."""
        self._first_use = {id(p): i for i, p in enumerate(module.parameters())}

    def start(self, buckets: list[FlatBucket]) -> None:
        """Arm the post-accumulate-grad hooks for this optimizer's buckets (launched in :func:`launch_order`)."""
        assert self._ctx is not None
        self._key = {id(b): i for i, b in enumerate(buckets)}
        order = [buckets[i] for i in launch_order([b.params for b in buckets], self._first_use)]
        self._jobs = [None] * len(order)
        self._next_launch = 0
        self._pending = [{id(p) for p in b.params if p.requires_grad} for b in order]
        self._position = {id(p): pos for pos, b in enumerate(order) for p in b.params}
        self._order = order
        if not self._ctx.pipeline.threaded:
            return
        for b in order:
            for p in b.params:
                if p.requires_grad and id(p) not in self._hooks:
                    self._hooks[id(p)] = p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, param: Tensor) -> None:
        """Post-accumulate-grad hook: launch every bucket, in order, whose gradients are all complete."""
        order = self._order
        if order is None:
            return  # a backward outside the final micro-batch's closure (gradient accumulation): no exchange
        pos = self._position.get(id(param))
        if pos is None:
            return
        self._pending[pos].discard(id(param))
        while self._next_launch < len(order) and not self._pending[self._next_launch]:
            self._launch(order, self._next_launch)
            self._next_launch += 1
            self.buckets_launched_in_backward += 1

    def _launch(self, order: list[FlatBucket], pos: int, uncompressed: bool = False) -> None:
        """Copy bucket ``pos``'s gradients (divided by W) and queue its exchange on the pipeline (in fp32 with
        ``uncompressed``, whatever the active format)."""
        ctx = self._ctx
        assert ctx is not None
        bucket = order[pos]
        if not any(p.requires_grad for p in bucket.params):
            self._jobs[pos] = None  # frozen bucket: nothing to exchange (the same on every rank)
            return
        cfg = ctx.config
        fmt = GradientFormat(None, None, None) if uncompressed else ctx.formats.gradient
        flat = bucket.gather_grads(ctx.world_size)
        key = self._key[id(bucket)]  # the bucket's index in the optimizer, whatever the launch order
        exchange: GradientExchange | AllReduceExchange
        if ctx.formats.replicated:
            exchange = AllReduceExchange(flat, ctx.topology.world_group, ctx.stats)
        else:
            codec = Codec(ctx.ops, cfg.rounding, ctx.rng.child(key), ctx.stats)
            exchange = GradientExchange(flat, ctx.topology, fmt, cfg.gradient_group_size, codec)
        job = _GradJob(bucket, exchange)
        quantized = fmt.quantized and ctx.world_size > 1 and not ctx.formats.replicated
        limit = max_safe_scale(first_level_bits(ctx.topology, fmt), ctx.world_size, fmt.hadamard) if quantized else 0.0

        def first() -> None:
            job.finite = all_finite(flat)
            encoded = exchange.encode()
            if encoded is not None and job.finite:
                job.overflow = self._overflow_names(bucket, encoded[1], limit, fmt)
            exchange.first()

        def second() -> Tensor:
            result = exchange.second()
            if quantized and job.finite and not job.overflow:
                job.result_finite = all_finite(result)  # a kernel or a sum gone wrong shows here
            return result

        job.future = ctx.pipeline.submit(first, second)
        self._jobs[pos] = job

    def _overflow_names(self, bucket: FlatBucket, scales: Tensor, limit: float, fmt: GradientFormat) -> list[str]:
        bad = ~(torch.isfinite(scales) & (scales <= limit))
        if not bool(bad.any()):
            return []
        assert self._ctx is not None
        g = self._ctx.config.gradient_group_size
        qmax = quantization.qmax(first_level_bits(self._ctx.topology, fmt))
        what = "after the Hadamard transform" if fmt.hadamard else "as quantised"
        out: list[str] = []
        for idx in bad.nonzero().flatten().tolist():
            for name in bucket.names_in(idx * g, (idx + 1) * g):
                label = f"{name} (|value| up to {float(scales[idx]) * qmax:.3g} {what}, too large to quantise)"
                if label.split(" (")[0] not in [o.split(" (")[0] for o in out]:
                    out.append(label)
        return out

    def abandon(self) -> None:
        """Wait for the exchanges in flight and forget them (the closure failed)."""
        self._order = None
        for job in self._jobs:
            if job is not None and job.future is not None:
                try:
                    job.future.result()
                except Exception:  # the closure's own error is what the user must see
                    pass
        self._jobs = []

    def finish(self, buckets: list[FlatBucket]) -> ReducedGradients:
        """Launch the buckets still waiting, agree across ranks and return the reduced shards (a collective)."""
        order = self._order
        assert order is not None and self._ctx is not None
        self._order = None  # no more launches from hooks
        n = len(order)
        try:
            for pos in range(self._next_launch, n):
                self._launch(order, pos)
            self._wait()
            agreed = self._agree(buckets)
            nonfinite = agreed[0].item() > 0
            redo = [pos for pos, flag in enumerate(agreed[1 : 1 + n].tolist()) if flag > 0]
            dirty = [pos for pos, flag in enumerate(agreed[1 + n : 1 + 2 * n].tolist()) if flag > 0 and pos not in redo]
            if not nonfinite and (redo or dirty):
                nonfinite = self._exchange_again(order, redo, dirty)
            shards = {id(job.bucket): job.future.result() for job in self._jobs if job is not None}
            bad_names = self._bad_names()
        finally:
            self._jobs = []
        counts = agreed[1 + 2 * n :].split([len(b.params) for b in buckets])
        return ReducedGradients(shards, [c.tolist() for c in counts], nonfinite, bad_names, len(redo))

    def _wait(self) -> None:
        """Wait for every exchange in flight (re-raises what a worker thread raised)."""
        for job in self._jobs:
            if job is not None:
                job.future.result()

    def _agree(self, buckets: list[FlatBucket]) -> Tensor:
        """One all-reduce of: the number of buckets with a NaN/Inf gradient, a flag per bucket whose quantised
        exchange must be redone, a flag per bucket edited after its launch, the grad flags."""
        assert self._ctx is not None
        redo = [float(job is not None and job.needs_redo) for job in self._jobs]
        dirty = [float(job is not None and job.dirty()) for job in self._jobs]
        has_grad = torch.cat([b.has_grad_flags() for b in buckets])
        local = torch.tensor([self._n_nonfinite(), *redo, *dirty, *has_grad.tolist()])
        return all_reduce_sum(local.to(self._ctx.device)).cpu()

    def _exchange_again(self, order: list[FlatBucket], redo: list[int], dirty: list[int]) -> bool:
        """Exchange buckets again everywhere: those whose quantised exchange went wrong in fp32, those whose gradients
        were edited after they left in the same format; then agree whether anything is still non-finite."""
        assert self._ctx is not None
        for pos in redo:
            self._launch(order, pos, uncompressed=True)
        for pos in dirty:
            self._launch(order, pos)
        self._wait()
        again = [self._jobs[pos] for pos in (*redo, *dirty)]
        bad = sum(job is not None and (not job.finite or job.needs_redo) for job in again)
        redone = [job for job in (self._jobs[pos] for pos in redo) if job is not None]
        unusable = sum(not all_finite(job.future.result()) for job in redone)  # fp32 sums beyond fp32
        return float(all_reduce_sum(torch.tensor([float(bad + unusable)]).to(self._ctx.device)).cpu()[0]) > 0

    def _n_nonfinite(self) -> float:
        return float(sum(job is not None and not job.finite for job in self._jobs))

    def _bad_names(self) -> list[str]:
        jobs = sorted((job for job in self._jobs if job is not None), key=lambda job: self._key[id(job.bucket)])
        names = [name for job in jobs if not job.finite for name in job.bucket.non_finite_names()]
        if not names and any(not job.finite for job in jobs):
            names = ["<non-finite value in a quantisation group>"]
        return names


class WeightOverlap:
    """The weight all-gathers after each optimizer step, and the forward pre-hooks that wait for them per module.

    :meth:`launch` queues every bucket's qWD all-gather in forward order (the first layers' bucket first), so bucket
    ``k + 1`` is quantised and sent while ``k`` is decoded. With ``defer`` (``overlap_param_gather``) the caller
    returns at once: each hooked module's forward waits for the bucket(s) holding its own parameters, buckets of
    parameters read outside their module's forward ("eager", found in the first step) are waited for before every
    ``training_step``, and everything else calls :meth:`wait_all`.

    Attributes:
        defer: whether the gathers run past the optimizer step (set at set-up).
        eager: buckets used outside any hooked forward, keyed by ``id(bucket)``.
        pending_at_forward: summed over steps, how many buckets' all-gathers were still running when the first
            forward after the optimizer step started.
        forward_waits: how many times a module's forward had to wait for its bucket's all-gather.
        redone: how many all-gathers were sent again uncompressed because a rank's codes had a non-finite scale.
    """

    def __init__(self) -> None:
        self.defer = False
        self.redone = 0
        self._exchanges: list[WeightExchange] = []
        self.eager: dict[int, FlatBucket] = {}
        self.pending_at_forward = 0
        self.forward_waits = 0
        self._ctx: ExchangeContext | None = None
        # in flight: a future per bucket, their accounting, the drift all-reduce
        self._jobs: dict[int, Any] = {}
        self._stats: list[CommStats] = []
        self._drift_job: Any = None
        # each parameter's bucket and forward position, the forward pre-hooks, the parameters whose module's
        # pre-hook ran since the last gather ("covered"), and whether a forward ran since then
        self._bucket_of: dict[int, FlatBucket] = {}
        self._position: dict[int, int] = {}
        self._hooks: list[Any] = []
        self._hooked: set[int] = set()
        self._covered: set[int] = set()
        self._forward_started = True

    def setup(self, ctx: ExchangeContext, defer: bool) -> None:
        """Use ``ctx`` for the gathers of this ``fit``; ``defer``: let them run past the optimizer step."""
        self._ctx, self.defer, self.eager = ctx, defer, {}

    def teardown(self) -> None:
        """Remove the forward pre-hooks and forget the context (after :meth:`wait_all`)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._hooked = [], set()
        self._ctx = None

    def index(self, module: Module, buckets: list[FlatBucket]) -> None:
        """Map parameters to their buckets and forward positions; hook every module that holds a bucketed one."""
        self._bucket_of = {id(p): b for b in buckets for p in b.params}
        self._position = {id(p): i for i, p in enumerate(module.parameters())}
        if not self.defer:
            return
        for sub in module.modules():
            if id(sub) in self._hooked:
                continue
            if any(id(p) in self._bucket_of for p in sub.parameters(recurse=False)):
                self._hooks.append(sub.register_forward_pre_hook(self.before_forward))
                self._hooked.add(id(sub))

    def launch(self, buckets: list[FlatBucket]) -> None:
        """Queue the all-gather of every bucket, in forward order (the caller waits unless :attr:`defer`)."""
        ctx = self._ctx
        assert ctx is not None
        cfg, fmt = ctx.config, ctx.formats.weight
        # uncompressed fp32 weights arrive exactly: the drift is 0 without computing it (no norms, no all-reduce)
        drift = cfg.track_drift and (fmt.quantized or any(b.dtype != torch.float32 for b in buckets))
        futures = []
        self._covered = set()
        self._forward_started = False
        for index, bucket in sorted(enumerate(buckets), key=lambda item: self._forward_position(item[1])):
            stats = CommStats()  # merged into the strategy's stats by wait_all, on the training thread
            codec = Codec(ctx.ops, cfg.rounding, ctx.rng.child(len(buckets) + index), stats)
            exchange = WeightExchange(
                bucket.model_flat, bucket.master.detach(), ctx.topology, fmt, codec, ctx.topology.world_group
            )
            future = ctx.pipeline.submit(_no_grad(exchange.send), _no_grad(self._finish(bucket, exchange, drift)))
            self._exchanges.append(exchange)
            self._jobs[id(bucket)] = future
            self._stats.append(stats)
            futures.append(future)
        if drift:
            self._drift_job = ctx.pipeline.submit(lambda: None, self._reduce_drift(futures))
        elif cfg.track_drift:
            self._drift_job = Done(0.0)

    def _finish(self, bucket: FlatBucket, exchange: WeightExchange, drift: bool) -> Callable[[], Tensor]:
        assert self._ctx is not None
        ctx = self._ctx

        def run() -> Tensor:
            exchange.apply()
            bucket.store_to_params()
            sq = torch.zeros(2, dtype=torch.float64, device=ctx.device)
            if drift:
                mine = bucket.model_flat[bucket.lo : bucket.lo + bucket.shard_size].float()
                # vector_norm accumulates in float64 without making a float64 copy
                sq[0] = torch.linalg.vector_norm(bucket.master.detach() - mine, dtype=torch.float64).square()
                sq[1] = torch.linalg.vector_norm(bucket.master.detach(), dtype=torch.float64).square()
            return sq

        return run

    def _reduce_drift(self, futures: list[Any]) -> Callable[[], float]:
        """The all-reduce of the drift terms, on the second thread after every bucket is decoded (private group)."""
        assert self._ctx is not None
        ctx = self._ctx

        def run() -> float:
            sq = torch.zeros(2, dtype=torch.float64, device=ctx.device)
            for future in futures:
                sq += future.result()
            if ctx.topology.world_group is not None:
                dist.all_reduce(sq, group=ctx.topology.world_group)
            return float(sq[0].sqrt() / sq[1].sqrt().clamp_min(1e-30))

        return run

    def wait_all(self) -> float | None:
        """Wait for every gather in flight (and the drift all-reduce); re-raise the first error.

        Returns:
            The drift ``||w_master - w_model|| / ||w_master||`` when a drift all-reduce was in flight, else ``None``.
        """
        jobs, self._jobs = self._jobs, {}
        drift, self._drift_job = self._drift_job, None
        error: BaseException | None = None
        for future in [*jobs.values(), *([drift] if drift is not None else [])]:
            try:
                future.result()
            except BaseException as err:  # wait for all, then raise the first
                error = error or err
        exchanges, self._exchanges = self._exchanges, []
        self.redone += sum(exchange.redone for exchange in exchanges)
        stats, self._stats = self._stats, []
        for one in stats:
            assert self._ctx is not None
            self._ctx.stats.merge(one)
        if error is not None:
            raise error
        return None if drift is None else float(drift.result())

    def _forward_position(self, bucket: FlatBucket) -> int:
        return min((self._position.get(id(p), len(self._position)) for p in bucket.params), default=0)

    def before_forward(self, module: Module, args: Any) -> None:
        """Forward pre-hook: wait for the bucket(s) holding this module's own parameters (not its children's)."""
        params = [p for p in module._parameters.values() if p is not None]
        self._covered.update(id(p) for p in params)
        if not self._jobs:
            return
        if not self._forward_started:
            self._forward_started = True
            self.pending_at_forward += sum(not f.done() for f in self._jobs.values())
        for p in params:
            bucket = self._bucket_of.get(id(p))
            if bucket is not None:
                self.wait_bucket(bucket)

    def wait_bucket(self, bucket: FlatBucket) -> None:
        """Wait for ``bucket``'s all-gather, if it is in flight."""
        future = self._jobs.pop(id(bucket), None)
        if future is None:
            return
        if not future.done():
            self.forward_waits += 1
        future.result()

    def wait_eager(self) -> None:
        """Wait for the buckets of parameters read outside their module's forward (before a ``training_step``)."""
        for bucket in self.eager.values():
            self.wait_bucket(bucket)

    def start_training(self) -> None:
        """Forget which parameters the forwards so far covered (the sanity check's do not count)."""
        self._covered = set()

    def note_uncovered(self, buckets: list[FlatBucket]) -> list[str]:
        """Mark as "eager" the buckets of parameters that got a gradient without their module's forward running.

        Such a parameter was read outside a hooked forward (e.g. ``self.weight`` used directly in
        ``training_step``, or a module's parameter read by its parent): from now on its bucket is waited for at the
        start of every ``training_step``. Found in the first step, where nothing is in flight yet.

        Returns:
            The names of the parameters newly found.
        """
        if not self.defer:
            return []
        new = []
        for bucket in buckets:
            if id(bucket) in self.eager:
                continue
            names = [
                n
                for p, n in zip(bucket.params, bucket.names, strict=True)
                if p.grad is not None and id(p) not in self._covered
            ]
            if names:
                self.eager[id(bucket)] = bucket
                new.extend(names)
        return new


def all_finite(tensor: Tensor) -> bool:
    """Whether every value is finite, in one pass: min and max are NaN when any value is NaN, and +-inf shows in
    them (``torch.isfinite(t).all()`` makes three passes and a bool tensor)."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def _no_grad(fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with torch.no_grad():
            return fn()

    return run
