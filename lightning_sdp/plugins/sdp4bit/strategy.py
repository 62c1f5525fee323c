"""``SDP4BitStrategy``: sharded data parallelism with 4-bit weight and gradient communication.

Jia et al., "SDP4Bit: Toward 4-bit Communication Quantization in Sharded Data Parallelism for LLM Training",
NeurIPS 2024 (arXiv 2410.15526).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sdp._registry import register_class_aliases
from lightning_sdp.kernels import quantization
from lightning_sdp.plugins.sdp4bit.exchange import (
    GRADIENT_MODES,
    WEIGHT_MODES,
    CommStats,
    GradientCompression,
    GradientExchange,
    RoundingRNG,
    TimedOps,
    TorchOps,
    TritonOps,
    WeightCompression,
    WeightExchange,
    first_level_bits,
    gradient_format,
    max_safe_scale,
)
from lightning_sdp.plugins.sdp4bit.overlap import Pipeline
from lightning_sdp.plugins.sdp4bit.precision import ClipKind, ShardedClippingPrecision
from lightning_sdp.plugins.sdp4bit.sharding import (
    FlatBucket,
    all_reduce_sum,
    consolidate_state,
    group_params,
    load_consolidated_state,
    shard_group,
    shard_optimizer,
    use_shards,
)
from lightning_sdp.plugins.sdp4bit.topology import Topology, build_topology
from lightning_sdp.utilities import unwrap_optimizer

log = logging.getLogger(__name__)

_SUPPORTED_PRECISION = ("32-true", "32", "bf16-mixed", "bf16-true")
_MAX_GROUP_SIZE = 2**16
_MAX_HADAMARD_SIZE = 1024
# Value of a fresh optimizer state entry where it is not zero (Rprop starts every step size at the learning rate).
_FRESH_STATE_FROM_GROUP = {"step_size": "lr"}


def _lcm(*values: int) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


class SDP4BitStrategy(DDPStrategy):
    """Sharded data parallelism (ZeRO-1/2, Megatron distributed-optimizer style) with SDP4Bit's quantised collectives.

    Every rank keeps the full model; each optimizer param group is flattened, zero-padded and cut into one fp32
    master shard per rank, which is all the user's optimizer sees (so AdamW, SGD, LR schedulers, clipping and
    gradient accumulation work unchanged). Per optimizer step: one gradient reduce-scatter, compressed with
    two-level quantisation and Hadamard smoothing (TLq-HS: 8-bit all-to-all inside a node, 4-bit all-to-all
    between nodes), the optimizer step on the shard, and one weight all-gather of 4-bit quantised weight
    differences (qWD) against the weights every rank already holds. The model is not wrapped in
    ``DistributedDataParallel``; the initial weights are broadcast from rank 0.

    Args:
        weight_compression: ``"qwd"`` (default, quantised weight differences), ``"qw"`` (quantise the weights
            themselves, as ZeRO++/QSDP do) or ``"none"`` (all-gather in the model dtype).
        gradient_compression: ``"tlq_hs"`` (default), ``"tlq"`` (two levels, no Hadamard), ``"ulq"`` (4 bits at
            every level, no Hadamard) or ``"none"`` (fp32 hierarchical reduce-scatter).
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
            all ranks with a warning; counted in ``sdp4bit/skipped_steps``) when a gradient holds NaN/Inf.
        seed: seed of the stochastic rounding (reseeded from ``(seed, step, rank)`` every step).
        kernel_backend: ``"auto"`` (Triton on CUDA when installed, else torch), ``"torch"`` or ``"triton"``.
        track_drift: log ``sdp4bit/weight_drift`` = ``||w_master - w_model|| / ||w_master||`` every step (one small
            all-reduce).
        allow_any_optimizer: accept optimizers that are not (subclasses of) the element-wise ``torch.optim`` ones;
            you assert that their update is element-wise (e.g. Lion). LBFGS, SparseAdam and Adafactor stay refused.
        bucket_size_mb: each param group is cut into buckets of at most this many MiB of fp32 gradients (default
            4; ``None``: one bucket per param group). Every bucket is sharded and exchanged on its own, so a
            bucket's exchange can start while backward still computes the gradients of earlier layers.
        overlap: exchange each bucket's gradients on background threads as soon as backward has produced them
            (post-accumulate-grad hooks, as DDP's reducer and Megatron's ``overlap_grad_reduce``), pipeline the
            intra- and inter-node all-to-alls of consecutive buckets, and pipeline the weight all-gather after the
            step (default ``True``). ``False`` runs the same per-bucket exchanges one after the other once backward
            is done; both give bit-identical results.
        overlap_param_gather: with ``overlap=True`` and automatic optimization, return from the optimizer step
            while the weight all-gather is still running and let each module's forward wait only for the bucket(s)
            holding its own parameters (forward pre-hooks, Megatron's ``overlap_param_gather``); the buckets are
            gathered in forward order, so the first layers' bucket arrives first (default ``False``: on loopback it
            did not measure faster than waiting in the step, see ``docs/sdp4bit.md``). Everything
            else that reads the weights (validation, checkpoints, ``on_train_end``, the next optimizer step) waits
            for all of them first; so can your own code, with :meth:`wait_for_weights`. ``False``: the step waits
            for the whole all-gather (pipelined per bucket). Ignored with ``overlap=False`` or manual optimization.
            Bit-identical results.
        accelerator: see :class:`~lightning.pytorch.strategies.DDPStrategy`.
        parallel_devices: see ``DDPStrategy``.
        cluster_environment: see ``DDPStrategy``.
        checkpoint_io: see ``DDPStrategy``.
        precision_plugin: see ``DDPStrategy``.
        process_group_backend: ``"gloo"`` (CPU default) or ``"nccl"`` (CUDA default).
        timeout: process-group timeout.
        start_method: ``"popen"`` (default), ``"spawn"``, ``"fork"`` or ``"forkserver"``.

    Attributes:
        comm_stats: bytes and values sent per collective (last step and whole run), and the quantise/dequantise
            time on the CPU (``codec_seconds``). With ``overlap_param_gather`` a step's weight all-gather is
            counted in the step that waits for it (the next one).
        buckets_launched_in_backward: how many buckets left for the exchange while backward was still running.
        weight_gathers_pending_at_forward: summed over steps, how many buckets' weight all-gathers were still
            running when the first forward after the optimizer step started (``overlap_param_gather``).
        forward_waits_for_weights: how many times a module's forward had to wait for its bucket's all-gather.
    """

    strategy_name = "sdp4bit"

    def __init__(
        self,
        weight_compression: WeightCompression = "qwd",
        gradient_compression: GradientCompression = "tlq_hs",
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
        kernel_backend: Literal["auto", "torch", "triton"] = "auto",
        track_drift: bool = True,
        allow_any_optimizer: bool = False,
        bucket_size_mb: float | None = 4.0,
        overlap: bool = True,
        overlap_param_gather: bool = False,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
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
        _check_ints(
            weight_bits=weight_bits, weight_group_size=weight_group_size, gradient_intra_bits=gradient_intra_bits,
            gradient_inter_bits=gradient_inter_bits, gradient_group_size=gradient_group_size,
            hadamard_size=hadamard_size, seed=seed,
        )  # fmt: skip
        if intra_node_size is not None:
            _check_ints(intra_node_size=intra_node_size)
        if bucket_size_mb is not None and (
            isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float))
            or not math.isfinite(bucket_size_mb) or bucket_size_mb <= 0
        ):  # fmt: skip
            raise ValueError(
                f"bucket_size_mb must be a positive number of MiB (or None for one bucket per param group), got "
                f"{bucket_size_mb!r}."
            )
        for flag, value in (("overlap", overlap), ("overlap_param_gather", overlap_param_gather)):
            if not isinstance(value, bool):
                raise TypeError(f"SDP4BitStrategy: {flag} must be a bool, got {value!r} ({type(value).__name__}).")
        if weight_compression not in WEIGHT_MODES:
            raise ValueError(f"weight_compression must be one of {WEIGHT_MODES}, got {weight_compression!r}.")
        if gradient_compression not in GRADIENT_MODES:
            raise ValueError(f"gradient_compression must be one of {GRADIENT_MODES}, got {gradient_compression!r}.")
        for name, bits in (("weight_bits", weight_bits), ("gradient_intra_bits", gradient_intra_bits),
                           ("gradient_inter_bits", gradient_inter_bits)):  # fmt: skip
            if bits not in (4, 8):
                raise ValueError(f"{name} must be 4 or 8, got {bits}.")
        for name, size in (
            ("weight_group_size", weight_group_size),
            ("gradient_group_size", gradient_group_size),
        ):
            if size < 2 or size % 2:
                raise ValueError(f"{name} must be a positive even number (two 4-bit codes per byte), got {size}.")
            if size > _MAX_GROUP_SIZE:
                raise ValueError(
                    f"{name} must be at most {_MAX_GROUP_SIZE}, got {size}: every param group is padded to a whole "
                    "number of groups per rank, so a huge group pads a small model to gigabytes, and one fp32 "
                    "scale per huge group quantises coarsely. The paper uses 2048 (weights) and 128 (gradients)."
                )
        if hadamard_size < 1 or hadamard_size & (hadamard_size - 1):
            raise ValueError(f"hadamard_size must be a power of two, got {hadamard_size}.")
        if hadamard_size > _MAX_HADAMARD_SIZE:
            raise ValueError(
                f"hadamard_size must be at most {_MAX_HADAMARD_SIZE}, got {hadamard_size} (the transform builds a "
                "dense n x n matrix; the paper uses 32)."
            )
        if gradient_compression == "tlq_hs" and gradient_group_size % hadamard_size:
            raise ValueError(
                f"gradient_group_size ({gradient_group_size}) must be a multiple of hadamard_size ({hadamard_size}) "
                "so that every quantisation group holds whole Hadamard blocks."
            )
        if rounding not in ("stochastic", "nearest"):
            raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}.")
        if intra_node_size is not None and intra_node_size < 1:
            raise ValueError(f"intra_node_size must be positive, got {intra_node_size}.")
        if nonfinite_gradients not in ("raise", "skip"):
            raise ValueError(f"nonfinite_gradients must be 'raise' or 'skip', got {nonfinite_gradients!r}.")
        if kernel_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel_backend must be 'auto', 'torch' or 'triton', got {kernel_backend!r}.")
        self.weight_compression = weight_compression
        self.gradient_compression = gradient_compression
        self.weight_bits = weight_bits
        self.weight_group_size = weight_group_size
        self.gradient_group_size = gradient_group_size
        self.hadamard_size = hadamard_size
        self.rounding = rounding
        self.intra_node_size = intra_node_size
        self.nonfinite_gradients = nonfinite_gradients
        self.seed = seed
        self.kernel_backend = kernel_backend
        self.track_drift = track_drift
        self.allow_any_optimizer = allow_any_optimizer
        self.bucket_size_mb = bucket_size_mb
        self.overlap = overlap
        self.overlap_param_gather = overlap_param_gather
        self.gradient_format = gradient_format(
            gradient_compression, gradient_intra_bits, gradient_inter_bits, hadamard_size
        )
        self.comm_stats = CommStats()
        self.topology: Topology | None = None
        self.skipped_steps = 0
        self.weight_drift = float("nan")
        self._step = 0
        self._buckets: dict[int, list[FlatBucket]] = {}
        self._ops: TorchOps = TorchOps()
        self._rng: RoundingRNG | None = None
        self._skip_current = False
        # Hadamard blocks never straddle two parameters (a zero gradient stays exactly zero). A measurement knob, not
        # an argument: benchmarks/sdp4bit_zero_blocks.py turns it off (before `fit`) to show what alignment buys.
        self.align_hadamard_blocks = True
        # Per optimizer step: whether the shard gradients exist yet, clipping requested before that (manual
        # optimization), the shard ranges of parameters without a gradient on any rank, and what to restore there.
        self._exchanged = False
        self._pending_clip: dict[int, tuple[ClipKind, float]] = {}
        self._absent: dict[int, list[int]] = {}
        self._restore: list[tuple[int, FlatBucket, list[tuple[int, int]], Tensor, dict[str, Tensor | None]]] = []
        # Overlap: worker threads, post-accumulate-grad hooks, and the state of the exchange in flight.
        self._pipeline = Pipeline(threaded=False)
        self._hooks: dict[int, Any] = {}
        self._collecting: list[FlatBucket] | None = None
        self._pending: list[set[int]] = []
        self._bucket_of_param: dict[int, int] = {}
        self._jobs: list[_GradJob | None] = []
        self._next_launch = 0
        self.buckets_launched_in_backward = 0
        # Weight all-gathers in flight past the optimizer step (overlap_param_gather): a future per bucket, their
        # accounting, the drift job; forward pre-hooks and the parameters each bucket holds; parameters whose
        # module's pre-hook ran since the last gather ("covered") and buckets used outside any hooked forward
        # ("eager": waited for at the start of every training_step).
        self._weight_jobs: dict[int, Any] = {}
        self._weight_stats: list[CommStats] = []
        self._drift_job: Any = None
        self._defer_weights = False
        self._weight_bucket_of: dict[int, FlatBucket] = {}
        self._param_position: dict[int, int] = {}
        self._forward_hooks: list[Any] = []
        self._hooked_modules: set[int] = set()
        self._covered: set[int] = set()
        self._eager: dict[int, FlatBucket] = {}
        self._forward_started = True
        self.weight_gathers_pending_at_forward = 0
        self.forward_waits_for_weights = 0

    # ------------------------------------------------------------------------------------------------ set-up

    @property
    def alignment(self) -> int:
        """Every shard is a multiple of this many values (groups, Hadamard blocks, int4 byte pairs)."""
        sizes = [2]
        if self.weight_compression != "none":
            sizes.append(self.weight_group_size)
        if self.gradient_format.quantized:
            sizes.append(self.gradient_group_size)
        if self.gradient_format.hadamard:
            sizes.append(self.gradient_format.hadamard)
        return _lcm(*sizes)

    def _intra_size(self) -> int:
        world = self.world_size
        if self.intra_node_size is not None:
            return self.intra_node_size
        if self.num_processes * self.num_nodes == world:
            return self.num_processes
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local and local.isdigit() and world % int(local) == 0:
            return int(local)
        return world

    @property
    def param_alignment(self) -> int:
        """Every parameter starts at a multiple of this in the flat buffer (the Hadamard block, when one is used)."""
        if self.gradient_format.hadamard and self.world_size > 1 and self.align_hadamard_blocks:
            return self.gradient_format.hadamard
        return 1

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
        if self.world_size == 1:
            rank_zero_warn(
                "SDP4BitStrategy runs with a single process: nothing is communicated, so nothing is compressed. "
                "Training proceeds normally (sharding over one rank)."
            )
        if self.world_size > 1 and dist.is_initialized():
            self.topology = build_topology(self.global_rank, self.world_size, self._intra_size())
        else:
            self.topology = Topology.single()
        topo = self.topology
        log.info(
            "SDP4Bit topology: rank %d, intra-node size %d, inter-node size %d", topo.rank, topo.intra_size,
            topo.inter_size,
        )  # fmt: skip
        self._ops = self._select_ops()
        if self.root_device.type == "cpu":
            self._ops = TimedOps(self._ops, self.comm_stats)  # sdp4bit/codec_ms: quantise/dequantise time per step
        self._rng = RoundingRNG(self.seed, self.global_rank, self.root_device)
        assert self.lightning_module is not None
        if not any(p.requires_grad for p in self.lightning_module.parameters()):
            raise ValueError(
                "SDP4BitStrategy has nothing to train: no parameter of the LightningModule requires a gradient. "
                "Unfreeze at least one parameter before `fit` (or use `trainer.validate`/`test`/`predict` to run a "
                "frozen model)."
            )
        names = self._param_names()
        self._buckets = {}
        for opt in self.optimizers:
            raw = unwrap_optimizer(opt)
            self._buckets[id(raw)] = shard_optimizer(
                raw, names, self.world_size, self.global_rank, self.alignment, self.param_alignment,
                self.allow_any_optimizer, self._bucket_numel,
            )  # fmt: skip
            self._warn_padding(self._buckets[id(raw)])
        self._pipeline = Pipeline(threaded=self.overlap and self.world_size > 1)
        self._defer_weights = (
            self._pipeline.threaded and self.overlap_param_gather and self.lightning_module.automatic_optimization
        )
        self._eager = {}
        self._index_params()
        # Global-norm and value clipping on the shards (Lightning clips through the precision plugin).
        if not isinstance(self.precision_plugin, ShardedClippingPrecision):
            self.precision_plugin = ShardedClippingPrecision(self.precision_plugin, self._clip_shards)

    @property
    def _bucket_numel(self) -> int | None:
        if self.bucket_size_mb is None:
            return None
        return max(1, int(self.bucket_size_mb * 2**20) // 4)

    def _param_names(self) -> dict[int, str]:
        assert self.lightning_module is not None
        return {id(p): n for n, p in self.lightning_module.named_parameters()}

    def _warn_padding(self, buckets: list[FlatBucket]) -> None:
        numel = sum(sum(b.numels) for b in buckets)
        padded = sum(b.padded for b in buckets)
        if padded - numel > max(numel, 2**20):
            rank_zero_warn(
                f"SDP4BitStrategy pads {numel:,} parameter values to {padded:,} ({len(buckets)} param groups, "
                f"{self.world_size} ranks, shards a multiple of {self.alignment}): most of what is communicated is "
                "padding. Lower `weight_group_size`/`gradient_group_size` or merge small param groups."
            )

    def _sync_groups(self, raw: Optimizer, buckets: list[FlatBucket]) -> None:
        """Shard param groups added since set-up (``add_param_group``, e.g. by ``BackboneFinetuning``)."""
        groups = raw.param_groups
        n_known = len({b.group_index for b in buckets})
        if len(groups) < n_known:
            raise ValueError(
                f"The optimizer had {n_known} param groups when SDP4BitStrategy sharded it and now has "
                f"{len(groups)}: removing param groups during training is not supported (adding them is)."
            )
        for i, group in enumerate(groups[:n_known]):
            params, known = group["params"], group_params(buckets, i)
            if len(params) != len(known) or any(p is not q for p, q in zip(params, known, strict=True)):
                raise ValueError(
                    f"The parameters of optimizer param group {i} changed after SDP4BitStrategy sharded it: editing "
                    "a group's 'params' during training is not supported. Add new parameters with "
                    "`optimizer.add_param_group(...)` instead."
                )
        if len(groups) == n_known:
            return
        names = self._param_names()
        for i in range(n_known, len(groups)):
            buckets.extend(
                shard_group(
                    groups[i],
                    names,
                    self.world_size,
                    self.global_rank,
                    self.alignment,
                    self.param_alignment,
                    i,
                    self._bucket_numel,
                )
            )
        self._index_params()

    def _select_ops(self) -> TorchOps:
        from lightning_sdp._imports import _TRITON_AVAILABLE

        if self.kernel_backend == "torch":
            return TorchOps()
        if self.kernel_backend == "triton":
            if self.root_device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(
                    "kernel_backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)."
                )
            for name, size in (("weight_group_size", self.weight_group_size),
                               ("gradient_group_size", self.gradient_group_size)):  # fmt: skip
                if size & (size - 1):
                    raise ValueError(f"kernel_backend='triton' needs {name} to be a power of two, got {size}.")
            return TritonOps()
        pow2 = all(s & (s - 1) == 0 for s in (self.weight_group_size, self.gradient_group_size))
        if self.root_device.type == "cuda" and _TRITON_AVAILABLE and pow2:
            return TritonOps()
        return TorchOps()

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
            return super().optimizer_step(optimizer, closure, lightning_module, **kwargs)
        assert self._rng is not None
        raw = unwrap_optimizer(optimizer)
        self._sync_groups(raw, buckets)
        self._rng.reset(self._step)
        self.comm_stats.new_step()
        self._skip_current = False
        self._absent = {}
        self._restore = []

        def closure_with_exchange() -> Any:
            self._start_collecting(buckets)
            try:
                result = closure()
                self._note_uncovered()
                self._wait_all_weights()  # the forward waited per bucket; the step below rewrites the masters
            except BaseException:
                self._abandon_exchange()
                raise
            self._exchange_gradients(buckets)
            self._exchanged = True
            self._apply_pending_clip(raw)
            self._snapshot_absent(raw, buckets)
            return result

        try:
            self._wait_all_weights()  # normally a no-op (done in the closure), unless a precision skips it
            with use_shards(raw, buckets):
                output = self.precision_plugin.optimizer_step(
                    optimizer, model=lightning_module, closure=closure_with_exchange, **kwargs
                )
                self._restore_absent(raw)
        finally:
            self._exchanged = False
            self._pending_clip.pop(id(raw), None)
            for bucket in buckets:
                bucket.master.grad = None
        if not self._skip_current:
            self._launch_weights(buckets)
        self._step += 1
        self._log_metrics()
        return output

    # ------------------------------------------------------------------------------------------------ overlap

    def _start_collecting(self, buckets: list[FlatBucket]) -> None:
        """Arm the post-accumulate-grad hooks for this optimizer's buckets (launched last bucket first)."""
        order = buckets[::-1]  # backward produces the gradients of the last parameters first
        self._jobs = [None] * len(order)
        self._next_launch = 0
        self._pending = [{id(p) for p in b.params if p.requires_grad} for b in order]
        self._bucket_of_param = {id(p): pos for pos, b in enumerate(order) for p in b.params}
        self._collecting = order
        if not self._pipeline.threaded:
            return
        for b in order:
            for p in b.params:
                if p.requires_grad and id(p) not in self._hooks:
                    self._hooks[id(p)] = p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, param: Tensor) -> None:
        """Post-accumulate-grad hook: launch every bucket, in order, whose gradients are all complete."""
        if self._collecting is None:
            return  # a backward outside the final micro-batch's closure (gradient accumulation): no exchange
        pos = self._bucket_of_param.get(id(param))
        if pos is None:
            return
        self._pending[pos].discard(id(param))
        while self._next_launch < len(self._collecting) and not self._pending[self._next_launch]:
            self._launch(self._next_launch)
            self._next_launch += 1
            self.buckets_launched_in_backward += 1

    def _launch(self, pos: int) -> None:
        """Copy bucket ``pos``'s gradients (divided by W) and queue its exchange on the pipeline."""
        assert self._collecting is not None and self.topology is not None and self._rng is not None
        bucket = self._collecting[pos]
        if not any(p.requires_grad for p in bucket.params):
            self._jobs[pos] = None  # frozen bucket: nothing to exchange (the same on every rank)
            return
        flat = bucket.gather_grads(self.world_size)
        key = len(self._collecting) - 1 - pos  # the bucket's index in the optimizer, whatever the launch order
        exchange = GradientExchange(
            flat, self.topology, self.gradient_format, self.gradient_group_size, self.rounding, self._rng.child(key),
            self._ops, self.comm_stats,
        )  # fmt: skip
        job = _GradJob(bucket, exchange)
        limit = 0.0
        if self.gradient_format.quantized and self.world_size > 1:
            limit = max_safe_scale(first_level_bits(self.topology, self.gradient_format), self.world_size,
                                   self.gradient_format.hadamard)  # fmt: skip

        def first() -> None:
            try:
                job.finite = _all_finite(flat)
                encoded = exchange.encode()
                if encoded is not None and job.finite:
                    job.overflow = self._overflow_names(bucket, encoded[1], limit)
            finally:
                job.checked.set()
            exchange.first()

        job.future = self._pipeline.submit(first, exchange.second)
        self._jobs[pos] = job

    def _abandon_exchange(self) -> None:
        """Wait for the exchanges in flight and forget them (the closure failed)."""
        self._collecting = None
        for job in self._jobs:
            if job is not None and job.future is not None:
                try:
                    job.future.result()
                except Exception:  # the closure's own error is what the user must see
                    pass
        self._jobs = []

    def _exchange_gradients(self, buckets: list[FlatBucket]) -> None:
        """Finish the per-bucket reduce-scatters and agree on NaN/overflow and on which parameters have a gradient.

        Buckets whose gradients were not complete during backward (unused parameters, manual optimization, or
        ``overlap=False``) are launched now, in order. One small all-reduce then carries, per rank: the number of
        buckets with a non-finite or too large value, one flag per bucket whose gradients changed after it was
        launched (e.g. in ``on_after_backward``; those are exchanged again on every rank), and the "has grad" flags.
        """
        assert self.topology is not None and self._rng is not None
        order = self._collecting
        assert order is not None
        self._collecting = None
        try:
            for pos in range(self._next_launch, len(order)):
                self._collecting = order
                self._launch(pos)
            self._collecting = None
            for job in self._jobs:
                if job is not None:
                    job.checked.wait()
            dirty = [float(job is not None and job.dirty()) for job in self._jobs]
            has_grad = torch.cat([b.has_grad_flags() for b in buckets])
            n_bad = float(sum(job is not None and (not job.finite or bool(job.overflow)) for job in self._jobs))
            agreed = all_reduce_sum(torch.tensor([n_bad, *dirty, *has_grad.tolist()]).to(self.root_device)).cpu()
            again = [pos for pos, d in enumerate(agreed[1 : 1 + len(order)].tolist()) if d > 0]
            if again:
                # gradients edited after their bucket left: wait, then exchange those buckets again everywhere
                for job in self._jobs:
                    if job is not None:
                        job.future.result()
                self._collecting = order
                for pos in again:
                    self._launch(pos)
                self._collecting = None
                n_bad = float(sum(job is not None and (not job.finite or bool(job.overflow)) for job in self._jobs))
                agreed[0] = all_reduce_sum(torch.tensor([n_bad]).to(self.root_device)).cpu()[0]
            shards = {id(job.bucket): job.future.result() for job in self._jobs if job is not None}
            jobs = [job for job in self._jobs[::-1] if job is not None]  # in parameter order
            bad_local = [name for job in jobs if not job.finite for name in job.bucket.non_finite_names()]
            bad_local += [name for job in jobs for name in job.overflow]
            if not bad_local and any(job is not None and not job.finite for job in self._jobs):
                bad_local = ["<non-finite value in a quantisation group>"]
        finally:
            self._jobs = []
        if agreed[0].item() > 0:
            self._handle_nonfinite(buckets, bad_local)
            return
        counts = agreed[1 + len(order) :].split([len(b.params) for b in buckets])
        for bucket, count in zip(buckets, counts, strict=True):
            bucket.zero_model_grads()
            absent = [i for i, c in enumerate(count.tolist()) if c == 0]
            shard = shards.get(id(bucket))
            if shard is None or len(absent) == len(bucket.params):
                # no gradient on any rank: no shard gradient, so the optimizer leaves the group alone (as torch)
                bucket.master.grad = None
                continue
            if absent:
                self._absent[id(bucket)] = absent
                for a, b in bucket.shard_ranges(absent):
                    shard[a:b].zero_()
            bucket.master.grad = shard

    def _overflow_names(self, bucket: FlatBucket, scales: Tensor, limit: float) -> list[str]:
        bad = ~(torch.isfinite(scales) & (scales <= limit))
        if not bool(bad.any()):
            return []
        qmax = quantization.qmax(first_level_bits(self.topology, self.gradient_format))  # type: ignore[arg-type]
        what = "after the Hadamard transform" if self.gradient_format.hadamard else "as quantised"
        out: list[str] = []
        g = self.gradient_group_size
        for idx in bad.nonzero().flatten().tolist():
            for name in bucket.names_in(idx * g, (idx + 1) * g):
                label = f"{name} (|value| up to {float(scales[idx]) * qmax:.3g} {what}, too large to quantise)"
                if label.split(" (")[0] not in [o.split(" (")[0] for o in out]:
                    out.append(label)
        return out

    def _snapshot_absent(self, raw: Optimizer, buckets: list[FlatBucket]) -> None:
        """Save the master values and optimizer state of parameters without a gradient anywhere (restored after)."""
        for bucket in buckets:
            absent = self._absent.get(id(bucket))
            if not absent or bucket.master.grad is None:
                continue
            ranges = bucket.shard_ranges(absent)
            if not ranges:
                continue
            idx = torch.cat([torch.arange(a, b, device=bucket.master.device) for a, b in ranges])
            state = raw.state.get(bucket.master, {})
            saved: dict[str, Tensor | None] = {
                k: v[idx].clone() for k, v in state.items() if _is_shard_state(v, bucket)
            }
            if not state:
                saved = {"": None}  # the state does not exist yet: reset to fresh values after the step
            self._restore.append((bucket.group_index, bucket, ranges, bucket.master.detach()[idx].clone(), saved))

    @torch.no_grad()
    def _restore_absent(self, raw: Optimizer) -> None:
        for index, bucket, ranges, master, saved in self._restore:
            idx = torch.cat([torch.arange(a, b, device=bucket.master.device) for a, b in ranges])
            bucket.master.index_copy_(0, idx, master)
            state = raw.state.get(bucket.master, {})
            for k, v in state.items():
                if not _is_shard_state(v, bucket):
                    continue
                if k in saved and saved[k] is not None:
                    v.index_copy_(0, idx, saved[k])
                elif "" in saved:
                    fresh = _FRESH_STATE_FROM_GROUP.get(k)
                    v.index_fill_(0, idx, float(raw.param_groups[index][fresh]) if fresh else 0.0)
        self._restore = []

    def _handle_nonfinite(self, buckets: list[FlatBucket], bad_local: list[str]) -> None:
        names: list[Any] = [bad_local]
        if self.world_size > 1 and dist.is_initialized():
            names = [None] * self.world_size
            dist.all_gather_object(names, bad_local)
        report = "; ".join(f"rank {r}: {', '.join(n)}" for r, n in enumerate(names) if n)
        for b in buckets:
            b.zero_model_grads()
            b.master.grad = None
        if self.nonfinite_gradients == "raise":
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

    def _launch_weights(self, buckets: list[FlatBucket]) -> None:
        """qWD all-gather of every bucket, pipelined: bucket ``k + 1`` is quantised and sent while ``k`` is decoded.

        The buckets leave in forward order (the first layers' bucket first). With ``overlap_param_gather`` this
        returns at once and each module's forward waits for its own bucket(s) (:meth:`_before_forward`); otherwise
        it waits for all of them.
        """
        assert self.topology is not None and self._rng is not None
        futures = []
        self._covered = set()
        self._forward_started = False
        for index, bucket in sorted(enumerate(buckets), key=lambda item: self._forward_position(item[1])):
            stats = CommStats()  # merged into comm_stats by _wait_all_weights, on the training thread
            exchange = WeightExchange(
                bucket.model_flat, bucket.master.detach(), self.topology, self.weight_compression, self.weight_bits,
                self.weight_group_size, self.rounding, self._rng.child(len(buckets) + index), self._ops,
                stats, self.topology.world_group,
            )  # fmt: skip
            future = self._pipeline.submit(_no_grad(exchange.send), _no_grad(self._finish_weights(bucket, exchange)))
            self._weight_jobs[id(bucket)] = future
            self._weight_stats.append(stats)
            futures.append(future)
        if self.track_drift:
            self._drift_job = self._pipeline.submit(lambda: None, self._reduce_drift(futures))
        if not self._defer_weights:
            self._wait_all_weights()

    def _reduce_drift(self, futures: list[Any]) -> Callable[[], float]:
        """The all-reduce of the drift terms, on the second thread after every bucket is decoded (private group)."""

        def run() -> float:
            sq = torch.zeros(2, dtype=torch.float64, device=self.root_device)
            for future in futures:
                sq += future.result()
            group = self.topology.world_group if self.topology is not None else None
            if group is not None:
                dist.all_reduce(sq, group=group)
            return float(sq[0].sqrt() / sq[1].sqrt().clamp_min(1e-30))

        return run

    def _finish_weights(self, bucket: FlatBucket, exchange: WeightExchange) -> Callable[[], Tensor]:
        def run() -> Tensor:
            exchange.apply()
            bucket.store_to_params()
            sq = torch.zeros(2, dtype=torch.float64, device=self.root_device)
            if self.track_drift:
                mine = bucket.model_flat[bucket.lo : bucket.lo + bucket.shard_size].float()
                # vector_norm accumulates in float64 without a float64 copy (6.1 -> 0.9 ms per 0.8M values)
                sq[0] = torch.linalg.vector_norm(bucket.master.detach() - mine, dtype=torch.float64).square()
                sq[1] = torch.linalg.vector_norm(bucket.master.detach(), dtype=torch.float64).square()
            return sq

        return run

    def wait_for_weights(self) -> None:
        """Wait until every weight all-gather in flight has written the model's parameters (no collective).

        With ``overlap_param_gather`` the optimizer step returns before the new weights are in the model; a
        module's forward waits for its own parameters, and the strategy waits for all of them before validation,
        checkpoints, ``on_train_end`` and the next step. Call this in your own hooks that read the weights between
        the step and the next forward (e.g. ``on_train_batch_end``); it is cheap when nothing is in flight.
        """
        self._wait_all_weights()

    def _wait_all_weights(self) -> None:
        """Wait for every pending weight all-gather (and the drift all-reduce); re-raise the first error."""
        jobs, self._weight_jobs = self._weight_jobs, {}
        drift, self._drift_job = self._drift_job, None
        error: BaseException | None = None
        for future in [*jobs.values(), *([drift] if drift is not None else [])]:
            try:
                future.result()
            except BaseException as err:  # wait for all, then raise the first
                error = error or err
        stats, self._weight_stats = self._weight_stats, []
        for one in stats:
            self.comm_stats.merge(one)
        if error is not None:
            raise error
        if drift is not None:
            self.weight_drift = drift.result()

    def _wait_quietly(self) -> None:
        """:meth:`_wait_all_weights` on a path that is already failing or ending: log an error, do not raise."""
        try:
            self._wait_all_weights()
        except Exception:  # the original error (or none, at teardown) is what the user must see
            log.exception("SDP4BitStrategy: a weight all-gather in flight failed")

    def _index_params(self) -> None:
        """Map parameters to their buckets and forward positions; hook every module that holds a bucketed one."""
        module = self.lightning_module
        if module is None:
            return
        self._weight_bucket_of = {id(p): b for bs in self._buckets.values() for b in bs for p in b.params}
        self._param_position = {id(p): i for i, p in enumerate(module.parameters())}
        if not self._defer_weights:
            return
        for sub in module.modules():
            if id(sub) in self._hooked_modules:
                continue
            if any(id(p) in self._weight_bucket_of for p in sub.parameters(recurse=False)):
                self._forward_hooks.append(sub.register_forward_pre_hook(self._before_forward))
                self._hooked_modules.add(id(sub))

    def _forward_position(self, bucket: FlatBucket) -> int:
        return min((self._param_position.get(id(p), len(self._param_position)) for p in bucket.params), default=0)

    def _before_forward(self, module: Module, args: Any) -> None:
        """Forward pre-hook: wait for the bucket(s) holding this module's own parameters (not its children's)."""
        params = [p for p in module._parameters.values() if p is not None]
        self._covered.update(id(p) for p in params)
        if not self._weight_jobs:
            return
        if not self._forward_started:
            self._forward_started = True
            self.weight_gathers_pending_at_forward += sum(not f.done() for f in self._weight_jobs.values())
        for p in params:
            bucket = self._weight_bucket_of.get(id(p))
            if bucket is not None:
                self._wait_bucket(bucket)

    def _wait_bucket(self, bucket: FlatBucket) -> None:
        future = self._weight_jobs.pop(id(bucket), None)
        if future is None:
            return
        if not future.done():
            self.forward_waits_for_weights += 1
        future.result()

    def _note_uncovered(self) -> None:
        """Buckets of parameters that got a gradient without their module's forward running first are "eager".

        Such a parameter was read outside a hooked forward (e.g. ``self.weight`` used directly in
        ``training_step``, or a module's parameter read by its parent): from now on its bucket is waited for at the
        start of every ``training_step``. Found in the first step, where nothing is in flight yet.
        """
        if not self._defer_weights:
            return
        new = []
        for buckets in self._buckets.values():
            for bucket in buckets:
                if id(bucket) in self._eager:
                    continue
                names = [
                    n for p, n in zip(bucket.params, bucket.names, strict=True)
                    if p.grad is not None and id(p) not in self._covered
                ]  # fmt: skip
                if names:
                    self._eager[id(bucket)] = bucket
                    new.extend(names)
        if new and self._step > 0:
            rank_zero_warn(
                f"SDP4BitStrategy: the parameters {new} were used outside the forward of the module that holds them "
                "after the weight all-gather had been overlapped with the forward; from now on their buckets are "
                "gathered before each training_step. If this step read them stale, pass "
                "`overlap_param_gather=False`."
            )

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
        grads = [b.master.grad for b in buckets if b.master.grad is not None]
        if kind == "value":
            for g in grads:
                g.clamp_(-clip_val, clip_val)
            return True
        sq = torch.zeros(1, dtype=torch.float32, device=self.root_device)
        for g in grads:
            sq += g.pow(2).sum()
        total = all_reduce_sum(sq).sqrt()
        coef = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
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
        self._wait_all_weights()
        norm_type = float(norm_type)
        if norm_type <= 0:
            raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
        wanted = {id(p): n for n, p in module.named_parameters()}
        names: list[str] = []
        parts: list[Tensor] = []
        for buckets in self._buckets.values():
            for bucket in buckets:
                grad = bucket.master.grad
                if grad is None:
                    continue
                absent = set(self._absent.get(id(bucket), []))
                for i, p in enumerate(bucket.params):
                    if i in absent or id(p) not in wanted:
                        continue
                    names.append(wanted[id(p)])
                    ranges = bucket.shard_ranges([i])
                    values = grad[ranges[0][0] : ranges[0][1]].double().abs() if ranges else grad.new_zeros(0).double()
                    if math.isinf(norm_type):
                        parts.append(values.max() if values.numel() else values.new_zeros(()))
                    else:
                        parts.append(values.pow(norm_type).sum())
        if not names:
            return {}
        local = torch.stack(parts).to(self.root_device)
        if self.world_size > 1 and dist.is_initialized():
            dist.all_reduce(local, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
        norms = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
        out = {f"grad_{norm_type}_norm{group_separator}{n}": v.float() for n, v in zip(names, norms, strict=True)}
        out[f"grad_{norm_type}_norm_total"] = torch.tensor([float(v) for v in norms.float()]).norm(norm_type)
        return out

    def _log_metrics(self) -> None:
        module = self.lightning_module
        if module is None or getattr(module, "_trainer", None) is None:
            return
        stats = self.comm_stats
        metrics = {
            "sdp4bit/weight_bits_per_element": stats.bits_per_element("weight"),
            "sdp4bit/grad_bits_per_element_intra": stats.bits_per_element("grad_intra"),
            "sdp4bit/grad_bits_per_element_inter": stats.bits_per_element("grad_inter"),
            "sdp4bit/bytes_per_step": float(stats.bytes_per_step),
            "sdp4bit/skipped_steps": float(self.skipped_steps),
        }
        if isinstance(self._ops, TimedOps):
            metrics["sdp4bit/codec_ms"] = 1e3 * stats.codec_seconds
        if self.track_drift and not math.isnan(self.weight_drift):
            metrics["sdp4bit/weight_drift"] = self.weight_drift
        module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    # ------------------------------------------------------------------------------------------------ checkpoints

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """Consolidated, world-size-independent state keyed like the unsharded optimizer (a collective)."""
        self._wait_all_weights()
        buckets = self._buckets_of(optimizer)
        if buckets is None:
            return super().optimizer_state(optimizer)
        raw = unwrap_optimizer(optimizer)
        self._sync_groups(raw, buckets)
        extra = {"step": self._step, "skipped_steps": self.skipped_steps, "world_size": self.world_size}
        return consolidate_state(raw, buckets, extra)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Cut the consolidated state for this world size; set every rank's weights to the exact master weights."""
        self._wait_all_weights()
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"The checkpoint holds {len(states)} optimizer states, the model configures {len(self.optimizers)}."
            )
        for opt, state in zip(self.optimizers, states, strict=True):
            buckets = self._buckets_of(opt)
            if buckets is None:
                opt.load_state_dict(state)
                continue
            raw = unwrap_optimizer(opt)
            self._sync_groups(raw, buckets)
            load_consolidated_state(raw, buckets, state)
            extra = state.get("sdp4bit", {})
            self._step = int(extra.get("step", self._step))
            self.skipped_steps = int(extra.get("skipped_steps", self.skipped_steps))
            with torch.no_grad():
                for bucket in buckets:
                    bucket.model_flat.copy_(bucket.full_master())
                    bucket.store_to_params()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state dict with the exact (consolidated) master weights in place of the reconstructed ones."""
        assert self.lightning_module is not None
        self._wait_all_weights()
        state = self.lightning_module.state_dict()
        if not self._buckets:
            return state
        aliases: dict[int, list[str]] = {}
        for name, param in self.lightning_module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(name)
        for buckets in self._buckets.values():
            for bucket in buckets:
                full = bucket.full_master()
                for p, view in zip(bucket.params, bucket.views(full), strict=True):
                    for name in aliases.get(id(p), []):
                        if name in state:
                            state[name] = view.to(state[name].dtype).clone()
        return state

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """As DDP, after any weight all-gather in flight (it would overwrite the loaded weights)."""
        self._wait_all_weights()
        super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Wait for the buckets whose parameters are read outside their module's forward, then as DDP."""
        for bucket in self._eager.values():
            self._wait_bucket(bucket)
        return super().training_step(*args, **kwargs)

    @override
    def on_train_start(self) -> None:
        self._covered = set()  # forwards of the sanity check do not count
        super().on_train_start()

    @override
    def on_validation_start(self) -> None:
        self._wait_all_weights()
        super().on_validation_start()

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
        for handle in [*self._hooks.values(), *self._forward_hooks]:
            handle.remove()
        self._hooks = {}
        self._forward_hooks, self._hooked_modules = [], set()
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
        return [b for buckets in self._buckets.values() for b in buckets]

    def master_shards(self, optimizer: Optimizer) -> list[Tensor]:
        """The fp32 master shards of ``optimizer``'s param groups on this rank (what the optimizer steps)."""
        self._wait_all_weights()
        buckets = self._buckets_of(optimizer)
        if buckets is None:
            raise ValueError("This optimizer is not sharded by SDP4BitStrategy.")
        return [b.master for b in buckets]


