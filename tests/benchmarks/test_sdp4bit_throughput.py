"""Pieces of ``benchmarks/sdp4bit_throughput.py`` that can be checked without the emulated cluster."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from benchmarks.sdp4bit_throughput import _expected_node_egress, _hooked_ddp_strategy
from tests._distributed import run_distributed

_CALLS: list[str] = []


def _counting_fp16_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations only
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    _CALLS.append("fp16")
    return fp16_compress_hook(state, bucket)


def _fit_with_hooks(rank: int, world: int) -> dict[str, int]:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import DDPStrategy

    calls = {}
    strategies = {
        "lightning": DDPStrategy(ddp_comm_hook=_counting_fp16_hook, process_group_backend="gloo"),
        "benchmark": _hooked_ddp_strategy(_counting_fp16_hook, lambda: None, timedelta(seconds=120)),
    }
    for name, strategy in strategies.items():
        _CALLS.clear()
        trainer = pl.Trainer(
            strategy=strategy, accelerator="cpu", devices=world, max_steps=2, limit_val_batches=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(BoringModel())
        calls[name] = len(_CALLS)
    return calls


def test_ddp_comm_hook_runs_on_cpu_gloo() -> None:
    # Lightning's DDPStrategy(ddp_comm_hook=...) registers the hook only on CUDA: on a CPU it is silently skipped.
    # The benchmark's DDP peers register it themselves, so fp16/bf16/PowerSGD act on gloo too.
    for calls in run_distributed(_fit_with_hooks, 2, init_group=False, timeout=300):
        assert calls["lightning"] == 0
        assert calls["benchmark"] >= 2  # at least one bucket per step


def test_expected_node_egress_counts_inter_all_to_all_and_one_ring_edge() -> None:
    # two ranks of one node; each sent 100 bytes of its weight shard to the 3 others (300) and 40 across nodes
    ranks = [{"weight": 300.0, "grad_inter": 40.0, "grad_intra": 50.0}] * 2
    assert _expected_node_egress(ranks) == 300.0 + 2 * 40.0
