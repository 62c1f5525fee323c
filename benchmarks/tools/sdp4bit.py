"""The methods the SDP4Bit benchmarks compare: a table from each method's name to the strategy arguments it runs
with, and the module and strategy of each (DDP with its compression hooks, ZeRO + DDP, FSDP2, SDP4Bit)."""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

# SDP4BitStrategy's arguments per method (every other argument keeps the strategy's default)
_PAPER = {"weight_compression": "qwd", "gradient_compression": "tlq_hs"}


_UNCOMPRESSED = {"weight_compression": "none", "gradient_compression": "none"}


SDP4BIT_METHODS: dict[str, dict[str, Any]] = {
    "sdp4bit_auto": {},
    "sdp4bit_auto_shard": {"optimizer_state": "shard"},
    "sdp4bit_none_none": _UNCOMPRESSED,
    "sdp4bit_qwd_tlq_hs": _PAPER,
    "sdp4bit_qwd_none": {"weight_compression": "qwd", "gradient_compression": "none"},
    "sdp4bit_none_tlq_hs": {"weight_compression": "none", "gradient_compression": "tlq_hs"},
    "sdp4bit_qwd_tlq_hs_g8": {**_PAPER, "gradient_inter_bits": 8},
    "sdp4bit_none_tlq_hs_g8": {
        "weight_compression": "none",
        "gradient_compression": "tlq_hs",
        "gradient_inter_bits": 8,
    },
    "sdp4bit_qw_ulq": {"weight_compression": "qw", "gradient_compression": "ulq"},
    "sdp4bit_none_none_sequential": {**_UNCOMPRESSED, "overlap": False},
    "sdp4bit_qwd_tlq_hs_sequential": {**_PAPER, "overlap": False},
    "sdp4bit_none_none_fwd": {**_UNCOMPRESSED, "overlap_param_gather": True},
    "sdp4bit_qwd_tlq_hs_fwd": {**_PAPER, "overlap_param_gather": True},
    "sdp4bit_qwd_tlq_hs_torchcodec": {**_PAPER, "kernel_backend": "torch"},
    "sdp4bit_none_none_onebucket": {**_UNCOMPRESSED, "bucket_size_mb": None},
    "sdp4bit_qwd_tlq_hs_onebucket": {**_PAPER, "bucket_size_mb": None},
    "sdp4bit_auto_autobucket": {"bucket_size_mb": "auto"},
    "sdp4bit_qwd_tlq_hs_autobucket": {**_PAPER, "bucket_size_mb": "auto"},
    "sdp4bit_none_none_autobucket": {**_UNCOMPRESSED, "bucket_size_mb": "auto"},
}


METHODS = ["ddp", "ddp_fp16", "ddp_bf16", "powersgd_r1", "powersgd_r4", "zero_ddp", "fsdp2", *SDP4BIT_METHODS]


def hooked_ddp_strategy(hook: Any, state_factory: Any, timeout: timedelta, **ddp_kwargs: Any) -> Any:
    """A DDPStrategy that registers a DDP communication hook on any device (Lightning's does so only on CUDA)."""
    from lightning.pytorch.strategies import DDPStrategy

    class _HookedDDPStrategy(DDPStrategy):
        def _register_ddp_hooks(self) -> None:
            if hook is not None:
                self.model.register_comm_hook(state_factory(), hook)

    return _HookedDDPStrategy(process_group_backend="gloo", timeout=timeout, **ddp_kwargs)


def build_method(method: str, args: argparse.Namespace, vocab_size: int) -> tuple[Any, Any]:
    """The LightningModule and the strategy of ``method``."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from lightning_sdp.models.gpt import GPT

    timeout = timedelta(seconds=args.pg_timeout)
    hp = dict(
        vocab_size=vocab_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block,
        learning_rate=args.lr, warmup_steps=args.warmup_lr, max_steps=args.steps,
    )  # fmt: skip
    if method == "ddp":
        return GPT(**hp), hooked_ddp_strategy(None, None, timeout)
    if method in ("ddp_fp16", "ddp_bf16"):
        hook = default_hooks.fp16_compress_hook if method == "ddp_fp16" else default_hooks.bf16_compress_hook
        return GPT(**hp), hooked_ddp_strategy(hook, lambda: None, timeout)
    if method.startswith("powersgd_r"):
        rank = int(method.removeprefix("powersgd_r"))

        def state() -> Any:
            return powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                use_error_feedback=True, warm_start=True, random_seed=args.seed,
            )  # fmt: skip

        # One bucket: PowerSGD's hook issues its P and Q all-reduces from future callbacks; on gloo, several
        # buckets' callbacks then interleave in a different order on different ranks (collective mismatch, abort).
        return GPT(**hp), hooked_ddp_strategy(powerSGD_hook.powerSGD_hook, state, timeout, bucket_cap_mb=1024)
    if method == "zero_ddp":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        class ZeroGPT(GPT):
            def configure_optimizers(self) -> Any:
                # GPT's own AdamW param groups and LR schedule, with the AdamW state sharded by ZeRO
                config = super().configure_optimizers()
                plain, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"].lr_lambdas[0]
                optimizer = ZeroRedundancyOptimizer(
                    [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in plain.param_groups],
                    optimizer_class=torch.optim.AdamW, lr=plain.defaults["lr"], betas=plain.defaults["betas"],
                )  # fmt: skip
                scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
                return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        return ZeroGPT(**hp), hooked_ddp_strategy(None, None, timeout)
    if method == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy
        from torch.distributed.fsdp import fully_shard

        class FSDP2GPT(GPT):
            def configure_model(self) -> None:
                mesh = self.device_mesh["data_parallel"]
                for block in self.transformer.h:
                    fully_shard(block, mesh=mesh)
                fully_shard(self, mesh=mesh)

        strategy = ModelParallelStrategy(data_parallel_size=args.world, tensor_parallel_size=1, timeout=timeout)
        return FSDP2GPT(**hp), strategy
    if method in SDP4BIT_METHODS:
        from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy

        strategy = SDP4BitStrategy(seed=args.seed, timeout=timeout, **SDP4BIT_METHODS[method])
        return GPT(**hp), strategy
    raise ValueError(f"Unknown method {method!r}; choose from {METHODS}.")
