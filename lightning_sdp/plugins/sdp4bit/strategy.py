"""``SDP4BitStrategy``: sharded data parallelism with 4-bit weight and gradient communication.

Jia et al., "SDP4Bit: Toward 4-bit Communication Quantization in Sharded Data Parallelism for LLM Training",
NeurIPS 2024 (arXiv 2410.15526).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
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
from lightning_sdp.plugins.sdp4bit.exchange import (
    GRADIENT_MODES,
    WEIGHT_MODES,
    CommStats,
    GradientCompression,
    RoundingRNG,
    TorchOps,
    TritonOps,
    WeightCompression,
    all_gather_weights,
    encode_gradients,
    first_level_bits,
    gradient_format,
    max_safe_scale,
    reduce_scatter_gradients,
)
from lightning_sdp.plugins.sdp4bit.sharding import (
    FlatBucket,
    all_reduce_sum,
    consolidate_state,
    load_consolidated_state,
    shard_group,
    shard_optimizer,
    use_shards,
)
from lightning_sdp.plugins.sdp4bit.topology import Topology, build_topology

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
        accelerator: see :class:`~lightning.pytorch.strategies.DDPStrategy`.
        parallel_devices: see ``DDPStrategy``.
        cluster_environment: see ``DDPStrategy``.
        checkpoint_io: see ``DDPStrategy``.
        precision_plugin: see ``DDPStrategy``.
        process_group_backend: ``"gloo"`` (CPU default) or ``"nccl"`` (CUDA default).
        timeout: process-group timeout.
        start_method: ``"popen"`` (default), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
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
        if weight_compression not in WEIGHT_MODES:
            raise ValueError(f"weight_compression must be one of {WEIGHT_MODES}, got {weight_compression!r}.")
        if gradient_compression not in GRADIENT_MODES:
            raise ValueError(
                f"gradient_compression must be one of {GRADIENT_MODES}, got {gradient_compression!r}."
            )
        for name, bits in (("weight_bits", weight_bits), ("gradient_intra_bits", gradient_intra_bits),
                           ("gradient_inter_bits", gradient_inter_bits)):  # fmt: skip
            if bits not in (4, 8):
                raise ValueError(f"{name} must be 4 or 8, got {bits}.")
        for name, size in (
            ("weight_group_size", weight_group_size),
            ("gradient_group_size", gradient_group_size),
        ):
            if size < 2 or size % 2:
                raise ValueError(
                    f"{name} must be a positive even number (two 4-bit codes per byte), got {size}."
                )
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
        # Hadamard blocks never straddle two parameters (a zero gradient stays exactly zero); off only to measure.
        self._align_hadamard_blocks = True
        # Per optimizer step: whether the shard gradients exist yet, clipping requested before that (manual
        # optimization), the shard ranges of parameters without a gradient on any rank, and what to restore there.
        self._exchanged = False
        self._pending_clip: dict[int, tuple[str, float]] = {}
        self._absent: dict[int, list[int]] = {}
        self._restore: list[tuple[int, FlatBucket, list[tuple[int, int]], Tensor, dict[str, Tensor | None]]] = []

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
        if self.gradient_format.hadamard and self.world_size > 1 and self._align_hadamard_blocks:
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
            raw = opt._optimizer if isinstance(opt, LightningOptimizer) else opt
            self._buckets[id(raw)] = shard_optimizer(
                raw, names, self.world_size, self.global_rank, self.alignment, self.param_alignment,
                self.allow_any_optimizer,
            )  # fmt: skip
            self._warn_padding(self._buckets[id(raw)])
        # Global-norm and value clipping on the shards (Lightning clips through the precision plugin).
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]
        self.precision_plugin.clip_grad_by_value = self._clip_grad_by_value  # type: ignore[method-assign]

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
        if len(groups) < len(buckets):
            raise ValueError(
                f"The optimizer had {len(buckets)} param groups when SDP4BitStrategy sharded it and now has "
                f"{len(groups)}: removing param groups during training is not supported (adding them is)."
            )
        for i, (group, bucket) in enumerate(zip(groups, buckets)):
            params = group["params"]
            if len(params) != len(bucket.params) or any(p is not q for p, q in zip(params, bucket.params)):
                raise ValueError(
                    f"The parameters of optimizer param group {i} changed after SDP4BitStrategy sharded it: editing "
                    "a group's 'params' during training is not supported. Add new parameters with "
                    "`optimizer.add_param_group(...)` instead."
                )
        if len(groups) == len(buckets):
            return
        names = self._param_names()
        for group in groups[len(buckets) :]:
            buckets.append(
                shard_group(group, names, self.world_size, self.global_rank, self.alignment, self.param_alignment)
            )

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
                    raise ValueError(
                        f"kernel_backend='triton' needs {name} to be a power of two, got {size}."
                    )
            return TritonOps()
        pow2 = all(s & (s - 1) == 0 for s in (self.weight_group_size, self.gradient_group_size))
        if self.root_device.type == "cuda" and _TRITON_AVAILABLE and pow2:
            return TritonOps()
        return TorchOps()

    # ------------------------------------------------------------------------------------------------ step

    def _buckets_of(self, optimizer: Any) -> list[FlatBucket] | None:
        raw = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
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
        buckets = self._buckets_of(optimizer)
        if buckets is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self._rng is not None
        raw = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        self._sync_groups(raw, buckets)
        self._rng.reset(self._step)
        self.comm_stats.new_step()
        self._skip_current = False
        self._absent = {}
        self._restore = []

        def closure_with_exchange() -> Any:
            result = closure()
            self._exchange_gradients(buckets)
            self._exchanged = True
            self._apply_pending_clip(raw)
            self._snapshot_absent(raw, buckets)
            return result

        model = model or self.lightning_module
        try:
            with use_shards(raw, buckets):
                output = self.precision_plugin.optimizer_step(
                    optimizer, model=model, closure=closure_with_exchange, **kwargs
                )
                self._restore_absent(raw)
        finally:
            self._exchanged = False
            self._pending_clip.pop(id(raw), None)
            for bucket in buckets:
                bucket.master.grad = None
        if not self._skip_current:
            self._exchange_weights(buckets)
        self._step += 1
        self._log_metrics()
        return output

    def _exchange_gradients(self, buckets: list[FlatBucket]) -> None:
        """Agree on NaN/overflow and on which parameters have a gradient (one all-reduce), then reduce-scatter."""
        assert self.topology is not None and self._rng is not None
        world = self.world_size
        flats = [b.gather_grads().div_(world) for b in buckets]
        bad_local = [name for b in buckets for name in b.non_finite_names()]
        encoded: list[tuple[Tensor, Tensor] | None] = [None] * len(buckets)
        fmt = self.gradient_format
        if fmt.quantized and world > 1 and not bad_local:
            # guard what is quantised (after the Hadamard transform): values whose sums would overflow fp32
            limit = max_safe_scale(first_level_bits(self.topology, fmt), world, fmt.hadamard)
            for i, (bucket, flat) in enumerate(zip(buckets, flats, strict=True)):
                encoded[i] = encode_gradients(
                    flat, self.topology, fmt, self.gradient_group_size, self.rounding, self._rng, self._ops
                )
                bad_local += self._overflow_names(bucket, encoded[i][1], limit)
        has_grad = torch.cat([b.has_grad_flags() for b in buckets])
        agreed = all_reduce_sum(torch.cat([torch.tensor([float(len(bad_local))]), has_grad]).to(self.root_device))
        if agreed[0].item() > 0:
            self._handle_nonfinite(buckets, bad_local)
            return
        counts = agreed[1:].cpu().split([len(b.params) for b in buckets])
        for bucket, flat, enc, count in zip(buckets, flats, encoded, counts, strict=True):
            bucket.zero_model_grads()
            absent = [i for i, c in enumerate(count.tolist()) if c == 0]
            if len(absent) == len(bucket.params):
                # no gradient on any rank: no shard gradient, so the optimizer leaves the group alone (as torch)
                bucket.master.grad = None
                continue
            shard = reduce_scatter_gradients(
                flat, self.topology, fmt, self.gradient_group_size, self.rounding, self._rng, self._ops,
                self.comm_stats, encoded=enc,
            )  # fmt: skip
            if absent:
                self._absent[id(bucket)] = absent
                for a, b in bucket.shard_ranges(absent):
                    shard[a:b].zero_()
            bucket.master.grad = shard

    def _overflow_names(self, bucket: FlatBucket, scales: Tensor, limit: float) -> list[str]:
        bad = ~(torch.isfinite(scales) & (scales <= limit))
        if not bool(bad.any()):
            return []
        qmax = 2 ** (first_level_bits(self.topology, self.gradient_format) - 1) - 1  # type: ignore[arg-type]
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
        for index, bucket in enumerate(buckets):
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
            self._restore.append((index, bucket, ranges, bucket.master.detach()[idx].clone(), saved))

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

    def _exchange_weights(self, buckets: list[FlatBucket]) -> None:
        assert self.topology is not None and self._rng is not None
        sq = torch.zeros(2, dtype=torch.float64, device=self.root_device)
        for bucket in buckets:
            with torch.no_grad():
                all_gather_weights(
                    bucket.model_flat, bucket.master.detach(), self.topology, self.weight_compression,
                    self.weight_bits, self.weight_group_size, self.rounding, self._rng, self._ops, self.comm_stats,
                )  # fmt: skip
                bucket.store_to_params()
                if self.track_drift:
                    mine = bucket.model_flat[bucket.lo : bucket.lo + bucket.shard_size].float()
                    sq[0] += (bucket.master.detach() - mine).double().pow(2).sum()
                    sq[1] += bucket.master.detach().double().pow(2).sum()
        if self.track_drift:
            all_reduce_sum(sq)
            self.weight_drift = float(sq[0].sqrt() / sq[1].sqrt().clamp_min(1e-30))

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """``clip_grad_norm_`` over the whole model: the norm of all shards, all-reduced across ranks.

        Called before the gradient exchange (``self.clip_gradients`` in manual optimization), it is applied to the
        reduced gradients as soon as they exist, inside ``optimizer.step()``.
        """
        buckets = self._buckets_of(optimizer)
        if buckets is None:
            Precision.clip_grad_by_norm(self.precision_plugin, optimizer, clip_val)
            return
        if not self._exchanged:
            self._pending_clip[id(_unwrap(optimizer))] = ("norm", float(clip_val))
            return
        grads = [b.master.grad for b in buckets if b.master.grad is not None]
        sq = torch.zeros(1, dtype=torch.float32, device=self.root_device)
        for g in grads:
            sq += g.pow(2).sum()
        total = all_reduce_sum(sq).sqrt()
        coef = torch.clamp(float(clip_val) / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)

    def _clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """``clip_grad_value_`` on the reduced shard gradients (deferred like :meth:`_clip_grad_by_global_norm`)."""
        buckets = self._buckets_of(optimizer)
        if buckets is None:
            Precision.clip_grad_by_value(self.precision_plugin, optimizer, clip_val)
            return
        if not self._exchanged:
            self._pending_clip[id(_unwrap(optimizer))] = ("value", float(clip_val))
            return
        for b in buckets:
            if b.master.grad is not None:
                b.master.grad.clamp_(-float(clip_val), float(clip_val))

    def _apply_pending_clip(self, raw: Optimizer) -> None:
        pending = self._pending_clip.pop(id(raw), None)
        if pending is None:
            return
        kind, value = pending
        if kind == "norm":
            self._clip_grad_by_global_norm(raw, value)
        else:
            self._clip_grad_by_value(raw, value)

    def grad_norm(
        self, module: Module, norm_type: float | int | str, group_separator: str = "/"
    ) -> dict[str, Tensor]:
        """Norms of the reduced gradients, keyed like :func:`lightning.pytorch.utilities.grad_norm` (a collective).

        Call it on every rank where the reduced gradients exist: in ``on_before_optimizer_step`` (or
        ``configure_gradient_clipping``). Parameters without a gradient on any rank are left out, as Lightning
        leaves out parameters whose ``.grad`` is ``None``.

        Args:
            module: the module whose parameters to report (names as in ``module.named_parameters()``).
            norm_type: the p of the p-norm; ``"inf"`` for the max norm.
            group_separator: separator between ``grad_{p}_norm`` and the parameter name.
        """
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
        if self.track_drift and not math.isnan(self.weight_drift):
            metrics["sdp4bit/weight_drift"] = self.weight_drift
        module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    # ------------------------------------------------------------------------------------------------ checkpoints

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """Consolidated, world-size-independent state keyed like the unsharded optimizer (a collective)."""
        buckets = self._buckets_of(optimizer)
        if buckets is None:
            return super().optimizer_state(optimizer)
        raw = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        self._sync_groups(raw, buckets)
        extra = {"step": self._step, "skipped_steps": self.skipped_steps, "world_size": self.world_size}
        return consolidate_state(raw, buckets, extra)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Cut the consolidated state for this world size; set every rank's weights to the exact master weights."""
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
            raw = opt._optimizer if isinstance(opt, LightningOptimizer) else opt
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
        state = self.lightning_module.state_dict()
        if not self._buckets:
            return state
        aliases: dict[int, list[str]] = {}
        for name, p in self.lightning_module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        for buckets in self._buckets.values():
            for bucket in buckets:
                full = bucket.full_master()
                for p, view in zip(bucket.params, bucket.views(full), strict=True):
                    for name in aliases.get(id(p), []):
                        if name in state:
                            state[name] = view.to(state[name].dtype).clone()
        return state


    @override
    def teardown(self) -> None:
        """Destroy the intra/inter-node process groups created at set-up (one set per ``fit``), then as DDP."""
        if self.topology is not None:
            self.topology.destroy()
        super().teardown()

    def master_shards(self, optimizer: Optimizer) -> list[Tensor]:
        """The fp32 master shards of ``optimizer``'s param groups on this rank (what the optimizer steps)."""
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
    return lightning_grad_norm(module, norm_type, group_separator)


def _unwrap(optimizer: Any) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _is_shard_state(value: Any, bucket: FlatBucket) -> bool:
    return isinstance(value, Tensor) and value.dim() == 1 and value.numel() == bucket.shard_size


def _check_ints(**values: Any) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"SDP4BitStrategy: {name} must be an int, got {value!r} ({type(value).__name__}).")


# When this module is what first imports lightning.pytorch, the import hook ran before the class existed.
register_class_aliases(SDP4BitStrategy)
