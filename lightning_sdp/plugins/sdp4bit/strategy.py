"""``SDP4BitStrategy``: sharded data parallelism with 4-bit weight and gradient communication.

Jia et al., "SDP4Bit: Toward 4-bit Communication Quantization in Sharded Data Parallelism for LLM Training",
NeurIPS 2024 (arXiv 2410.15526).

This module holds the Lightning side: options, set-up, the optimizer step, clipping, logging and checkpoints. The
collectives are in ``exchange``, their overlap with backward and forward in ``overlap``, the flat buckets and the
optimizer sharding in ``sharding``.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sdp._registry import register_class_aliases
from lightning_sdp.plugins.sdp4bit.auto import AutoCompression, Candidate, Decision, build_auto
from lightning_sdp.plugins.sdp4bit.bucket_size import bucket_numel
from lightning_sdp.plugins.sdp4bit.config import SDP4BitConfig
from lightning_sdp.plugins.sdp4bit.exchange import (
    CommStats,
    RoundingRNG,
    TimedOps,
    TorchOps,
    record_allreduce,
    select_ops,
)
from lightning_sdp.plugins.sdp4bit.formats import ActiveFormats, GradientCompression, WeightCompression
from lightning_sdp.plugins.sdp4bit.overlap import ExchangeContext, GradientOverlap, Pipeline, WeightOverlap
from lightning_sdp.plugins.sdp4bit.precision import ClipKind, ShardedClippingPrecision
from lightning_sdp.plugins.sdp4bit.replication import (
    extra_bytes,
    finish_replicated_step,
    reduced_nonfinite_names,
    reducer_wrapper,
    replica_fits,
    replicate,
    shard,
    take_reduced_gradients,
)
from lightning_sdp.plugins.sdp4bit.sharding import (
    AbsentSnapshot,
    FlatBucket,
    ShardLayout,
    check_optimizer,
    check_trainable,
    clip_shard_grads,
    consolidate_state,
    expose_gradients,
    load_consolidated_state,
    padding_warning,
    put_master_weights,
    restore_absent,
    shard_grad_norms,
    shard_new_groups,
    shard_optimizer,
    single_process_state,
    snapshot_absent,
    use_shards,
)
from lightning_sdp.plugins.sdp4bit.topology import Topology, build_topology
from lightning_sdp.utilities import rank_zero_say, unwrap_optimizer

log = logging.getLogger(__name__)

_FORK_SERVER_PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "lightning_sdp.plugins.sdp4bit")
"""What the fork server of ``start_method="forkserver"`` imports before it forks the ranks."""

_SUPPORTED_PRECISION = ("32-true", "32", "bf16-mixed", "bf16-true")


class SDP4BitStrategy(DDPStrategy):
    """Sharded data parallelism (ZeRO-1/2, Megatron distributed-optimizer style) with SDP4Bit's quantised collectives.

    Every rank keeps the full model; each optimizer param group is flattened, zero-padded and cut into one fp32
    master shard per rank, which is all the user's optimizer sees (so AdamW, SGD, LR schedulers, clipping and
    gradient accumulation work unchanged). Per optimizer step: one gradient reduce-scatter, compressed with
    two-level quantisation and Hadamard smoothing (TLq-HS: 8-bit all-to-all inside a node, 4-bit all-to-all
    between nodes), the optimizer step on the shard, and one weight all-gather of 4-bit quantised weight
    differences (qWD) against the weights every rank already holds. The model is not wrapped in
    ``DistributedDataParallel`` (the initial weights are broadcast from rank 0), except while ``"auto"`` runs DDP's
    exchange with automatic optimization: then torch's DDP reducer all-reduces the gradients during backward.

    With one process (world size 1 at ``fit``) nothing is communicated: the strategy warns once and steps like plain
    training, leaving the model, the user's optimizer (still checked as above) and the precision plugin as they are.
    No ``sdp4bit/*`` metric is logged, :attr:`comm_stats` stays empty and ``nonfinite_gradients`` is not applied.
    Checkpoints keep the multi-process format (the optimizer's own state plus the ``"sdp4bit"`` section), so a
    checkpoint saved by one process resumes under several and vice versa.

    Args:
        weight_compression: ``"auto"`` (default: chosen while training, see below), ``"qwd"`` (quantised weight
            differences), ``"qw"`` (quantise the weights themselves, as ZeRO++/QSDP do) or ``"none"`` (all-gather
            in the model dtype).
        gradient_compression: ``"auto"`` (default), ``"tlq_hs"`` (the paper's), ``"tlq"`` (two levels, no
            Hadamard), ``"ulq"`` (4 bits at every level, no Hadamard) or ``"none"`` (fp32 hierarchical
            reduce-scatter). ``"auto"`` times each level's link at set-up, then tries qWD or uncompressed weights
            with TLq-HS (bits as set, or the intra bits at both levels) or fp32 gradients for a few steps each (not
            those whose wire time exceeds the first one's step), keeps the fastest and logs it (docs/sdp4bit.md).
        weight_bits: bits of the weight codes (4 or 8; default 4).
        weight_group_size: values per fp32 scale for weights (default 2048).
        gradient_intra_bits: bits inside a node (default 8).
        gradient_inter_bits: bits between nodes (default 4).
        gradient_group_size: values per fp32 scale for gradients (default 128).
        hadamard_size: Hadamard block for ``"tlq_hs"`` (power of two, default 32).
        rounding: ``"stochastic"`` (default, unbiased) or ``"nearest"``.
        intra_node_size: processes per node; default: Lightning's processes per node (``devices``), so
            ``num_nodes`` real nodes give the inter-node level. Set it (e.g. 2 with ``devices=4``) to emulate several
            nodes on one host.
        nonfinite_gradients: ``"raise"`` (default; names the parameters) or ``"skip"`` (skip the optimizer step on
            all ranks with a warning; counted in ``sdp4bit/skipped_steps``) when a gradient holds NaN/Inf. Not
            applied with one process.
        seed: seed of the stochastic rounding (reseeded from ``(seed, step, rank)`` every step).
        kernel_backend: ``"auto"`` (Triton on CUDA when installed, numba on CPU when installed, else torch),
            ``"torch"``, ``"triton"`` or ``"numba"``.
        track_drift: compute ``sdp4bit/weight_drift`` = ``||w_master - w_model|| / ||w_master||`` every step (one
            small all-reduce).
        allow_any_optimizer: accept optimizers that are not (subclasses of) the element-wise ``torch.optim`` ones;
            you assert that their update is element-wise (e.g. Lion). LBFGS, SparseAdam and Adafactor stay refused.
        bucket_size_mb: each param group is cut into buckets of at most this many MiB of fp32 gradients (default
            4; ``None``: one bucket per param group; ``"auto"``: as many buckets as the measured link and bucket cost
            want, see :mod:`~lightning_sdp.plugins.sdp4bit.bucket_size`). Every bucket is sharded and exchanged on
            its own, so a bucket's exchange can start while backward still computes the gradients of earlier layers.
        overlap: exchange each bucket's gradients on background threads as soon as backward has produced them
            (post-accumulate-grad hooks, as DDP's reducer and Megatron's ``overlap_grad_reduce``), pipeline the
            intra- and inter-node all-to-alls of consecutive buckets, and pipeline the weight all-gather after the
            step (default ``True``). ``False`` runs the same per-bucket exchanges one after the other once backward
            is done; both give bit-identical results.
        overlap_param_gather: with ``overlap=True`` and automatic optimization, return from the optimizer step
            while the weight all-gather is still running and let each module's forward wait only for the bucket(s)
            holding its own parameters (forward pre-hooks, Megatron's ``overlap_param_gather``); the buckets are
            gathered in forward order, so the first layers' bucket arrives first (default ``False``: on one host it
            did not measure faster than waiting in the step). Everything else that reads the weights (validation,
            checkpoints, ``on_train_end``, the next optimizer step) waits for all of them first; so can your own
            code, with :meth:`wait_for_weights`. Ignored with ``overlap=False`` or manual optimization.
            Bit-identical results.
        log_metrics: log the ``sdp4bit/*`` scalars (bits per element, bytes per step, skipped steps, codec time,
            weight drift) with ``LightningModule.log``, so loggers get them every ``log_every_n_steps`` as any
            ``self.log(on_step=True)`` value (default ``True``). ``False`` logs none; :attr:`comm_stats` still
            counts. With one process none are logged either way (nothing is communicated).
        auto_trial_steps: with ``"auto"``, optimizer steps timed per candidate (default 3, after those to settle).
        auto_recheck_every_n_steps: with ``"auto"``, optimizer steps between a choice and the next round of
            trials (default 1000; 0: choose once per ``fit``).
        optimizer_state: ``"auto"`` (default): with ``"auto"`` compression DDP's exchange is a candidate too (an
            fp32 all-reduce of the gradients and a replicated optimizer step, no weight all-gather), kept when it is
            the fastest and the replicated optimizer state fits in free memory; the decision logs the memory given
            up. ``"shard"``: the optimizer state is always sharded.
        gradients_in_hooks: when the LightningModule or a callback overrides ``on_before_optimizer_step``, put the
            reduced gradients in the parameters' ``.grad`` before it, as under DDP, so Lightning's ``grad_norm`` and
            in-place edits work there (default ``True``: one fp32 all-gather of the gradients per step, said once).
            ``False``: ``.grad`` stays ``None`` there (warned once); use
            :func:`~lightning_sdp.plugins.sdp4bit.grad_norm`.
        accelerator: see :class:`~lightning.pytorch.strategies.DDPStrategy`.
        parallel_devices: see ``DDPStrategy``.
        cluster_environment: see ``DDPStrategy``.
        checkpoint_io: see ``DDPStrategy``.
        precision_plugin: see ``DDPStrategy``.
        process_group_backend: ``"gloo"`` (CPU default) or ``"nccl"`` (CUDA default).
        timeout: how long a collective waits for a peer before it fails, on the default process group and on the
            strategy's own (intra-node, inter-node, weight all-gather) groups.
        start_method: ``"popen"`` (default: each rank runs the script again), ``"spawn"``, ``"fork"`` or
            ``"forkserver"`` (a server imports torch, Lightning and the strategy once; each rank forks from it).

    Raises:
        TypeError: an option of the wrong type (see :class:`SDP4BitConfig`).
        ValueError: an option out of range (see :class:`SDP4BitConfig`).

    Attributes:
        config: the SDP4Bit options above, checked (an :class:`SDP4BitConfig`).
        comm_stats: bytes and values sent per collective (last step and whole run), and the quantise/dequantise
            time on the CPU (``codec_seconds``). With ``overlap_param_gather`` a step's weight all-gather is
            counted in the step that waits for it (the next one). Empty with one process.
        topology: the intra/inter-node process groups (set at ``fit``; the trivial one with one process).
        skipped_steps: optimizer steps skipped for a non-finite gradient (``nonfinite_gradients="skip"``).
        weight_drift: the last measured ``||w_master - w_model|| / ||w_master||`` (``track_drift``).
        auto_decisions: the choices ``"auto"`` made in this ``fit`` (formats, step times, links).
    """

    strategy_name = "sdp4bit"

    def __init__(
        self,
        weight_compression: WeightCompression = "auto",
        gradient_compression: GradientCompression = "auto",
        weight_bits: int = 4,
        weight_group_size: int = 2048,
        gradient_intra_bits: int = 8,
        gradient_inter_bits: int = 4,
        gradient_group_size: int = 128,
        hadamard_size: int = 32,
        rounding: Literal["stochastic", "nearest"] = "stochastic",
        intra_node_size: int | None = None,
        nonfinite_gradients: Literal["raise", "skip"] = "raise",
        seed: int = 0,
        kernel_backend: Literal["auto", "torch", "triton", "numba"] = "auto",
        track_drift: bool = True,
        allow_any_optimizer: bool = False,
        bucket_size_mb: float | Literal["auto"] | None = 4.0,
        overlap: bool = True,
        overlap_param_gather: bool = False,
        log_metrics: bool = True,
        auto_trial_steps: int = 3,
        auto_recheck_every_n_steps: int = 1000,
        optimizer_state: Literal["auto", "shard"] = "auto",
        gradients_in_hooks: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.config = SDP4BitConfig(
            weight_compression=weight_compression,
            gradient_compression=gradient_compression,
            weight_bits=weight_bits,
            weight_group_size=weight_group_size,
            gradient_intra_bits=gradient_intra_bits,
            gradient_inter_bits=gradient_inter_bits,
            gradient_group_size=gradient_group_size,
            hadamard_size=hadamard_size,
            rounding=rounding,
            intra_node_size=intra_node_size,
            nonfinite_gradients=nonfinite_gradients,
            seed=seed,
            kernel_backend=kernel_backend,
            track_drift=track_drift,
            allow_any_optimizer=allow_any_optimizer,
            bucket_size_mb=bucket_size_mb,
            overlap=overlap,
            overlap_param_gather=overlap_param_gather,
            log_metrics=log_metrics,
            auto_trial_steps=auto_trial_steps,
            auto_recheck_every_n_steps=auto_recheck_every_n_steps,
            optimizer_state=optimizer_state,
            gradients_in_hooks=gradients_in_hooks,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.comm_stats = CommStats()
        self.topology: Topology | None = None
        self.skipped_steps = 0
        self._redone_gradients = 0  # steps whose quantised gradient exchange was redone uncompressed
        self.weight_drift = float("nan")
        self._step = 0
        self._buckets: dict[int, list[FlatBucket]] = {}  # per optimizer (keyed by id of the raw optimizer)
        self._ops: TorchOps = TorchOps()
        self._rng: RoundingRNG | None = None
        self._pipeline = Pipeline(threaded=False)
        self._formats = ActiveFormats(self.config.weight_format, self.config.gradient_format)
        self._auto: AutoCompression | None = None
        self._gradients = GradientOverlap()
        self._weights = WeightOverlap()
        # Hadamard blocks never straddle two parameters (a zero gradient stays exactly zero). A measurement knob, not
        # an option: benchmarks/sdp4bit_zero_blocks.py turns it off before `fit` to show what alignment buys.
        self._align_hadamard_blocks = True
        # Per optimizer step: whether it is skipped, whether the shard gradients exist yet, clipping requested before
        # that (manual optimization), the parameters without a gradient on any rank and what to restore there.
        self._skip_current = False
        self._exchanged = False
        self._pending_clip: dict[int, tuple[ClipKind, float]] = {}
        self._absent: dict[int, list[int]] = {}
        self._restore: list[AbsentSnapshot] = []
        # World size 1 at `fit`: nothing is sharded and the steps take Lightning's plain path (see the docstring).
        self._single_process = False
        self._bucket_numel: int | None = None  # values per bucket of this fit (``bucket_size_mb`` may be "auto")
        self._validation_paused = False  # validation's time is left out of auto's trials
        self._gradients_in_hooks = False  # this fit all-gathers the reduced gradients for on_before_optimizer_step
        # While torch's DDP reducer runs the replicated exchange: which parameters required a gradient when it was
        # built (it covers only those). Whether every trainable parameter had a gradient on every rank in the last
        # step of the strategy's own exchange (None: no such step yet), which lets the reducer skip the search for
        # unused parameters.
        self._reducer: DistributedDataParallel | None = None
        self._reducer_allowed = False  # automatic optimization, and no hook edits the gradients after backward
        self._reducer_signature: tuple[bool, ...] | None = None
        self._every_param_reduced: bool | None = None

    # ------------------------------------------------------------------------------------------------ set-up

    @property
    def alignment(self) -> int:
        """Every shard is a multiple of this many values (groups, Hadamard blocks, int4 byte pairs)."""
        return self.config.alignment

    @property
    def _param_alignment(self) -> int:
        """Every parameter starts at a multiple of this in the flat buffer (the Hadamard block, when one is used)."""
        hadamard = max(g.hadamard or 0 for g in self.config.gradient_candidates)
        if hadamard and self.world_size > 1 and self._align_hadamard_blocks:
            return hadamard
        return 1

    def _layout(self) -> ShardLayout:
        """How this ``fit`` cuts the param groups into buckets and which shard this rank owns."""
        return ShardLayout(
            world_size=self.world_size,
            rank=self.global_rank,
            alignment=self.alignment,
            param_alignment=self._param_alignment,
            intra_size=getattr(self.topology, "intra_size", None),
            bucket_numel=self._bucket_numel,
        )

    def _intra_size(self) -> int:
        world = self.world_size
        if self.config.intra_node_size is not None:
            return self.config.intra_node_size
        if self.num_processes * self.num_nodes == world:
            return self.num_processes
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local and local.isdigit() and world % int(local) == 0:
            return int(local)
        return world

    @override
    def _configure_launcher(self) -> None:
        if self._start_method == "forkserver":
            # The server imports these once and every rank of every launch forks from it; spawn imports them again
            # in each rank (seconds of CPU per rank). No effect once a fork server of this process has started.
            multiprocessing.set_forkserver_preload(["__main__", *_FORK_SERVER_PRELOAD])
        super()._configure_launcher()

    @override
    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel`` wrapper: broadcast rank 0's parameters and buffers instead."""
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            assert self.model is not None
            _sync_module_states(self.model)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if precision not in _SUPPORTED_PRECISION:
            raise ValueError(
                f"SDP4BitStrategy supports precision {_SUPPORTED_PRECISION[:1] + _SUPPORTED_PRECISION[2:]}, got "
                f"{precision!r}. fp16 needs loss scaling, which this strategy does not implement; use 'bf16-mixed'."
            )
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._check_trainable()
        self._auto = None
        self._every_param_reduced = None
        self._single_process = self.world_size == 1
        if self._single_process:
            self._setup_single_process()
            return
        self._setup_exchange()
        names, self._buckets = self._param_names(), {}
        self._bucket_numel, chosen, links = bucket_numel(
            self.config, self.topology, self.root_device, [unwrap_optimizer(o) for o in self.optimizers], self.alignment
        )
        if chosen:
            rank_zero_say(chosen)
        for opt in self.optimizers:
            raw = unwrap_optimizer(opt)
            self._buckets[id(raw)] = shard_optimizer(raw, names, self._layout(), self.config.allow_any_optimizer)
            if warning := padding_warning(self._buckets[id(raw)], self.world_size, self.alignment):
                rank_zero_warn(warning)
        self._index_params()
        self._gradients_in_hooks = self._hooks_read_gradients()
        # DDP's reducer averages during backward, so `on_after_backward` would edit averaged gradients; the strategy's
        # own exchange sends an edited bucket again (the edit counts before the average, as each rank made it)
        automatic = self.lightning_module is not None and self.lightning_module.automatic_optimization
        self._reducer_allowed = automatic and not self._hook_owners("on_after_backward")
        if self.config.auto:
            assert self.topology is not None and self.lightning_module is not None
            itemsize = max(p.element_size() for p in self.lightning_module.parameters())
            shard_sizes = [b.shard_size for b in self._all_buckets()]
            self._auto = build_auto(
                self.config,
                self.topology,
                shard_sizes,
                itemsize,
                self.root_device,
                before_probe=self._wait_all_weights,
                links=links,
                fits=self._replica_fits,
                replicated_bytes=self._reducer_bytes(),
            )
            self._auto_seen_step = -1
        # Global-norm and value clipping on the shards (Lightning clips through the precision plugin).
        if not isinstance(self.precision_plugin, ShardedClippingPrecision):
            self.precision_plugin = ShardedClippingPrecision(self.precision_plugin, self._clip_shards)

    def _hooks_read_gradients(self) -> bool:
        """Whether to all-gather the reduced gradients into ``.grad`` before ``on_before_optimizer_step``: when the
        module or a callback overrides it and ``gradients_in_hooks`` (says which once; warns when it is off)."""
        hook = "on_before_optimizer_step"
        owners = self._hook_owners(hook)
        if not owners:
            return False
        where = f"{hook} of {', '.join(owners)}"
        if self.config.gradients_in_hooks:
            rank_zero_say(
                f"SDP4BitStrategy: the reduced gradients are all-gathered into the parameters' .grad before the {where} "
                "(one fp32 all-gather of the gradients per step). If the hook reads no .grad, or computes norms with "
                "lightning_sdp.plugins.sdp4bit.grad_norm, pass `gradients_in_hooks=False` to save it."
            )
            return True
        rank_zero_warn(
            f"SDP4BitStrategy(gradients_in_hooks=False): the parameters' .grad is None in the {where} (the reduced "
            "gradients live in this rank's shard): Lightning's grad_norm there returns nothing. Use "
            "lightning_sdp.plugins.sdp4bit.grad_norm, or pass `gradients_in_hooks=True`."
        )
        return False

    def _hook_owners(self, hook: str) -> list[str]:
        """The LightningModule's and callbacks' class names that override ``hook``."""
        module = self.lightning_module
        assert module is not None
        owners = [type(module).__name__] if is_overridden(hook, module) else []
        callbacks: list[pl.Callback] = getattr(module.trainer, "callbacks", [])  # set by the Trainer at run time
        return owners + [type(cb).__name__ for cb in callbacks if is_overridden(hook, cb, parent=pl.Callback)]

    def _check_trainable(self) -> None:
        assert self.lightning_module is not None
        check_trainable(self.lightning_module, [unwrap_optimizer(opt) for opt in self.optimizers])

    def _setup_single_process(self) -> None:
        """World size 1: leave the model, the optimizers and the precision plugin as they are (plain training).

        The optimizers are still checked (a checkpoint of this run must resume under several processes), and the
        checkpoints keep the consolidated format (:meth:`optimizer_state`).
        """
        rank_zero_warn(
            "SDP4BitStrategy runs with a single process: nothing is communicated, so nothing is compressed and "
            "the strategy steps like plain training (your optimizer and precision plugin as they are, no "
            "`sdp4bit/*` metrics). Checkpoints stay interchangeable with multi-process runs."
        )
        for opt in self.optimizers:
            check_optimizer(unwrap_optimizer(opt), self.config.allow_any_optimizer)
        self._buckets = {}
        self.topology = Topology.single()

    def _setup_exchange(self) -> None:
        """Process groups, kernels, rounding streams and worker threads of this ``fit``."""
        if self.world_size > 1 and dist.is_initialized():
            self.topology = build_topology(self.global_rank, self.world_size, self._intra_size(), self._timeout)
        else:
            self.topology = Topology.single()
        topo = self.topology
        sizes = (topo.rank, topo.intra_size, topo.inter_size)
        log.info("SDP4Bit topology: rank %d, intra-node size %d, inter-node size %d", *sizes)
        self._ops = self._select_ops()
        if self.root_device.type == "cpu":
            self._ops = TimedOps(self._ops, self.comm_stats)  # sdp4bit/codec_ms: quantise/dequantise time per step
        self._rng = RoundingRNG(self.config.seed, self.global_rank, self.root_device)
        self._pipeline = Pipeline(threaded=self.config.overlap and self.world_size > 1)
        self._formats = ActiveFormats(self.config.weight_format, self.config.gradient_format)
        context = ExchangeContext(
            config=self.config,
            topology=topo,
            world_size=self.world_size,
            device=self.root_device,
            rng=self._rng,
            ops=self._ops,
            stats=self.comm_stats,
            pipeline=self._pipeline,
            formats=self._formats,
        )
        assert self.lightning_module is not None
        automatic = self.lightning_module.automatic_optimization
        self._gradients.setup(context)
        self._weights.setup(context, defer=self._pipeline.threaded and self.config.overlap_param_gather and automatic)

    def _select_ops(self) -> TorchOps:
        cfg = self.config
        return select_ops(cfg.kernel_backend, self.root_device, cfg.weight_group_size, cfg.gradient_group_size)

    def _param_names(self) -> dict[int, str]:
        assert self.lightning_module is not None
        return {id(p): n for n, p in self.lightning_module.named_parameters()}

    def _all_buckets(self) -> list[FlatBucket]:
        return [b for buckets in self._buckets.values() for b in buckets]

    def _index_params(self) -> None:
        if self.lightning_module is not None:
            self._weights.index(self.lightning_module, self._all_buckets())
            self._gradients.index(self.lightning_module)

    def _sync_groups(self, raw: Optimizer, buckets: list[FlatBucket]) -> None:
        """Shard param groups added since set-up (``add_param_group``, e.g. by ``BackboneFinetuning``)."""
        added = shard_new_groups(raw, buckets, self._param_names(), self._layout())
        if added:
            if self._formats.replicated:
                replicate(raw, buckets)  # the new groups' buckets (the others are replicated already)
            self._index_params()

    # ------------------------------------------------------------------------------------------------ step

    def _buckets_of(self, optimizer: Any) -> list[FlatBucket] | None:
        raw = unwrap_optimizer(optimizer)
        return self._buckets.get(id(raw))

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Closure (forward + backward), gradient reduce-scatter, clipping, sharded step, weight all-gather."""
        lightning_module = model or self.lightning_module
        if not isinstance(lightning_module, pl.LightningModule):
            # the precision plugin runs the LightningModule's hooks around the step
            raise TypeError(
                "SDP4BitStrategy.optimizer_step needs the LightningModule being trained (or `model=None` for the"
                f" Trainer's one), got {type(lightning_module).__name__}."
            )
        buckets = self._buckets_of(optimizer)
        if buckets is None:
            output = super().optimizer_step(optimizer, closure, lightning_module, **kwargs)
            if self._single_process:
                self._step += 1  # saved in checkpoints: a multi-process resume seeds its rounding from it
            return output
        assert self._rng is not None
        raw = unwrap_optimizer(optimizer)
        self._sync_groups(raw, buckets)
        self._rng.reset(self._step)
        self.comm_stats.new_step()
        self._skip_current = False
        self._absent = {}
        self._restore = []

        reducer = self._reducer_active  # the backward in the closure all-reduces through torch's DDP reducer

        def closure_with_exchange() -> Any:
            if not reducer:
                self._gradients.start(buckets)
            try:
                result = closure()
                self._note_uncovered()
                self._wait_all_weights()  # the forward waited per bucket; the step below rewrites the masters
            except BaseException:
                if not reducer:
                    self._gradients.abandon()
                raise
            if reducer:
                self._take_reduced_gradients(buckets)
            else:
                self._exchange_gradients(buckets)
            self._exchanged = True
            self._apply_pending_clip(raw)
            self._restore = snapshot_absent(raw, buckets, self._absent)
            if self._gradients_in_hooks and not reducer:
                expose_gradients(buckets, self._absent)  # for on_before_optimizer_step, which runs next
            return result

        try:
            self._wait_all_weights()  # normally a no-op (done in the closure), unless a precision skips it
            with use_shards(raw, buckets):
                output = self.precision_plugin.optimizer_step(
                    optimizer, model=lightning_module, closure=closure_with_exchange, **kwargs
                )
                restore_absent(raw, self._restore)
                self._restore = []
        finally:
            self._exchanged = False
            self._pending_clip.pop(id(raw), None)
            for bucket in buckets:
                bucket.master.grad = None
                if self._gradients_in_hooks or reducer:  # views of the master's gradient: no longer theirs
                    bucket.zero_model_grads()
        if self._formats.replicated:
            finish_replicated_step(buckets)  # no weight all-gather: every rank stepped every value
            self.weight_drift = 0.0
        elif not self._skip_current:
            self._weights.launch(buckets)
            if not self._weights.defer:
                self._wait_all_weights()
        self._step += 1
        self._log_metrics()
        return output

    def _exchange_gradients(self, buckets: list[FlatBucket]) -> None:
        """Reduce the gradients into the master shards' ``.grad``; zero where no rank had a gradient.

        A parameter without a gradient on any rank gets none: its values and optimizer state are restored after
        the step (:func:`~lightning_sdp.plugins.sdp4bit.sharding.snapshot_absent`), as torch leaves it alone.
        """
        reduced = self._gradients.finish(buckets)
        if reduced.redone:
            self._redone_gradients += 1
            rank_zero_warn(
                f"SDP4BitStrategy: at optimizer step {self._step} the quantised gradient exchange of "
                f"{reduced.redone} bucket(s) gave a non-finite or overflowing value from finite gradients; they were "
                f"exchanged again uncompressed (steps redone so far: {self.redone_uncompressed})."
            )
        if reduced.nonfinite:
            self._handle_nonfinite(buckets, reduced.bad_names)
            return
        self._every_param_reduced = all(
            c == self.world_size
            for bucket, count in zip(buckets, reduced.grad_counts, strict=True)
            for p, c in zip(bucket.params, count, strict=True)
            if p.requires_grad
        )
        for bucket, count in zip(buckets, reduced.grad_counts, strict=True):
            bucket.zero_model_grads()
            absent = [i for i, c in enumerate(count) if c == 0]
            shard = reduced.shards.get(id(bucket))
            if shard is None or len(absent) == len(bucket.params):
                # no gradient on any rank: no shard gradient, so the optimizer leaves the group alone (as torch)
                bucket.master.grad = None
                continue
            if absent:
                self._absent[id(bucket)] = absent
                for a, b in bucket.master_ranges(absent):
                    shard[a:b].zero_()
            bucket.master.grad = shard

    def _take_reduced_gradients(self, buckets: list[FlatBucket]) -> None:
        """The reducer averaged the gradients during backward: hand them to the replicated step (the same on every
        rank, so nothing is agreed on; see ``replication``)."""
        self._absent = take_reduced_gradients(buckets)
        reducer = self._reducer
        if reducer is not None and not reducer.find_unused_parameters:
            unused = [b.names[i] for b in buckets for i in self._absent.get(id(b), []) if b.params[i].requires_grad]
            if unused:
                raise RuntimeError(
                    f"SDP4BitStrategy: at optimizer step {self._step} the trainable parameters {unused} got no "
                    "gradient, but every parameter had one in the steps `auto` timed, so it ran DDP's exchange "
                    "without searching for unused parameters; the gradients of their buckets were not averaged, so "
                    "this step was not taken. Pass `optimizer_state='shard'` (the strategy's own exchange handles "
                    "unused parameters), or freeze parameters a step does not use (`requires_grad_(False)`)."
                )
        for bucket in buckets:
            if bucket.master.grad is not None:
                numel = sum(p.numel() for p in bucket.params if p.requires_grad)
                record_allreduce(self.comm_stats, numel, self.world_size)
        bad = reduced_nonfinite_names(buckets)
        if bad is not None:
            self._handle_nonfinite(buckets, bad if self.global_rank == 0 else [])  # every rank holds the same sums

    def _handle_nonfinite(self, buckets: list[FlatBucket], bad_local: list[str]) -> None:
        names: list[Any] = [bad_local]
        if self.world_size > 1 and dist.is_initialized():
            names = [None] * self.world_size
            dist.all_gather_object(names, bad_local)
        report = "; ".join(f"rank {r}: {', '.join(n)}" for r, n in enumerate(names) if n)
        report = report or "the reduced gradients (finite gradients summed beyond the fp32 range)"
        for b in buckets:
            b.zero_model_grads()
            b.master.grad = None
        if self.config.nonfinite_gradients == "raise":
            raise FloatingPointError(
                f"SDP4BitStrategy: non-finite (NaN/Inf) gradient at optimizer step {self._step} in {report}. A NaN "
                "would poison its whole quantisation group. Lower the learning rate, enable gradient clipping or "
                "bf16-mixed, or pass `nonfinite_gradients='skip'` to skip such steps."
            )
        self.skipped_steps += 1
        self._skip_current = True
        rank_zero_warn(
            f"SDP4BitStrategy: skipping optimizer step {self._step} on all ranks because of a non-finite gradient "
            f"in {report} (skipped so far: {self.skipped_steps})."
        )

    # ------------------------------------------------------------------------------------------------ weights

    def wait_for_weights(self) -> None:
        """Wait until every weight all-gather in flight has written the model's parameters (no collective).

        With ``overlap_param_gather`` the optimizer step returns before the new weights are in the model; a
        module's forward waits for its own parameters, and the strategy waits for all of them before validation,
        checkpoints, ``on_train_end`` and the next step. Call this in your own hooks that read the weights between
        the step and the next forward (e.g. ``on_train_batch_end``); it is cheap when nothing is in flight.
        """
        self._wait_all_weights()

    def _wait_all_weights(self) -> None:
        drift = self._weights.wait_all()
        if drift is not None:
            self.weight_drift = drift

    def _wait_quietly(self) -> None:
        """:meth:`_wait_all_weights` on a path that is already failing or ending: log an error, do not raise."""
        try:
            self._wait_all_weights()
        except Exception:  # the original error (or none, at teardown) is what the user must see
            log.exception("SDP4BitStrategy: a weight all-gather in flight failed")

    def _note_uncovered(self) -> None:
        new = self._weights.note_uncovered(self._all_buckets())
        if new and self._step > 0:
            rank_zero_warn(
                f"SDP4BitStrategy: the parameters {new} were used outside the forward of the module that holds them "
                "after the weight all-gather had been overlapped with the forward; from now on their buckets are "
                "gathered before each training_step. If this step read them stale, pass "
                "`overlap_param_gather=False`."
            )

    @property
    def redone_uncompressed(self) -> int:
        """Exchanges the divergence guard redid uncompressed: optimizer steps whose quantised gradient exchange gave
        a non-finite or overflowing value from finite gradients, plus weight all-gathers whose codes had a
        non-finite scale (logged as ``sdp4bit/redone_uncompressed``)."""
        return self._redone_gradients + self._weights.redone

    @property
    def buckets_launched_in_backward(self) -> int:
        """How many buckets left for the exchange while backward was still running (``overlap``)."""
        return self._gradients.buckets_launched_in_backward

    @property
    def weight_gathers_pending_at_forward(self) -> int:
        """Summed over steps, how many buckets' weight all-gathers were still running when the first forward after
        the optimizer step started (``overlap_param_gather``)."""
        return self._weights.pending_at_forward

    @property
    def forward_waits_for_weights(self) -> int:
        """How many times a module's forward had to wait for its bucket's all-gather (``overlap_param_gather``)."""
        return self._weights.forward_waits

    # ------------------------------------------------------------------------------------------------ clipping

    def _clip_shards(self, optimizer: Any, kind: ClipKind, clip_val: float) -> bool:
        """Clip ``optimizer``'s reduced shard gradients; ``False`` when this strategy does not shard it.

        :class:`ShardedClippingPrecision` calls it for ``gradient_clip_val`` and ``LightningModule.clip_gradients``.
        ``"norm"`` is ``clip_grad_norm_`` over the whole model (the norm of all shards, all-reduced across ranks),
        ``"value"`` is ``clip_grad_value_``. Requested before the gradient exchange (``self.clip_gradients`` in
        manual optimization), it is applied to the reduced gradients as soon as they exist, inside
        ``optimizer.step()``.
        """
        buckets = self._buckets_of(optimizer)
        if buckets is None:
            return False
        if not self._exchanged:
            self._pending_clip[id(unwrap_optimizer(optimizer))] = (kind, clip_val)
            return True
        clip_shard_grads(buckets, kind, clip_val, self.root_device)
        return True

    def _apply_pending_clip(self, raw: Optimizer) -> None:
        pending = self._pending_clip.pop(id(raw), None)
        if pending is not None:
            self._clip_shards(raw, *pending)

    def grad_norm(self, module: Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Tensor]:
        """Norms of the reduced gradients, keyed like :func:`lightning.pytorch.utilities.grad_norm` (a collective).

        Call it on every rank where the reduced gradients exist: in ``on_before_optimizer_step`` (or
        ``configure_gradient_clipping``). Parameters without a gradient on any rank are left out, as Lightning
        leaves out parameters whose ``.grad`` is ``None``.

        Args:
            module: the module whose parameters to report (names as in ``module.named_parameters()``).
            norm_type: the p of the p-norm; ``"inf"`` for the max norm.
            group_separator: separator between ``grad_{p}_norm`` and the parameter name.
        """
        if not self._buckets:  # one process (or not fitting): the parameters' ``.grad`` are the gradients
            from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

            return cast(dict[str, Tensor], lightning_grad_norm(module, norm_type, group_separator))
        self._wait_all_weights()
        norm_type = float(norm_type)
        if norm_type <= 0:
            raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
        wanted = {id(p): n for n, p in module.named_parameters()}
        names, parts = shard_grad_norms(self._all_buckets(), self._absent, wanted, norm_type)
        if parts is None:
            return {}
        local = parts.to(self.root_device)
        if self.world_size > 1 and dist.is_initialized():
            dist.all_reduce(local, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
        norms = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
        out = {f"grad_{norm_type}_norm{group_separator}{n}": v.float() for n, v in zip(names, norms, strict=True)}
        out[f"grad_{norm_type}_norm_total"] = torch.tensor([float(v) for v in norms.float()]).norm(norm_type)
        return out

    def _log_metrics(self) -> None:
        """``self.log`` the ``sdp4bit/*`` scalars on the steps Lightning writes to the loggers (every
        ``log_every_n_steps``) and on the last one (``self.log`` is too costly to call every step)."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        if not self.config.log_metrics or module is None or trainer is None:
            return
        last = trainer.is_last_batch or 0 < trainer.max_steps <= trainer.global_step + 1
        if not (trainer._logger_connector.should_update_logs or last):
            return
        metrics = self.comm_stats.metrics(codec=isinstance(self._ops, TimedOps))
        metrics["sdp4bit/skipped_steps"] = float(self.skipped_steps)
        metrics["sdp4bit/redone_uncompressed"] = float(self.redone_uncompressed)
        if self.config.track_drift and not math.isnan(self.weight_drift):
            metrics["sdp4bit/weight_drift"] = self.weight_drift
        if self._auto is not None:
            metrics.update(self._auto.metrics())
        module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    # ------------------------------------------------------------------------------------------------ checkpoints

    @contextmanager
    def _outside_the_step(self, together: bool = False) -> Iterator[None]:
        """Leave the time spent inside out of ``"auto"``'s trial step (validation, checkpoints, re-sharding).

        Args:
            together: end with a barrier, so that the ranks that finish first do not wait inside the next step
                (rank 0 writes a checkpoint alone, ranks validate at their own pace).
        """
        auto = self._auto
        if auto is None or not auto.trialling:
            yield
            return
        auto.pause()
        try:
            yield
            if together:
                self.barrier("SDP4BitStrategy: outside the step")
        finally:
            auto.resume()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """As DDP; while ``"auto"`` times its trials, the write is left out of the step (see ``auto``)."""
        with self._outside_the_step(together=True):
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """Consolidated, world-size-independent state keyed like the unsharded optimizer (a collective)."""
        with self._outside_the_step():
            return self._optimizer_state(optimizer)

    def _optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        self._wait_all_weights()
        buckets = self._buckets_of(optimizer)
        if buckets is None:
            state = super().optimizer_state(optimizer)
            if self._single_process:
                extra = {"step": self._step, "skipped_steps": self.skipped_steps, "world_size": self.world_size}
                state = single_process_state(unwrap_optimizer(optimizer), state, extra)
            return state
        raw = unwrap_optimizer(optimizer)
        self._sync_groups(raw, buckets)
        extra = {"step": self._step, "skipped_steps": self.skipped_steps, "world_size": self.world_size}
        return consolidate_state(raw, buckets, extra)

    def _load_extra(self, state: dict[str, Any]) -> None:
        extra = state.get("sdp4bit", {})
        self._step = int(extra.get("step", self._step))
        self.skipped_steps = int(extra.get("skipped_steps", self.skipped_steps))

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Cut the consolidated state for this world size; set every rank's weights to the exact master weights.

        With one process the state is loaded into the user's optimizer as Lightning does (``load_state_dict``);
        the model's weights come from the checkpoint's ``state_dict``, which holds the master weights.
        """
        self._wait_all_weights()
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"The checkpoint holds {len(states)} optimizer states, the model configures {len(self.optimizers)}."
            )
        if self._single_process:
            super().load_optimizer_state_dict(checkpoint)
            for state in states:
                self._load_extra(state)
            return
        for opt, state in zip(self.optimizers, states, strict=True):
            buckets = self._buckets_of(opt)
            if buckets is None:
                opt.load_state_dict(state)
                continue
            raw = unwrap_optimizer(opt)
            self._sync_groups(raw, buckets)
            load_consolidated_state(raw, buckets, state)
            self._load_extra(state)
            with torch.no_grad():
                for bucket in buckets:
                    bucket.model_flat.copy_(bucket.full_master())
                    bucket.store_to_params()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state dict with the exact (consolidated) master weights in place of the reconstructed ones."""
        assert self.lightning_module is not None
        with self._outside_the_step():
            self._wait_all_weights()
            state = self.lightning_module.state_dict()
            if not self._buckets:
                return state
            return put_master_weights(state, self.lightning_module, self._all_buckets())

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """As DDP, after any weight all-gather in flight (it would overwrite the loaded weights)."""
        self._wait_all_weights()
        super().load_model_state_dict(checkpoint, strict=strict)

    # ------------------------------------------------------------------------------------------------ hooks

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """With ``"auto"``: time the optimizer steps and switch formats between them (see ``auto``)."""
        super().on_train_batch_start(batch, batch_idx)
        if self._reducer_active:
            self._use_reducer(True)  # a new wrapper if parameters were frozen or unfrozen since the last one
        if self._auto is None or self._step == self._auto_seen_step:
            return  # not a new optimizer step (gradient accumulation)
        self._auto_seen_step, decided = self._step, len(self._auto.decisions)
        active = self._auto.observe(self._step)
        if active.replicated != self._formats.replicated:
            with self._outside_the_step():
                self._set_replicated(active.replicated)
        self._formats.weight, self._formats.gradient = active.weight, active.gradient
        if len(self._auto.decisions) > decided:
            rank_zero_say(self._auto.decisions[-1].describe())

    def _set_replicated(self, replicated: bool) -> None:
        """Switch every sharded optimizer to DDP's exchange (a replicated state) or back (see ``replication``)."""
        self._wait_all_weights()
        for opt in self.optimizers:
            raw = unwrap_optimizer(opt)
            buckets = self._buckets.get(id(raw))
            if buckets is not None:
                (replicate if replicated else shard)(raw, buckets)
        self._formats.replicated = replicated
        self._use_reducer(replicated)

    def _reducer_bytes(self) -> int | None:
        """Bytes of gradients DDP's reducer all-reduces per step, in the parameters' dtype (``None``: no reducer,
        manual optimization)."""
        module = self.lightning_module
        if module is None or not self._reducer_allowed:
            return None
        return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)

    @property
    def _reducer_active(self) -> bool:
        return isinstance(self.model, DistributedDataParallel)

    def _use_reducer(self, replicated: bool) -> None:
        """Run replicated steps of automatic optimization through torch's DDP reducer (``replication``); every
        other step through the strategy's own exchange on the unwrapped module.

        While ``"auto"`` tries candidates the wrapper is kept between its turns: a reducer whose forward did not
        run ignores backward, and its buckets are rebuilt once, in its second step, as under DDP.
        """
        module = self.lightning_module
        assert module is not None
        if not (replicated and self._reducer_allowed):
            self.model = module
            if self._auto is None or not self._auto.trialling:
                self._reducer, self._reducer_signature = None, None  # its buckets hold a copy of the gradients
            return
        signature = tuple(p.requires_grad for p in module.parameters())
        if self._reducer is None or signature != self._reducer_signature:
            self.model, self._reducer = module, None  # the old reducer goes first, and with it its gradient hooks
            find_unused = self._every_param_reduced is not True
            self._reducer = reducer_wrapper(module, self.root_device, find_unused_parameters=find_unused)
            self._reducer_signature = signature
        self.model = self._reducer

    def _replica_fits(self, candidate: Candidate) -> tuple[bool, str]:
        """Whether every rank has the memory to replicate its optimizer state (a collective; see ``replication``)."""
        needed = 0
        for opt in self.optimizers:
            raw = unwrap_optimizer(opt)
            needed += extra_bytes(raw, self._buckets.get(id(raw), []))
        needed += self._reducer_bytes() or 0  # the reducer's buckets: a copy of the gradients
        return replica_fits(needed, self.root_device)

    @property
    def auto_decisions(self) -> list[Decision]:
        """The choices of ``"auto"`` in this ``fit``, oldest first (empty with fixed formats or one process)."""
        return [] if self._auto is None else list(self._auto.decisions)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Wait for the buckets whose parameters are read outside their module's forward, then as DDP."""
        self._weights.wait_eager()
        return super().training_step(*args, **kwargs)

    @override
    def on_train_start(self) -> None:
        self._weights.start_training()  # forwards of the sanity check do not count
        super().on_train_start()

    @override
    def on_validation_start(self) -> None:
        self._wait_all_weights()
        self._validation_paused = self._auto is not None and self._auto.trialling
        if self._auto is not None and self._validation_paused:
            self._auto.pause()
        super().on_validation_start()

    @override
    def on_validation_end(self) -> None:
        """Leave validation (and the checkpoints saved at its end) out of ``"auto"``'s trial step."""
        super().on_validation_end()
        paused, self._validation_paused = self._validation_paused, False
        if self._auto is not None and paused:
            self.barrier("SDP4BitStrategy: validation done")  # the ranks leave together
            self._auto.resume()

    @override
    def on_test_start(self) -> None:
        self._wait_all_weights()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._wait_all_weights()
        super().on_predict_start()

    @override
    def on_train_end(self) -> None:
        self._wait_all_weights()
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._wait_quietly()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """Destroy the intra/inter-node process groups created at set-up (one set per ``fit``), then as DDP."""
        self._wait_quietly()
        if self._reducer is not None:
            self.model, self._reducer, self._reducer_signature = self.lightning_module, None, None
        self._gradients.teardown()
        self._weights.teardown()
        self._pipeline.shutdown()
        if self.topology is not None:
            self.topology.destroy()
        super().teardown()
        if isinstance(self.precision_plugin, ShardedClippingPrecision):
            self.precision_plugin = self.precision_plugin.plugin  # leave the user's plugin as it was given

    @property
    def buckets(self) -> list[FlatBucket]:
        """Every flat bucket of every sharded optimizer (empty before setup); for diagnostics such as
        ``benchmarks/sdp4bit_convergence.py``. The buckets are live: read them, do not change them."""
        self._wait_all_weights()
        return self._all_buckets()

    def master_shards(self, optimizer: Optimizer) -> list[Tensor]:
        """The fp32 master shards of ``optimizer``'s param groups on this rank (what the optimizer steps)."""
        self._wait_all_weights()
        buckets = self._buckets_of(optimizer)
        if buckets is None:
            raise ValueError(
                "This optimizer is not sharded by SDP4BitStrategy"
                + (
                    " (with one process nothing is sharded: the optimizer steps the parameters)."
                    if self._single_process
                    else "."
                )
            )
        return [b.master for b in buckets]


# When this module is what first imports lightning.pytorch, the import hook ran before the class existed.
register_class_aliases(SDP4BitStrategy)
