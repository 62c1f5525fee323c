"""SDP4Bit's exchange alone: CPU time per step and rank, by bucket count, beside DDP's gradient all-reduce.

Four gloo processes on this host as 2 emulated nodes x 2 (loopback, no link shaping: this measures CPU, not the
wire) exchange one model's worth of values (``--values``, default the sweep's GPT: 3,192,576), cut into 1, 4 or 16
buckets. Each step runs on the calling thread, bucket after bucket, with nothing to overlap:

- ``ddp_allreduce``: one fp32 all-reduce per bucket, which is what DDP's reducer runs for the gradients (gloo's
  ring; DDP's default 25 MiB buckets make it one bucket for this model);
- ``none/none``: SDP4Bit's uncompressed exchange: two-level gradient reduce-scatter, two-stage weight all-gather;
- ``qwd/tlq_hs``: the paper's formats (qWD 4-bit weights, TLq-HS 8/4-bit gradients) with the fused CPU codec.

CPU time is the process's (all threads, gloo's included) per step, the median over ranks; each row also gives the
CPU each extra bucket costs over one bucket. The strategy's exchange threads and the training step are left out:
``benchmarks/sdp4bit_throughput.py`` measures those in training.

    python -m benchmarks.sdp4bit_exchange_cost                  # about a minute on 2 cores
    python -m benchmarks.sdp4bit_exchange_cost --buckets 1 4 --steps 5

Writes ``benchmarks/results/sdp4bit_exchange_cost.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks._common import free_port, machine_info, markdown_table, write_results
from lightning_sdp.plugins.sdp4bit.exchange import (
    Codec,
    CommStats,
    GradientExchange,
    NumbaOps,
    RoundingRNG,
    WeightExchange,
    padded_shard_size,
)
from lightning_sdp.plugins.sdp4bit.formats import WeightFormat, gradient_format
from lightning_sdp.plugins.sdp4bit.topology import build_topology

METHODS = ("ddp_allreduce", "none/none", "qwd/tlq_hs")
GRADIENT_GROUP, WEIGHT_GROUP, HADAMARD = 128, 2048, 32


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process, gloo's included
    return usage.ru_utime + usage.ru_stime


def measure(rank: int, world: int, values: int, buckets: int, method: str, steps: int) -> dict[str, float]:
    """One rank's CPU and wall seconds per exchange step (a process group must exist), and the exchange's error.

    Args:
        rank: this rank.
        world: the world size (nodes of 2 processes).
        values: values of the whole model, cut into ``buckets`` equal buckets (padded to whole groups).
        buckets: how many buckets.
        method: one of :data:`METHODS`.
        steps: timed steps (after two warm-up steps).

    Returns:
        ``cpu_s`` and ``wall_s`` per step, and ``max_error``: the largest difference between this rank's reduced
        gradient shard and the exact sum of every rank's gradients (0 for the uncompressed methods).
    """
    torch.set_num_threads(1)
    topo = build_topology(rank, world, 2)
    s = padded_shard_size(values // buckets, world, WEIGHT_GROUP)
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(world * s, generator=gen) * 1e-3 for _ in range(buckets)]
    models = [torch.randn(world * s, generator=torch.Generator().manual_seed(7)) for _ in range(buckets)]
    masters = [m[topo.shard * s : (topo.shard + 1) * s].clone() for m in models]
    weights, gradients = ("qwd", "tlq_hs") if method == "qwd/tlq_hs" else ("none", "none")
    fmt = gradient_format(gradients, 8, 4, HADAMARD)
    ops, rng = NumbaOps(), RoundingRNG(0, rank, torch.device("cpu"))

    def step(i: int) -> list[torch.Tensor]:
        rng.reset(i)
        if method == "ddp_allreduce":
            out = [g.clone() for g in grads]
            for g in out:
                dist.all_reduce(g)
            return [g[topo.shard * s : (topo.shard + 1) * s] for g in out]
        shards = []
        for b in range(buckets):
            codec = Codec(ops, "stochastic", rng.child(b), CommStats())
            exchange = GradientExchange(grads[b].clone(), topo, fmt, GRADIENT_GROUP, codec)
            exchange.first()
            shards.append(exchange.second())
        for b in range(buckets):
            masters[b] += 1e-4
            codec = Codec(ops, "stochastic", rng.child(buckets + b), CommStats())
            weight_format = WeightFormat(weights, 4, WEIGHT_GROUP)
            gather = WeightExchange(models[b], masters[b], topo, weight_format, codec, topo.world_group)
            gather.send()
            gather.apply()
        return shards

    for i in range(2):
        step(i)
    dist.barrier()
    cpu, wall = _cpu_seconds(), time.perf_counter()
    for i in range(steps):
        shards = step(2 + i)
    cpu, wall = _cpu_seconds() - cpu, time.perf_counter() - wall
    everyone = [torch.empty_like(grads[0]) for _ in range(world)]
    error = 0.0
    for b, shard in enumerate(shards):
        dist.all_gather(everyone, grads[b])
        exact = torch.stack(everyone).sum(0)[topo.shard * s : (topo.shard + 1) * s]
        error = max(error, float((shard - exact).abs().max()))
    topo.destroy()
    return {"cpu_s": cpu / steps, "wall_s": wall / steps, "max_error": error}


def _worker(rank: int, world: int, port: int, jobs: list[tuple[int, str]], values: int, steps: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for buckets, method in jobs:
            queue.put((rank, buckets, method, measure(rank, world, values, buckets, method, steps)))
    finally:
        dist.destroy_process_group()


def run(values: int, bucket_counts: list[int], steps: int, world: int = 4) -> list[dict[str, Any]]:
    """Every method at every bucket count in one group of ``world`` processes; one row per (method, buckets)."""
    jobs = [(b, m) for b in bucket_counts for m in METHODS]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, jobs, values, steps, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[tuple[int, str], list[dict[str, float]]] = {}
    for _ in range(world * len(jobs)):
        _, buckets, method, result = queue.get(timeout=900)
        got.setdefault((buckets, method), []).append(result)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"an exchange-cost rank exited with {p.exitcode}")
    rows = []
    for buckets, method in jobs:
        per_rank = got[(buckets, method)]
        rows.append(
            {
                "method": method,
                "buckets": buckets,
                "cpu_ms_per_step_rank": 1e3 * statistics.median(r["cpu_s"] for r in per_rank),
                "wall_ms_per_step": 1e3 * max(r["wall_s"] for r in per_rank),
                "max_error": max(r["max_error"] for r in per_rank),
            }
        )
    base = {r["method"]: r["cpu_ms_per_step_rank"] for r in rows if r["buckets"] == min(bucket_counts)}
    ddp_one = base["ddp_allreduce"]
    for r in rows:
        extra = r["buckets"] - min(bucket_counts)
        r["cpu_vs_ddp_allreduce_1_bucket"] = r["cpu_ms_per_step_rank"] / ddp_one
        r["cpu_ms_per_extra_bucket"] = (r["cpu_ms_per_step_rank"] - base[r["method"]]) / extra if extra else None
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--values", type=int, default=3_192_576, help="values of the whole model")
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--name", default="sdp4bit_exchange_cost")
    args = p.parse_args(argv)
    load = os.getloadavg()
    start = time.perf_counter()
    rows = run(args.values, sorted(args.buckets), args.steps)
    info = machine_info()
    md = [
        f"# {args.name}",
        "",
        f"4 gloo processes (2 emulated nodes x 2, loopback), {args.values:,} values cut into "
        f"{', '.join(map(str, sorted(args.buckets)))} buckets, {args.steps} timed steps after 2 warm-up steps; "
        "each step runs bucket after bucket on the calling thread. CPU: process CPU time (all threads) per step, "
        "median over ranks; `cpu_ms_per_extra_bucket`: over the fewest buckets, per extra bucket. `max_error`: the "
        "largest difference of a reduced gradient shard from the exact sum.",
        "",
        markdown_table(rows),
        "",
        f"Total wall time {time.perf_counter() - start:.0f} s. Load average at start {load[0]:.1f}.",
    ]
    write_results(args.name, {"machine": info, "args": vars(args), "rows": rows, "load_at_start": load}, "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
