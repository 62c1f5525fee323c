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
    gradient_format,
    reduce_scatter_gradients,
)
from lightning_sdp.plugins.sdp4bit.sharding import (
    FlatBucket,
    all_reduce_sum,
    consolidate_state,
    load_consolidated_state,
    shard_optimizer,
)
from lightning_sdp.plugins.sdp4bit.topology import Topology, build_topology

log = logging.getLogger(__name__)

_SUPPORTED_PRECISION = ("32-true", "32", "bf16-mixed", "bf16-true")


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
        if hadamard_size < 1 or hadamard_size & (hadamard_size - 1):
            raise ValueError(f"hadamard_size must be a power of two, got {hadamard_size}.")
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
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        self._buckets = {}
        for opt in self.optimizers:
            raw = opt._optimizer if isinstance(opt, LightningOptimizer) else opt
            self._buckets[id(raw)] = shard_optimizer(
                raw, names, self.world_size, self.global_rank, self.alignment
            )
        # Global-norm clipping across shards (Lightning clips through the precision plugin).
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]

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
        self._rng.reset(self._step)
        self.comm_stats.new_step()
        self._skip_current = False

        def closure_with_exchange() -> Any:
            result = closure()
            self._exchange_gradients(buckets)
            return result

        model = model or self.lightning_module
        output = self.precision_plugin.optimizer_step(
            optimizer, model=model, closure=closure_with_exchange, **kwargs
        )
        if not self._skip_current:
            self._exchange_weights(buckets)
        self._step += 1
        self._log_metrics()
        return output

    def _exchange_gradients(self, buckets: list[FlatBucket]) -> None:
        assert self.topology is not None and self._rng is not None
        flats = [b.gather_grads() for b in buckets]
        bad_local = [name for b in buckets for name in b.non_finite_names()]
        flag = all_reduce_sum(torch.tensor([float(len(bad_local))], device=self.root_device))
        if flag.item() > 0:
            self._handle_nonfinite(buckets, bad_local)
            return
        world = self.world_size
        for bucket, flat in zip(buckets, flats, strict=True):
            flat.div_(world)
            shard = reduce_scatter_gradients(
                flat, self.topology, self.gradient_format, self.gradient_group_size, self.rounding, self._rng,
                self._ops, self.comm_stats,
            )  # fmt: skip
            bucket.master.grad = shard
            bucket.zero_model_grads()

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
        """``clip_grad_norm_`` over the whole model: the norm of all shards, all-reduced across ranks."""
        buckets = self._buckets_of(optimizer)
        if buckets is None:
            Precision.clip_grad_by_norm(self.precision_plugin, optimizer, clip_val)
            return
        grads = [b.master.grad for b in buckets if b.master.grad is not None]
        sq = torch.zeros(1, dtype=torch.float32, device=self.root_device)
        for g in grads:
            sq += g.pow(2).sum()
        total = all_reduce_sum(sq).sqrt()
        coef = torch.clamp(float(clip_val) / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)

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



# When this module is what first imports lightning.pytorch, the import hook ran before the class existed.
register_class_aliases(SDP4BitStrategy)