def grad_norm(
    module: Module, norm_type: float | int | str, group_separator: str = "/", strategy: Any = None
) -> dict[str, Tensor]:
    """Drop-in for :func:`lightning.pytorch.utilities.grad_norm` that also works under :class:`SDP4BitStrategy`.

    SDP4Bit reduces the gradients into flat shards and drops the parameters' ``.grad`` before
    ``on_before_optimizer_step``; this returns the norms of the reduced gradients (what DDP's ``.grad`` holds), with
    the same keys. Under any other strategy it calls Lightning's ``grad_norm``. Under SDP4Bit it is a collective:
    call it on every rank (hooks run on every rank).

    Args:
        module: the module to report (usually ``self`` in a LightningModule hook).
        norm_type: the p of the p-norm; ``"inf"`` for the max norm.
        group_separator: separator in the keys (default ``"/"``).
        strategy: the strategy; default ``module.trainer.strategy`` for a LightningModule.
    """
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    if strategy is None:
        trainer = getattr(module, "_trainer", None)
        strategy = getattr(trainer, "strategy", None)
    if isinstance(strategy, SDP4BitStrategy) and strategy._buckets:
        return strategy.grad_norm(module, norm_type, group_separator)
    # Lightning annotates its values as ``float`` but returns 0-dim tensors (``p.grad.norm(...)``), as we do
    return cast(dict[str, Tensor], lightning_grad_norm(module, norm_type, group_separator))


