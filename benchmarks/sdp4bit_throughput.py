"""SDP4Bit against its peers on an emulated slow network: tokens/s, bytes on the wire and loss, side by side.

One run, 2 emulated nodes x 2 processes (network namespaces joined by a veth pair whose egress is shaped with
``tc tbf``, see ``benchmarks/tools/network.py``), the same char GPT (>= 3M parameters), data, seed and steps for
every method:

- ``ddp``: Lightning's DDPStrategy on gloo;
- ``ddp_fp16`` / ``ddp_bf16``: DDP with torch's ``fp16_compress_hook`` / ``bf16_compress_hook``;
- ``powersgd_r1`` / ``powersgd_r4``: DDP with torch's PowerSGD hook (rank 1 / 4, error feedback, warm start);
- ``zero_ddp``: DDP with torch's ``ZeroRedundancyOptimizer`` (AdamW state sharded, parameters broadcast);
- ``fsdp2``: ``fully_shard`` (per Transformer block and the root) through Lightning's ModelParallelStrategy;
- ``sdp4bit_auto``: SDP4BitStrategy's default, ``"auto"`` compression (timed from its decision on; the steps it
  spent trying candidates are reported apart, with their cost spread over the re-check interval);
  ``sdp4bit_auto_shard``: the same with ``optimizer_state="shard"`` (DDP's exchange is not a candidate);
- ``sdp4bit_none_none``, ``sdp4bit_qwd_tlq_hs``, ``sdp4bit_qw_ulq``, ``sdp4bit_qwd_none``,
  ``sdp4bit_none_tlq_hs``: SDP4BitStrategy with fixed weights/gradients formats; ``..._g8``: TLq-HS with 8 bits
  between nodes too (with the others, every format ``"auto"`` may choose);
  ``..._sequential``: the same with ``overlap=False`` (exchange after backward), to show what overlap buys;
  ``..._fwd``: the same with ``overlap_param_gather=True`` (the weight all-gather runs on into the next forward);
  ``..._torchcodec``: the same with the plain-torch codec (``kernel_backend="torch"``) instead of the default
  numba kernels, to show what the fused CPU codec buys; ``..._onebucket``: one bucket per param group
  (``bucket_size_mb=None``) instead of the default 4 MiB buckets, to show what the per-bucket collectives cost;
  ``..._autobucket``: the bucket count chosen at set-up from the measured link (``bucket_size_mb="auto"``).

Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only on CUDA devices (on a CPU it is silently not
applied), so the DDP peers here register theirs with ``DistributedDataParallel.register_comm_hook`` themselves;
the measured bytes on the wire show each hook acting.

For every bandwidth of the sweep, each method trains ``--timing-steps`` steps and reports the median step time
after ``--warmup`` steps (tokens/s) and the bytes each node's interface sent per step (kernel counter, headers
included). At the highest bandwidth each method instead trains ``--steps`` steps and is validated: the arithmetic
of a method does not depend on the link, so this validation loss stands for every bandwidth (the script checks it:
the training loss at step ``--timing-steps`` must be identical in every run of a method). For SDP4Bit the bytes
its own accounting (``strategy.comm_stats``) says had to cross nodes are reported beside the measured ones.
``--rounds N`` runs every method N times per bandwidth in alternating order and reports medians (only the first
round trains ``--steps`` and validates): use it to compare settings a few percent apart on a machine whose speed
drifts.

Needs root (network namespaces). Run from the repository root::

    .venv/bin/python -m benchmarks.sdp4bit_throughput            # the full sweep (see --help for the defaults)
    .venv/bin/python -m benchmarks.sdp4bit_throughput --quick    # 2 bandwidths, 3 methods, few steps

Writes ``benchmarks/results/sdp4bit_throughput{,_quick}.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import SHARED_DATA, free_port, machine_info, markdown_table, write_results
from benchmarks.tools.sdp4bit import METHODS, build_method
from benchmarks.tools.step_timer import StepTimer

BANDWIDTHS = [50.0, 100.0, 200.0, 500.0, 1000.0, 10000.0]
# extra steps an "auto" timing run may spend trying candidates before its timed window
AUTO_TRIAL_ALLOWANCE = 60
AUTO_RECHECK = 1000  # SDP4BitStrategy's default auto_recheck_every_n_steps
QUICK_METHODS = ["ddp", "ddp_fp16", "sdp4bit_qwd_tlq_hs"]
QUICK_BANDWIDTHS = [100.0, 1000.0]


# ------------------------------------------------------------------------------------------------ worker side


def _sdp4bit_bytes(strategy: Any) -> dict[str, float] | None:
    """Bytes SDP4Bit's own accounting (``strategy.comm_stats``) says this rank sent so far, per collective."""
    stats = getattr(strategy, "comm_stats", None)
    if stats is None or getattr(strategy, "topology", None) is None:
        return None
    return {k: float(v.bytes) for k, v in stats.total.items()}


