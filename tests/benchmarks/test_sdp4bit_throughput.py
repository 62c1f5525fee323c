"""Pieces of ``benchmarks/sdp4bit_throughput.py`` that can be checked without the emulated cluster.

The ``--quick`` sweep itself needs root and network namespaces (see ``tests/benchmarks/test_network_tool.py``);
here the worker side of it (one method's run, timing and byte accounting) runs in 2 plain gloo processes.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from benchmarks.sdp4bit_throughput import (
    _expected_node_egress,
    _parser,
    _run_method,
    chain_limit,
    machine_limit,
    merge_rounds,
    round_resolution,
    summarise,
)
from benchmarks.tools.sdp4bit import hooked_ddp_strategy
from tests._distributed import run_distributed

pytestmark = pytest.mark.bench

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
        "benchmark": hooked_ddp_strategy(_counting_fp16_hook, lambda: None, timedelta(seconds=120)),
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


@pytest.mark.slow
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
    # two-stage all-gather: each rank's inter-node stage leaves the node, the intra-node stage does not
    ranks = [{"weight_inter": 100.0, "weight_intra": 200.0, "grad_inter": 40.0}] * 2
    assert _expected_node_egress(ranks) == 2 * 100.0 + 2 * 40.0


def test_machine_limit_is_the_larger_of_ddp_cpu_work_and_the_methods_own_wire_time() -> None:
    ddp = {"cpu_s_per_step_per_rank": 0.2, "median_step_s": 1.8, "wire_bytes_per_step_per_node": 20e6}
    # 4 ranks on 2 cores: DDP's arithmetic allows 0.4 s; 1.25 MB at 100 Mbit/s is 0.1 s on the wire
    fast_wire = {"median_step_s": 0.5, "wire_bytes_per_step_per_node": 1.25e6}
    assert machine_limit(fast_wire, ddp, 100.0, 4, 2) == pytest.approx((0.4, 0.8))
    # 12.5 MB at 50 Mbit/s is 2 s: the link, not the cores, is the limit
    slow_link = {"median_step_s": 2.5, "wire_bytes_per_step_per_node": 12.5e6}
    assert machine_limit(slow_link, ddp, 50.0, 4, 2) == pytest.approx((2.0, 0.8))
    assert machine_limit(ddp, ddp, 100.0, 4, 2)[0] == pytest.approx(1.6)  # DDP itself: its 20 MB take 1.6 s
    assert all(math.isnan(x) for x in machine_limit(fast_wire, None, 100.0, 4, 2))  # no DDP run: no limit
    assert all(math.isnan(x) for x in machine_limit({"median_step_s": 0.5}, ddp, 100.0, 4, 2))


def test_chain_limit_counts_forward_the_first_buckets_backward_the_wire_and_the_last_exchange() -> None:
    ddp = {"cpu_s_per_step_per_rank": 0.1, "median_step_s": 1.0}  # 4 ranks on 2 cores: 0.2 s CPU-bound
    row = {
        "median_step_s": 0.5,
        "wire_bytes_per_step_per_node": 1.25e6,  # 0.1 s at 100 Mbit/s
        "cpu_s_per_step_by_thread": {"main": 0.05, "gloo": 0.02, "other": 0.08},
        "profile": {"forward_s": 0.1, "backward_s": 0.2, "first_bucket_share": 0.25, "last_bucket_share": 0.5},
    }
    # 0.1 forward + 0.2 x 0.25 of backward + 0.1 on the wire + (0.02 + 0.08) x 0.5 of the exchange work = 0.3 s
    assert chain_limit(row, ddp, 100.0, 4, 2) == pytest.approx((0.3, 0.6))
    # the first bucket's backward as measured (from backward's start to its last gradient) replaces the estimate
    timed = {**row, "profile": {**row["profile"], "first_bucket_backward_s": 0.01}}
    assert chain_limit(timed, ddp, 100.0, 4, 2)[0] == pytest.approx(0.26)
    fast = {**row, "wire_bytes_per_step_per_node": 0.0, "profile": {**row["profile"], "forward_s": 0.0}}
    assert chain_limit(fast, ddp, 100.0, 4, 2)[0] == pytest.approx(0.2)  # DDP's CPU-bound step is the floor
    no_buckets = {**row, "profile": {**row["profile"], "first_bucket_share": None}}
    assert all(math.isnan(x) for x in chain_limit(no_buckets, ddp, 100.0, 4, 2))
    assert all(math.isnan(x) for x in chain_limit(row, None, 100.0, 4, 2))


def _run_methods(rank: int, world: int, data: str, methods: list[str]) -> list[dict[str, Any]]:
    import warnings

    warnings.filterwarnings("ignore")
    args = _parser().parse_args(
        ["--data", data, "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block", "16", "--batch", "2",
         "--warmup", "1", "--warmup-lr", "1", "--val-batches", "1", "--nodes", "1", "--nproc", str(world)]
    )  # fmt: skip
    args.world = world
    rows = []
    for method in methods:
        row = _run_method(method, 1000.0, steps=4, validate=True, args=args)
        rows.append(
            {
                k: row[k]
                for k in (
                    "method",
                    "median_step_s",
                    "tokens_per_s",
                    "val_loss",
                    "train_losses_rank0",
                    "wire_bytes_per_step_per_node",
                    "accounted_inter_bytes_per_step_per_node",
                    "cpu_s_per_step_per_rank",
                    "cpu_s_per_step_by_thread",
                    "profile",
                )
            }
        )
    return rows


@pytest.mark.slow
def test_worker_runs_zero_and_sdp4bit_and_accounts_sdp4bit_bytes(tmp_path: Path) -> None:
    data = tmp_path / "input.txt"
    data.write_text("".join(chr(97 + (i * 7) % 26) + (" " if i % 5 == 0 else "") for i in range(4000)))
    results = run_distributed(
        _run_methods, 2, str(data), ["zero_ddp", "sdp4bit_qwd_tlq_hs"], init_group=False, timeout=300
    )
    for row in results[0]:
        assert row["median_step_s"] > 0 and row["tokens_per_s"] == 2 * 16 * 2 / row["median_step_s"]
        assert len(row["train_losses_rank0"]) == 4 and math.isfinite(row["val_loss"])
        assert row["wire_bytes_per_step_per_node"] is None  # no shaped interface outside the emulated cluster
        assert row["cpu_s_per_step_per_rank"] > 0
        split = row["cpu_s_per_step_by_thread"]
        assert set(split) == {"main", "gloo", "other"} and split["main"] > 0
        # the threads' clock ticks (10 ms over 3 timed steps) add up to the process's CPU time
        assert sum(split.values()) == pytest.approx(row["cpu_s_per_step_per_rank"], abs=0.03)
    zero, sdp4bit = results[0]
    for row in results[0]:  # the dependency chain's profile: forward, backward, the buckets' shares
        profile = row["profile"]
        assert profile["forward_s"] > 0 and profile["backward_s"] > 0
        # from backward's start to the first bucket's last gradient (DDP's first 1 MiB, SDP4Bit's first bucket)
        assert 0 < profile["first_bucket_backward_s"] <= profile["backward_s"]
        assert 0 < profile["first_bucket_share"] <= 1 and 0 < profile["last_bucket_share"] <= 1
    assert zero["accounted_inter_bytes_per_step_per_node"] is None  # only SDP4Bit keeps its own accounting
    assert sdp4bit["accounted_inter_bytes_per_step_per_node"] > 0  # one node: the weight all-gather's ring edge


def _run_auto(rank: int, world: int, data: str) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")
    args = _parser().parse_args(
        ["--data", data, "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block", "16", "--batch", "2",
         "--warmup", "1", "--warmup-lr", "1", "--nodes", "1", "--nproc", str(world)]
    )  # fmt: skip
    args.world = world
    return _run_method("sdp4bit_auto", 1000.0, steps=4, validate=False, args=args)


@pytest.mark.slow
def test_auto_is_timed_after_its_decision(tmp_path: Path) -> None:
    data = tmp_path / "input.txt"
    data.write_text("".join(chr(97 + (i * 5) % 26) + (" " if i % 4 == 0 else "") for i in range(4000)))
    row = run_distributed(_run_auto, 2, str(data), init_group=False, timeout=300)[0]
    decided = row["auto_decided_at_step"]
    assert decided is not None and row["auto_choice"] != "undecided"
    # one node: {qwd, none} x {8-bit, fp32}, and DDP's exchange
    assert len(row["auto_measured"]) + len(row["auto_skipped"]) == 5
    assert row["timed_steps"] == 3  # the timing run's 4 steps less 1 of warm-up, all after the decision
    assert row["steps"] == decided + 2 + 3  # then training stopped
    assert math.isfinite(row["auto_trial_cost_s"])


def test_a_sweep_without_ddp_still_reports(tmp_path: Path) -> None:
    """The rows of the stored sweep without DDP (e.g. alternating auto and a fixed setting): no ratios, no crash."""
    stored = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "sdp4bit_throughput.json"
    if not stored.exists():
        pytest.skip("no stored sweep")
    payload = json.loads(stored.read_text())
    args = _parser().parse_args([])
    vars(args).update(payload["args"])
    args.methods = [m for m in args.methods if m != "ddp"]
    rows = [r for r in payload["rows"] if r["method"] != "ddp"]
    out, md, fig = summarise(rows, args)
    assert "sdp4bit_auto" in md and fig is not None
    assert all(math.isnan(v) for row in out["speedups"] for k, v in row.items() if k != "method")


def test_rounds_merge_into_medians_and_keep_the_first_rounds_quality() -> None:
    def row(method: str, round_: int, step: float, cpu: float) -> dict[str, Any]:
        return {"method": method, "bandwidth_mbit": 100.0, "round": round_, "median_step_s": step,
                "tokens_per_s": 1024 / step, "cpu_s_per_step_per_rank": cpu, "wire_bytes_per_step_per_node": 1e6,
                "val_loss": 2.5 if round_ == 0 else None}  # fmt: skip

    steps, cpus = [0.5, 0.9, 0.6], [0.2, 0.1, 0.4]
    rows = [row("ddp", r, s, c) for r, (s, c) in enumerate(zip(steps, cpus, strict=True))]
    for r, gloo in zip(rows, [0.01, 0.03, 0.02], strict=True):
        r["cpu_s_per_step_by_thread"] = {"main": r["cpu_s_per_step_per_rank"] - gloo, "gloo": gloo}
    rows += [row("sdp4bit_auto", 0, 0.3, 0.1)]
    merged = merge_rounds(rows[::-1])  # any arrival order
    ddp = merged[("ddp", 100.0)]
    assert ddp["median_step_s"] == 0.6 and ddp["cpu_s_per_step_per_rank"] == 0.2
    assert ddp["tokens_per_s"] == pytest.approx(1024 / 0.6)
    assert ddp["val_loss"] == 2.5 and ddp["round"] == 0  # the quality run is the first round's
    assert sorted(ddp["rounds_median_step_s"]) == sorted(steps)
    assert ddp["cpu_s_per_step_by_thread"] == pytest.approx({"main": 0.19, "gloo": 0.02})
    assert merged[("sdp4bit_auto", 100.0)]["median_step_s"] == 0.3


def test_resolution_scores_each_rounds_pick_on_the_other_rounds() -> None:
    steps = {"sdp4bit_a": [1.0, 1.2], "sdp4bit_b": [1.1, 1.0], "sdp4bit_auto": [0.1, 0.1]}
    rows = [
        {"method": m, "bandwidth_mbit": 100.0, "round": k, "median_step_s": t, "tokens_per_s": 1.0}
        for m, times in steps.items()
        for k, t in enumerate(times)
    ]
    by = merge_rounds(rows)
    row = round_resolution(by, ["sdp4bit_a", "sdp4bit_b"], 100.0)
    assert row["same setting, round vs round"] == pytest.approx(1.0 / 1.2)
    # round 0 picks a, which round 1 times at 1.2 against b's 1.0; round 1 picks b: 1.0 / 1.1 on round 0
    assert row["picked by one round, on another"] == pytest.approx(1.0 / 1.2)
    assert round_resolution(merge_rounds(rows[::2]), ["sdp4bit_a", "sdp4bit_b"], 100.0) == {}  # one round each


def test_method_names_map_to_strategy_arguments_through_the_table() -> None:
    from benchmarks.tools.sdp4bit import METHODS, SDP4BIT_METHODS, build_method

    args = _parser().parse_args([])
    args.world = 4
    _, strategy = build_method("sdp4bit_qwd_tlq_hs_onebucket", args, vocab_size=10)
    config = strategy.config
    assert (config.weight_compression, config.gradient_compression, config.bucket_size_mb) == ("qwd", "tlq_hs", None)
    _, strategy = build_method("sdp4bit_none_tlq_hs_g8", args, vocab_size=10)
    assert (strategy.config.weight_compression, strategy.config.gradient_inter_bits) == ("none", 8)
    assert build_method("sdp4bit_auto", args, vocab_size=10)[1].config.auto
    for method in SDP4BIT_METHODS:  # every entry is a valid set of options
        build_method(method, args, vocab_size=10)
    with pytest.raises(ValueError, match="Unknown method"):
        build_method("sdp4bit_qwd_tlq_hs_fast", args, vocab_size=10)  # no suffix parsing: unknown names are refused
    # every method of the stored result sets still runs
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    stored = set()
    for path in results.glob("sdp4bit_*.json"):
        payload = json.loads(path.read_text())
        if isinstance(payload.get("args"), dict) and "methods" in payload["args"]:
            stored |= {
                m for m in payload["args"]["methods"] if m.startswith(("ddp", "sdp4bit", "zero", "fsdp", "power"))
            }
    assert stored <= set(METHODS)