class _GradJob:
    """One bucket's gradient exchange in flight: its result, its checks, and what it was launched with."""

    def __init__(self, bucket: FlatBucket, exchange: GradientExchange) -> None:
        self.bucket = bucket
        self.exchange = exchange
        self.future: Any = None
        self.checked = threading.Event()
        self.finite = True
        self.overflow: list[str] = []
        # the gradient tensors and their version counters when the bucket was copied
        self.launched = [(p.grad, p.grad._version) if p.grad is not None else None for p in bucket.params]

    def dirty(self) -> bool:
        """Whether a gradient of the bucket was replaced or edited in place after the bucket was launched."""
        for p, seen in zip(self.bucket.params, self.launched, strict=True):
            if seen is None:
                if p.grad is not None:
                    return True
            elif p.grad is not seen[0] or p.grad._version != seen[1]:
                return True
        return False


def _all_finite(tensor: Tensor) -> bool:
    """Whether every value is finite, in one pass: min and max are NaN when any value is NaN, and +-inf shows in
    them (``torch.isfinite(t).all()`` makes three passes and a bool tensor: 6.5 ms against 0.5 ms for 3.2M values)."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def _no_grad(fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with torch.no_grad():
            return fn()

    return run


def _is_shard_state(value: Any, bucket: FlatBucket) -> bool:
    return isinstance(value, Tensor) and value.dim() == 1 and value.numel() == bucket.shard_size


def _check_ints(**values: Any) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"SDP4BitStrategy: {name} must be an int, got {value!r} ({type(value).__name__}).")


# When this module is what first imports lightning.pytorch, the import hook ran before the class existed.
register_class_aliases(SDP4BitStrategy)