def _expected_node_egress(per_rank: list[dict[str, float]]) -> float:
    """Bytes one node must send to the others, from its ranks' SDP4Bit accounting and gloo's algorithms.

    ``grad_inter`` is an all-to-all whose every byte goes to a rank on another node; ``grad_intra`` stays on the
    node. With several nodes of several processes the weight all-gather runs in two stages: ``weight_inter`` (each
    rank's shard to its peers on the other nodes) leaves the node, ``weight_intra`` stays. A single-stage all-gather
    (``weight``) runs as gloo's ring (rank r sends to r + 1): with ranks numbered node by node, one ring edge leaves
    each node and carries the ``world - 1`` shards one rank forwards, which is what one rank's ``weight`` counts.
    """
    ring = statistics.mean(r.get("weight", 0.0) for r in per_rank)
    two_stage = sum(r.get("weight_inter", 0.0) for r in per_rank)
    return sum(r.get("grad_inter", 0.0) for r in per_rank) + ring + two_stage


class _Meter(StepTimer):
    """Step times (``StepTimer``), the rank's training losses, and the byte counters at the timed window's ends.

    With SDP4Bit's ``"auto"`` the window starts two steps after its first decision (the trials before it are timed
    apart) and, when ``timed`` is given, training stops after ``timed`` steps of it.

    Args:
        warmup: the counters are read at the end of step ``warmup`` ("start") and of the last step ("end").
        strategy: the run's strategy (SDP4Bit's accounting is read when it has one).
        ifname: this node's shaped interface, read by its local rank 0 (``None`` outside the emulated cluster).
        timed: with ``"auto"``, the number of steps to time after its decision (``None``: up to ``max_steps``).
    """

    def __init__(self, warmup: int, strategy: Any, ifname: str | None, timed: int | None = None) -> None:
        super().__init__()
        self.warmup, self.strategy, self.ifname, self.timed = warmup, strategy, ifname, timed
        self.auto = bool(getattr(getattr(strategy, "config", None), "auto", False))
        self.fallback = warmup
        if self.auto:
            self.warmup = -1  # set at the decision
        self.losses: list[float] = []
        self.backward_starts: list[float] = []
        self.backward_ends: list[float] = []
        self.first_bucket_ready: list[float] = []  # seconds from backward's start to the first bucket's last gradient
        self._first_ready = self._last_ready = math.nan
        self.marks: dict[str, tuple[int | None, dict[str, float] | None]] = {}
        self.cpu: dict[str, float] = {}
        self.threads: dict[str, dict[str, float]] = {}

    def _mark(self, name: str) -> None:
        from benchmarks.tools.network import read_tx_bytes

        self.marks[name] = (read_tx_bytes(self.ifname) if self.ifname else None, _sdp4bit_bytes(self.strategy))
        # the process's CPU time, all its threads (gloo's and the exchange threads' included)
        self.cpu[name] = time.process_time()
        self.threads[name] = thread_cpu_seconds()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # when backward has produced the first bucket's gradients (the link cannot start before), and its last one
        # (gradient hooks rather than `on_after_backward`: a hook there keeps SDP4Bit from handing DDP's exchange to
        # torch's reducer)
        for p in first_bucket_params(self.strategy, pl_module) or []:
            p.register_post_accumulate_grad_hook(self._gradient_ready)
        for p in pl_module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._any_gradient_ready)

    def _gradient_ready(self, param: Any) -> None:
        self._first_ready = time.perf_counter()  # the last of the bucket's hooks to fire leaves its time

    def _any_gradient_ready(self, param: Any) -> None:
        self._last_ready = time.perf_counter()  # the last gradient of backward leaves its time

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self.backward_starts.append(time.perf_counter())
        self._first_ready = self._last_ready = math.nan

    def profile(self, first: int) -> dict[str, float | None]:
        """Median forward (batch start to backward start), backward, and first bucket's backward seconds of the
        steps from ``first`` on (``None`` for the last where the first bucket's parameters are not known)."""
        steps = range(first, min(len(self.starts), len(self.backward_starts), len(self.backward_ends)))
        forward = [self.backward_starts[i] - self.starts[i] for i in steps]
        backward = [self.backward_ends[i] - self.backward_starts[i] for i in steps]
        ready = [self.first_bucket_ready[i] for i in steps if not math.isnan(self.first_bucket_ready[i])]
        return {
            "forward_s": statistics.median(forward) if forward else math.nan,
            "backward_s": statistics.median(backward) if backward else math.nan,
            "first_bucket_backward_s": statistics.median(ready) if ready else None,
        }

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.backward_ends.append(self._last_ready)
        self.first_bucket_ready.append(self._first_ready - self.backward_starts[-1])
        self.losses.append(float(outputs["loss"]))
        if self.auto and self.warmup < 0 and self.strategy.auto_decisions:
            self.warmup = self.strategy.auto_decisions[0].step + 2
        undecided = self.auto and self.warmup < 0
        if trainer.global_step == self.warmup or (undecided and trainer.global_step == self.fallback):
            self._mark("start")  # without a decision (a short run), the fixed warm-up
        decided = self.auto and self.warmup > 0
        stop = decided and self.timed is not None and trainer.global_step == self.warmup + self.timed
        if trainer.global_step == trainer.max_steps or stop:
            self._mark("end")
            trainer.should_stop = trainer.should_stop or stop


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds of this process's live threads by kind: ``main``, ``gloo`` (gloo's and torch's gloo threads) and
    ``other`` (the strategy's exchange threads and any pool), from ``/proc/self/task`` (empty where there is none)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return {}
    out = {"main": 0.0, "gloo": 0.0, "other": 0.0}
    tick = os.sysconf("SC_CLK_TCK")
    for task in tasks.iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        kind = "main" if int(task.name) == os.getpid() else "gloo" if "gloo" in name else "other"
        out[kind] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def first_bucket_params(strategy: Any, model: Any) -> list[Any] | None:
    """The parameters whose gradients the first bucket a method sends waits for.

    SDP4Bit: its first bucket in launch order; DDP (and ZeRO + DDP): the last parameters up to DDP's first bucket
    size (1 MiB, filled in the order backward produces the gradients); FSDP2 and others: ``None``.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lightning_sdp.plugins.sdp4bit.overlap import launch_order

    buckets = getattr(strategy, "buckets", None)
    if buckets:
        first_use = {id(p): i for i, p in enumerate(model.parameters())}
        first = buckets[launch_order([b.params for b in buckets], first_use)[0]]
        return [p for p in first.params if p.requires_grad]
    if not isinstance(getattr(strategy, "model", None), DistributedDataParallel):
        return None
    params, size = [], 0
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        params.append(p)
        size += p.numel() * p.element_size()
        if size >= dist._DEFAULT_FIRST_BUCKET_BYTES:
            break
    return params


def bucket_shares(strategy: Any, model: Any) -> tuple[float, float] | None:
    """The shares of the gradient values in the first and the last bucket a method sends (in the order backward
    completes them): the link idles until the first is ready, and the last one's exchange follows backward.

    SDP4Bit: its flat buckets in launch order; DDP (and ZeRO + DDP): the reducer's buckets after their rebuild;
    FSDP2: one unit per Transformer block, the last block first, the root's own parameters last.
    """
    from torch.nn.parallel import DistributedDataParallel

    from lightning_sdp.plugins.sdp4bit.overlap import launch_order

    buckets = getattr(strategy, "buckets", None)
    wrapped = getattr(strategy, "model", None)
    if buckets:
        first_use = {id(p): i for i, p in enumerate(model.parameters())}
        order = launch_order([b.params for b in buckets], first_use)
        sizes = [sum(p.numel() for p in buckets[i].params if p.requires_grad) for i in order]
    elif isinstance(wrapped, DistributedDataParallel):
        info = wrapped._get_ddp_logging_data()
        text = info.get("rebuilt_bucket_sizes") or info.get("bucket_sizes")
        sizes = [int(x) for x in str(text).split(",")] if text else []
    elif hasattr(model, "transformer"):  # FSDP2: a unit per block, then the root
        blocks = [sum(p.numel() for p in block.parameters()) for block in model.transformer.h]
        sizes = [*blocks[::-1], sum(p.numel() for p in model.parameters()) - sum(blocks)]
    else:
        return None
    sizes = [size for size in sizes if size > 0]
    total = sum(sizes)
    return (sizes[0] / total, sizes[-1] / total) if total else None


def _run_method(method: str, bandwidth: float, steps: int, validate: bool, args: argparse.Namespace) -> dict:
    import lightning.pytorch as pl
    import torch.distributed as dist

    from lightning_sdp.datamodules.text import CharTextDataModule

    pl.seed_everything(args.seed, verbose=False)
    dm = CharTextDataModule(args.data, block_size=args.block, batch_size=args.batch, seed=args.seed)
    dm.setup("fit")
    model, strategy = build_method(method, args, dm.vocab_size)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ifname = os.environ.get("EMULATED_CLUSTER_IFNAME")
    auto = bool(getattr(getattr(strategy, "config", None), "auto", False))
    meter = _Meter(
        args.warmup, strategy, ifname if local_rank == 0 else None, None if validate else steps - args.warmup
    )
    if auto and not validate:
        steps += AUTO_TRIAL_ALLOWANCE
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=args.nproc, num_nodes=args.nodes, max_steps=steps,
        limit_val_batches=args.val_batches if validate else 0, val_check_interval=steps,
        check_val_every_n_epoch=None, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[meter],
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer.fit(model, dm)
    wall = time.perf_counter() - t0
    val = float(trainer.callback_metrics["val/loss"]) if validate and "val/loss" in trainer.callback_metrics else None
    # end-to-end intervals of the steps after the warm-up (each holds a whole step, its communication included)
    warmup = meter.warmup if meter.warmup > 0 else args.warmup
    durations = [b - a for a, b in zip(meter.ends[warmup - 1 :], meter.ends[warmup:], strict=False)]
    shares = bucket_shares(strategy, model)
    timed = len(durations)
    cpu_per_step = (meter.cpu["end"] - meter.cpu["start"]) / timed
    start_threads, end_threads = meter.threads["start"], meter.threads["end"]
    by_thread = {kind: (end_threads[kind] - start_threads[kind]) / timed for kind in end_threads}
    mine = {"marks": meter.marks, "rank": dist.get_rank(), "local_rank": local_rank, "cpu_s_per_step": cpu_per_step,
            "cpu_by_thread": by_thread,
            "node": int(os.environ.get("GROUP_RANK", os.environ.get("EMULATED_CLUSTER_NODE", "0")))}  # fmt: skip
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    wire = [e["marks"]["end"][0] - e["marks"]["start"][0] for e in everyone if e["marks"]["end"][0] is not None]
    node_ranks: dict[int, list[dict[str, float]]] = {}
    for e in everyone:
        (start, end) = (e["marks"]["start"][1], e["marks"]["end"][1])
        if end is not None:
            node_ranks.setdefault(e["node"], []).append({k: v - start.get(k, 0.0) for k, v in end.items()})
    acct_nodes = {node: _expected_node_egress(ranks) for node, ranks in node_ranks.items()}
    tokens_per_step = args.batch * args.block * args.world
    median = statistics.median(durations)
    extra: dict[str, Any] = {}
    if auto:
        decisions = strategy.auto_decisions
        trial = [b - a for a, b in zip(meter.ends[: warmup - 1], meter.ends[1:warmup], strict=False)]
        extra = {
            "auto_choice": decisions[0].chosen.describe() if decisions else "undecided",
            "auto_decided_at_step": decisions[0].step if decisions else None,
            "auto_measured": decisions[0].measured if decisions else {},
            "auto_skipped": decisions[0].skipped if decisions else [],
            "auto_links": vars(decisions[0].links) if decisions else {},
            # what the steps spent trying cost beyond the chosen format's pace (the first step, warm-up, left out)
            "auto_trial_cost_s": sum(trial) - len(trial) * median,
        }
    return {
        **extra,
        "method": method,
        "bandwidth_mbit": bandwidth,
        "steps": len(meter.ends),
        "timed_steps": timed,
        "median_step_s": median,
        "tokens_per_s": tokens_per_step / median,
        "step_s": durations,
        "wire_bytes_per_step_per_node": sum(wire) / len(wire) / timed if wire else None,
        "wire_bytes_per_node": wire,
        "accounted_inter_bytes_per_step_per_node": (
            sum(acct_nodes.values()) / len(acct_nodes) / timed if acct_nodes else None
        ),
        "cpu_s_per_step_per_rank": statistics.mean(e["cpu_s_per_step"] for e in everyone),
        # where that CPU went (threads alive at both marks; /proc counts in clock ticks of 10 ms)
        "cpu_s_per_step_by_thread": {
            kind: statistics.mean(e["cpu_by_thread"][kind] for e in everyone) for kind in by_thread
        },
        "train_losses_rank0": meter.losses,
        # the dependency chain of a step (see chain_limit): forward, backward, the first and last bucket's shares
        "profile": {
            **meter.profile(warmup),
            "first_bucket_share": shares[0] if shares else None,
            "last_bucket_share": shares[1] if shares else None,
        },
        "val_loss": val,
        "wall_s": wall,
        "params": sum(p.numel() for p in model.parameters()) if method != "fsdp2" else None,
        "load_avg_1m": os.getloadavg()[0],
    }


def worker(args: argparse.Namespace) -> None:
    """One process of the sweep (started by torchrun inside a node of the emulated cluster)."""
    import warnings

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from benchmarks.tools.network import shape_interface

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    ifname = os.environ.get("EMULATED_CLUSTER_IFNAME")
    quality_bw = max(args.bandwidths)
    out = Path(args.out)
    for bandwidth in sorted(args.bandwidths, reverse=True):
        if dist.is_initialized():
            dist.barrier()
        if local_rank == 0 and ifname:
            shape_interface(ifname, bandwidth)
        if dist.is_initialized():
            dist.barrier()
        # rounds alternate the order (forward, reversed, ...) so that a machine drifting over the run shifts no
        # method against the others; the summary keeps each method's median over rounds
        schedule = [(r, m) for r in range(args.rounds) for m in (args.methods[:: -1 if r % 2 else 1])]
        for round_, method in schedule:
            quality = bandwidth == quality_bw and round_ == 0
            steps = args.steps if quality else args.timing_steps
            try:
                result = _run_method(method, bandwidth, steps, quality, args)
            except Exception as err:  # recorded in the results, the sweep goes on
                result = {"method": method, "bandwidth_mbit": bandwidth, "error": f"{type(err).__name__}: {err}",
                          "traceback": traceback.format_exc()}  # fmt: skip
                print(f"[rank {rank}] {method} @ {bandwidth:g} Mbit/s failed:\n{result['traceback']}", flush=True)
                if dist.is_initialized():
                    dist.barrier()
            result["round"] = round_
            if rank == 0:
                with out.open("a") as f:
                    f.write(json.dumps(result) + "\n")
                if "error" not in result:
                    wire = result["wire_bytes_per_step_per_node"]
                    print(f"[sweep] {bandwidth:>7g} Mbit/s {method:<20} {result['median_step_s']:.3f} s/step "
                          f"{result['tokens_per_s']:8.0f} tok/s  wire {wire / 1e6 if wire else float('nan'):.2f} "
                          f"MB/step/node  val {result['val_loss']}", flush=True)  # fmt: skip


# ------------------------------------------------------------------------------------------------ driver side
def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Build the emulated cluster, run the sweep in one torchrun launch per node, return the result rows."""
    from benchmarks.tools.network import EmulatedCluster, require_root

    require_root()
    out = Path(tempfile.mkdtemp(prefix="sdp4bit_throughput_")) / "results.jsonl"
    out.touch()
    target = ["-m", "benchmarks.sdp4bit_throughput", "--worker", "--out", str(out),
              "--bandwidths", *map(str, args.bandwidths), "--methods", *args.methods]  # fmt: skip
    for name in ("data", "steps", "timing_steps", "warmup", "rounds", "n_layer", "n_head", "n_embd", "block", "batch",
                 "lr", "warmup_lr", "val_batches", "seed", "pg_timeout"):  # fmt: skip
        target += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    with EmulatedCluster(nodes=args.nodes) as cluster:
        procs = cluster.torchrun(target, nproc_per_node=args.nproc, master_port=free_port(), env=env,
                                 cwd=str(Path(__file__).resolve().parents[1]))  # fmt: skip
        codes = cluster.wait(procs)
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    if any(codes):
        print(f"torchrun exit codes {codes}; {len(rows)} results were written before", file=sys.stderr)
        if not rows:
            raise SystemExit(f"The sweep failed (torchrun exit codes {codes}); see the output above.")
    return rows


def machine_limit(
    row: dict[str, Any], ddp: dict[str, Any] | None, bandwidth_mbit: float, world: int, cores: int
) -> tuple[float, float]:
    """The step this machine allows a method, and the method's fraction of it: ``(limit_s, limit_s / step_s)``.

    The limit is the larger of DDP's CPU-bound step (DDP's CPU time per step per rank x ranks / cores: the same
    arithmetic with no communication cost of its own) and the method's measured wire bytes per node over the link
    rate (its own traffic at full link speed). NaN when DDP or the wire bytes were not measured.
    """
    nan = float("nan")
    cpu_s = ddp.get("cpu_s_per_step_per_rank") if ddp else None
    wire = row.get("wire_bytes_per_step_per_node")
    if cpu_s is None or wire is None or not row.get("median_step_s"):
        return nan, nan
    limit = max(cpu_s * world / cores, 8.0 * wire / (bandwidth_mbit * 1e6))
    return limit, limit / row["median_step_s"]


def chain_limit(
    row: dict[str, Any], ddp: dict[str, Any] | None, bandwidth_mbit: float, world: int, cores: int
) -> tuple[float, float]:
    """A limit that DDP itself can reach, and the method's fraction of it: ``(limit_s, limit_s / step_s)``.

    The link cannot start before forward and the backward of the first bucket are done, and the last bucket's
    exchange work is left after the last byte arrives; so the step is at least
    ``forward + first bucket's backward + wire time + last bucket's exposed exchange``, from the method's own profile
    in the same run: the median forward, the median time from backward's start to the first bucket's last gradient
    (where its parameters are known; else the backward times the bucket's share of the values, an upper bound for a
    method whose backward waits for its communication), the method's wire bytes over the link, and the exchange
    threads' CPU per step times the last bucket's share; and at least DDP's CPU-bound step as in
    :func:`machine_limit`. NaN when something was not measured.
    """
    nan = float("nan")
    cpu_s = ddp.get("cpu_s_per_step_per_rank") if ddp else None
    wire, profile = row.get("wire_bytes_per_step_per_node"), row.get("profile") or {}
    first, last = profile.get("first_bucket_share"), profile.get("last_bucket_share")
    if cpu_s is None or wire is None or first is None or last is None or not row.get("median_step_s"):
        return nan, nan
    threads = row.get("cpu_s_per_step_by_thread") or {}
    exchange_cpu = threads.get("gloo", 0.0) + threads.get("other", 0.0)  # the collectives' and exchange threads'
    first_backward = profile.get("first_bucket_backward_s")
    if first_backward is None:
        first_backward = profile["backward_s"] * first
    chain = profile["forward_s"] + first_backward + 8.0 * wire / (bandwidth_mbit * 1e6)
    limit = max(cpu_s * world / cores, chain + exchange_cpu * last)
    return limit, limit / row["median_step_s"]


def merge_rounds(rows: list[dict[str, Any]]) -> dict[tuple[str, float], dict[str, Any]]:
    """One row per (method, bandwidth): the first round's row (its losses, validation and ``auto`` decision) with
    the step time, CPU time and wire bytes replaced by their medians over the rounds (listed in ``rounds_*``)."""
    runs: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        runs.setdefault((r["method"], r["bandwidth_mbit"]), []).append(r)
    merged = {}
    for key, group in runs.items():
        group = sorted(group, key=lambda r: r.get("round", 0))
        row = dict(group[0])
        for field in ("median_step_s", "cpu_s_per_step_per_rank", "wire_bytes_per_step_per_node"):
            values = [r[field] for r in group if r.get(field) is not None]
            row[f"rounds_{field}"] = values
            row[field] = statistics.median(values) if values else None
        splits = [r["cpu_s_per_step_by_thread"] for r in group if r.get("cpu_s_per_step_by_thread")]
        if splits:
            row["cpu_s_per_step_by_thread"] = {k: statistics.median(split[k] for split in splits) for k in splits[0]}
        profiles = [r["profile"] for r in group if r.get("profile")]
        if profiles:
            row["profile"] = _median_profile(profiles)
        row["tokens_per_s"] = group[0]["tokens_per_s"] * group[0]["median_step_s"] / row["median_step_s"]
        merged[key] = row
    return merged


def round_resolution(by: dict[tuple[str, float], dict[str, Any]], fixed: Sequence[str], bw: float) -> dict[str, Any]:
    """How finely this run can rank fixed settings at one bandwidth, from their rounds (needs two or more).

    ``same setting``: the worst ratio of one setting's faster round to its slower one (1.0: rounds agree).
    ``picked by one round``: the best setting of each round, scored on the other rounds against their best (the
    worst of those): what a choice made from a whole run of steps gets, so a ratio to the best fixed setting
    (``auto``'s) cannot be judged finer than this.
    """
    steps = {m: by[(m, bw)]["rounds_median_step_s"] for m in fixed if (m, bw) in by}
    steps = {m: s for m, s in steps.items() if len(s) > 1}
    rounds = min((len(s) for s in steps.values()), default=0)
    if rounds < 2:
        return {}
    same = min(min(s) / max(s) for s in steps.values())
    picked = []
    for k in range(rounds):
        pick = min(steps, key=lambda m: steps[m][k])
        picked += [min(s[j] for s in steps.values()) / steps[pick][j] for j in range(rounds) if j != k]
    return {"Mbit/s": f"{bw:g}", "same setting, round vs round": same, "picked by one round, on another": min(picked)}


def _median_profile(profiles: list[dict[str, Any]]) -> dict[str, Any]:
    """Each profile entry's median over the rounds (``None`` where a round did not measure it)."""

    def median(key: str) -> float | None:
        values = [p.get(key) for p in profiles]
        return None if any(v is None for v in values) else statistics.median(values)

    return {key: median(key) for key in profiles[0]}


def summarise(rows: list[dict[str, Any]], args: argparse.Namespace) -> tuple[dict, str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    failed = {r["method"]: r["error"] for r in rows if "error" in r}
    by = merge_rounds(ok)
    methods = [m for m in args.methods if any(k[0] == m for k in by)]
    bws = sorted({r["bandwidth_mbit"] for r in ok})
    quality_bw = max(args.bandwidths)
    ddp_val = by.get(("ddp", quality_bw), {}).get("val_loss")
    check = min(args.timing_steps, args.steps) - 1

    table = []
    for m in methods:
        for bw in bws:
            r = by.get((m, bw))
            if r is None:
                continue
            d = by.get(("ddp", bw))
            limit, fraction = machine_limit(r, d, bw, args.world, _cores())
            wire, acct = r["wire_bytes_per_step_per_node"], r["accounted_inter_bytes_per_step_per_node"]
            dwire = d["wire_bytes_per_step_per_node"] if d else None
            table.append({
                "method": m, "Mbit/s": int(bw) if bw == int(bw) else bw, "s/step (median)": r["median_step_s"],
                "tokens/s": r["tokens_per_s"], "speed-up vs ddp": d["median_step_s"] / r["median_step_s"] if d else
                float("nan"), "wire MB/step/node": wire / 1e6 if wire is not None else float("nan"),
                "wire vs ddp": wire / dwire if wire and dwire else float("nan"),
                "accounted MB/step/node": acct / 1e6 if acct is not None else "",
                "wire / accounted": wire / acct if wire and acct else "",
                "CPU s/step/rank": r.get("cpu_s_per_step_per_rank", float("nan")),
                "CPU vs ddp": r["cpu_s_per_step_per_rank"] / d["cpu_s_per_step_per_rank"] if d else float("nan"),
                "CPU main / gloo / other threads": " / ".join(
                    f"{v:.3f}" for v in r.get("cpu_s_per_step_by_thread", {}).values()
                ),
                "CPU-bound step (s)": r.get("cpu_s_per_step_per_rank", float("nan")) * args.world / _cores(),
                "limit step (s)": limit, "fraction of limit": fraction,
                "chain limit (s)": chain_limit(r, d, bw, args.world, _cores())[0],
                "fraction of chain limit": chain_limit(r, d, bw, args.world, _cores())[1],
                "load": round(r["load_avg_1m"], 1),
            })  # fmt: skip
    quality = []
    for m in methods:
        q = by.get((m, quality_bw))
        if q is None:
            continue
        same = [
            by[(m, bw)]["train_losses_rank0"][check] == q["train_losses_rank0"][check]
            for bw in bws if (m, bw) in by and len(by[(m, bw)]["train_losses_rank0"]) > check
        ]  # fmt: skip
        quality.append({
            "method": m, f"val loss after {args.steps} steps": q["val_loss"],
            "gap vs ddp (%)": 100 * (q["val_loss"] / ddp_val - 1) if ddp_val and q["val_loss"] else float("nan"),
            f"train loss at step {check + 1} identical at every bandwidth": all(same),
        })  # fmt: skip
    # every setting auto may choose, run fixed: the strategy's formats and DDP's exchange
    fixed_methods = [
        m for m in methods if m == "ddp" or (m.startswith("sdp4bit_") and not m.startswith("sdp4bit_auto"))
    ]
    autos = []
    for bw in bws:
        a, d = by.get(("sdp4bit_auto", bw)), by.get(("ddp", bw))
        fixed = {m: by[(m, bw)]["median_step_s"] for m in fixed_methods if (m, bw) in by}
        if a is None:
            continue
        best = min(fixed, key=fixed.__getitem__) if fixed else None
        autos.append({
            "Mbit/s": f"{bw:g}", "chosen": a.get("auto_choice"), "decided at step": a.get("auto_decided_at_step"),
            "s/step": a["median_step_s"], "vs best fixed": fixed[best] / a["median_step_s"] if best else float("nan"),
            "best fixed": best or "", "vs ddp": d["median_step_s"] / a["median_step_s"] if d else float("nan"),
            "trial cost (s)": a.get("auto_trial_cost_s", float("nan")),
            f"trial cost over {AUTO_RECHECK} steps (%)": 100 * a.get("auto_trial_cost_s", float("nan"))
            / (AUTO_RECHECK * a["median_step_s"]),
            "skipped (wire time too long)": len(a.get("auto_skipped", [])),
        })  # fmt: skip
    resolution = [row for bw in bws if (row := round_resolution(by, fixed_methods, bw))]
    speedups, fractions, chains = [], [], []
    for m in methods:
        row: dict[str, Any] = {"method": m}
        share: dict[str, Any] = {"method": m}
        chain: dict[str, Any] = {"method": m}
        for bw in bws:
            r, d = by.get((m, bw)), by.get(("ddp", bw))
            row[f"{bw:g}"] = d["median_step_s"] / r["median_step_s"] if r and d else float("nan")
            share[f"{bw:g}"] = machine_limit(r, d, bw, args.world, _cores())[1] if r else float("nan")
            chain[f"{bw:g}"] = chain_limit(r, d, bw, args.world, _cores())[1] if r else float("nan")
        speedups.append(row)
        fractions.append(share)
        chains.append(chain)

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, rows_, ylabel in ((axes[0], speedups, "speed-up over DDP"), (axes[1], fractions, "fraction of the limit")):
        if all(math.isnan(row[f"{bw:g}"]) for row in rows_ for bw in bws):  # no DDP run: nothing to draw
            ax.text(0.5, 0.5, f"{ylabel}: needs ddp in --methods", ha="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        for row in rows_:
            ys = [row[f"{bw:g}"] for bw in bws]
            sdp = row["method"].startswith("sdp4bit")
            ax.plot(bws, ys, "-" if sdp else "--", marker="o", label=row["method"], lw=2 if sdp else 1)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(xscale="log", xlabel="inter-node bandwidth per direction (Mbit/s, tc tbf)", ylabel=ylabel)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"GPT {args.n_layer}x{args.n_head}x{args.n_embd}, {args.nodes} nodes x {args.nproc} CPU processes")
    fig.tight_layout()

    params = next((r["params"] for r in ok if r.get("params")), None)
    md = [
        f"# SDP4Bit and peers on an emulated {args.nodes}-node cluster (CPU, gloo, tc tbf)",
        "",
        f"Char GPT n_layer={args.n_layer}, n_head={args.n_head}, n_embd={args.n_embd}, block={args.block}, "
        f"{params} parameters; batch {args.batch} per rank ({args.batch * args.block * args.world} tokens per step); "
        f"{args.nodes} nodes x {args.nproc} processes; AdamW lr {args.lr}; data `{args.data}`; seed {args.seed}. "
        f"Timing: median step after {args.warmup} warm-up steps of {args.timing_steps} "
        f"({args.steps} at {quality_bw:g} Mbit/s)"
        + (
            f"; every method ran {args.rounds} times per bandwidth, in alternating order (as listed, then reversed), "
            "and each step time, CPU time and wire count is the median over those runs"
            if args.rounds > 1
            else ""
        )
        + ". Wire bytes: each node's interface counter (tx_bytes, all "
        "headers), per step, mean over nodes. Accounted: what SDP4Bit's comm_stats says each node sent to the "
        "other (its grad_inter all-to-all, plus its weight_inter stage when the weight all-gather runs in two "
        "stages, else one ring edge of the ring all-gather). CPU s/step/rank: process CPU time (all threads) per "
        "timed step, mean over ranks, and split into the main thread, gloo's threads and the others (the exchange "
        f"threads); CPU-bound step = that x {args.world} ranks / {_cores()} cores, the step time "
        "if the cores were the only limit (when it is close to the measured step, overlap has no idle core to use).",
        "",
        "## Speed-up over DDP (median step time ratio)",
        "",
        markdown_table(speedups, floatfmt="{:.2f}"),
        "",
        "## Fraction of the machine's limit",
        "",
        "The step the machine allows each method: the larger of DDP's CPU-bound step (DDP's CPU time per step per "
        f"rank x {args.world} ranks / {_cores()} cores, measured in the same run at the same bandwidth) and the "
        "method's own measured wire bytes per node over the link rate; the fraction is that step over the "
        "method's measured median step (1.0: nothing left to gain on this machine).",
        "",
        markdown_table(fractions, floatfmt="{:.2f}"),
        "",
        "## Fraction of the dependency-chain limit",
        "",
        "A limit DDP itself can reach: the link cannot start before forward and the backward of the first bucket to "
        "leave, and the last bucket's exchange work follows its last byte, so each method's step is at least its "
        "forward + the first bucket's backward (from backward's start to that bucket's last gradient; FSDP2: its "
        "backward x the bucket's share of the values) + its wire time + its exchange threads' CPU per step x the "
        "last bucket's share, all from the same run, and at least DDP's CPU-bound step as above. The fraction is "
        "that limit over the measured median step.",
        "",
        markdown_table(chains, floatfmt="{:.2f}"),
        "",
        "## `auto` against the best fixed setting",
        "",
        "Each `sdp4bit_auto` run is timed from two steps after its decision; the steps it spent trying candidates "
        "before that cost the seconds below beyond the chosen format's pace (once per fit, and again at every "
        f"re-check, by default every {AUTO_RECHECK} steps). Best fixed: the fastest method of this run at that bandwidth "
        "that runs one of `auto`'s candidates fixed (an SDP4Bit setting, or DDP for DDP's exchange).",
        "",
        markdown_table(autos, floatfmt="{:.3g}") if autos else "(not run)",
        "",
        *(
            [
                "How finely this run ranks the fixed settings (their rounds against each other): the worst ratio of a "
                "setting's faster round to its slower one, and the best setting of one round scored on the others "
                "against their best. `auto`'s ratio to the best fixed setting cannot be judged finer than these.",
                "",
                markdown_table(resolution, floatfmt="{:.2f}"),
                "",
            ]
            if resolution
            else []
        ),
        f"## Quality (validation on {args.val_batches} batches per rank, trained at {quality_bw:g} Mbit/s)",
        "",
        markdown_table(quality),
        "",
        "## Every run",
        "",
        markdown_table(table, floatfmt="{:.3g}"),
        "",
    ]
    if failed:
        md += ["## Methods that did not run", ""] + [f"- `{m}`: {e}" for m, e in failed.items()] + [""]
    payload = {"args": vars(args), "rows": rows, "speedups": speedups, "fractions_of_limit": fractions,
               "fractions_of_chain_limit": chains, "quality": quality, "table": table, "auto": autos,
               "resolution": resolution, "failed": failed}  # fmt: skip
    return payload, "\n".join(md), fig


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _code_version() -> dict[str, Any]:
    """The commit measured and the files the benchmark uses that differ from it (the results name both)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]

    def git(*argv: str) -> str:
        proc = subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True)
        return proc.stdout.rstrip("\n") if proc.returncode == 0 else ""

    used = ["lightning_sdp/plugins/sdp4bit", "lightning_sdp/kernels", "lightning_sdp/models/gpt.py",
            "lightning_sdp/datamodules/text.py"]  # fmt: skip
    dirty = [line[3:] for line in git("status", "--porcelain", "--", *used).splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD") or "unknown", "dirty": dirty}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 bandwidths, 3 methods, few steps; writes *_quick.*")
    p.add_argument("--bandwidths", type=float, nargs="+", default=None, help=f"Mbit/s (default {BANDWIDTHS})")
    p.add_argument("--methods", nargs="+", default=None, help=f"subset of {METHODS}")
    p.add_argument("--steps", type=int, default=None, help="steps of the quality run (highest bandwidth); default 150")
    p.add_argument("--timing-steps", type=int, default=None, help="steps of every other run (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of every method per bandwidth, in alternating order; the summary takes medians",
    )
    p.add_argument("--data", default=str(SHARED_DATA / "tinyshakespeare" / "input.txt"))
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2, help="processes per node")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="windows per rank per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-lr", type=int, default=20, help="LR warm-up steps")
    p.add_argument("--val-batches", type=int, default=20)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--pg-timeout", type=float, default=600.0, help="seconds before a stuck collective fails")
    p.add_argument("--name", default="sdp4bit_throughput", help="stem of the files in benchmarks/results/")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.quick:
        args.bandwidths = args.bandwidths or QUICK_BANDWIDTHS
        args.methods = args.methods or QUICK_METHODS
        args.steps = args.steps or 10
        args.timing_steps = args.timing_steps or 7
        args.val_batches = min(args.val_batches, 4)
    args.bandwidths = args.bandwidths or BANDWIDTHS
    args.methods = args.methods or METHODS
    args.steps = args.steps or 150
    args.timing_steps = args.timing_steps or 8
    args.world = args.nodes * args.nproc
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"Unknown method(s) {unknown}: choose from {METHODS}.")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}.")
    if args.warmup < 1 or min(args.steps, args.timing_steps) <= args.warmup + 1:
        raise SystemExit(
            f"--steps ({args.steps}) and --timing-steps ({args.timing_steps}) must exceed --warmup ({args.warmup}) "
            "by at least 2, so that at least 2 steps are timed; --warmup must be at least 1."
        )
    if args.worker:
        worker(args)
        return
    if not Path(args.data).exists():
        raise SystemExit(f"{args.data} not found: pass --data PATH (tiny Shakespeare, see ../shared/data/README.md)")
    load_start = os.getloadavg()
    code = _code_version()
    t0 = time.perf_counter()
    rows = run(args)
    payload, md, fig = summarise(rows, args)
    payload["total_wall_s"] = time.perf_counter() - t0
    payload["load_avg_start"], payload["load_avg_end"] = load_start, os.getloadavg()
    payload["code"] = code
    md += (
        f"\nCode: commit {code['commit']}"
        + (f", with uncommitted changes in {', '.join(code['dirty'])}" if code["dirty"] else ", clean")
        + ".\n"
    )
    noisy = load_start[0] > 0.5 * machine_info()["cores"]  # before our own processes started
    md += (f"\nTotal wall time {payload['total_wall_s']:.0f} s. Load average (1, 5, 15 min) at start "
           f"{', '.join(f'{x:.1f}' for x in load_start)}, at end "
           f"{', '.join(f'{x:.1f}' for x in payload['load_avg_end'])}"
           + (" (loaded machine: timings are noisy)." if noisy else ".") + "\n")  # fmt: skip
    write_results(args.name + ("_quick" if args.quick else ""), payload, md, fig)
    print(md)


if __name__ == "__main__":
    main()
