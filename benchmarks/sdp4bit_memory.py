"""Peak memory per rank of SDP4Bit beside DDP, ZeRO + DDP and FSDP2, with the bytes each should hold.

For every model, world size and method, one fresh set of gloo processes (forked from a server that imported torch and
Lightning once, so every rank starts from the same resident baseline) trains a char GPT on random tokens for a few
steps with AdamW, and each rank reports:

- its peak resident memory (``ru_maxrss``; on a GPU run ``torch.cuda.max_memory_allocated``) and the resident memory
  before the model was built, so the difference is what training added;
- the bytes its optimizer state holds, counted tensor by tensor (the exp_avg/exp_avg_sq of AdamW, a sharded
  optimizer's local shards, SDP4Bit's fp32 master shards, which play the part of the weights the optimizer steps);
- the bytes the method should hold per rank for ``P`` parameters on ``W`` ranks, without activations: DDP ``4P``
  weights + ``4P`` gradients + ``4P`` reducer buckets + ``8P`` AdamW; ZeRO + DDP the same with ``8P / W`` AdamW;
  FSDP2 ``16P / W`` (weights, gradients and AdamW sharded) + the largest unsharded block; SDP4Bit sharded ``4P``
  weights + ``4P`` gradients + ``4P`` flat gradient buffer + ``12P / W`` fp32 master and AdamW shards (padding
  counted); SDP4Bit with DDP's exchange (``"auto"`` may choose it) ``4P`` weights (also the master) + ``8P``
  gradients and buffer + ``8P`` AdamW.

``sdp4bit_auto`` trains until ``"auto"`` has decided (its peak includes the trial steps, and its choice is reported);
the others train ``--steps`` steps. Needs nothing but the CPU (no root, no shared data); one full run takes about
15 minutes on 2 cores (the GPT of 57M parameters dominates). Writes ``results/<name>.{json,md,png}``::

    python -m benchmarks.sdp4bit_memory            # both models, 2 and 4 processes, every method
    python -m benchmarks.sdp4bit_memory --quick    # the small GPT, 2 processes, 2 steps
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import free_port, machine_info, markdown_table, write_results

METHODS = ["ddp", "zero_ddp", "fsdp2", "sdp4bit_qwd_tlq_hs", "sdp4bit_auto"]
MODELS = {
    "gpt_3m": {"n_layer": 4, "n_head": 4, "n_embd": 256},  # the sweep's 3.2M-parameter GPT
    "gpt_57m": {"n_layer": 8, "n_head": 12, "n_embd": 768},
}
WORLDS = [2, 4]
VOCAB, BLOCK = 65, 64
# steps "auto" may need to decide: 5 for the first candidate, then 4 rounds of up to 7 candidates, and 2 after
AUTO_STEPS = 5 + 4 * 7 + 2
_PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed",
    "lightning.pytorch",
    "lightning_sdp",
    "benchmarks.sdp4bit_throughput",
]


# ------------------------------------------------------------------------------------------------ worker side
def rss_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``; the peak where that is missing)."""
    statm = Path("/proc/self/statm")
    if statm.exists():
        return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def optimizer_bytes(strategy: Any, optimizer: Any) -> dict[str, int]:
    """Bytes this rank's optimizer holds: its state tensors and, for SDP4Bit, the fp32 masters it steps (the
    local shards of a sharded optimizer; DTensors counted by their local part)."""
    from lightning_sdp.utilities import unwrap_optimizer

    raw = unwrap_optimizer(optimizer)
    inner = getattr(raw, "optim", raw)  # ZeroRedundancyOptimizer steps a local optimizer over its shard
    state = 0
    for entry in inner.state.values():
        for value in entry.values():
            local = value.to_local() if hasattr(value, "to_local") else value
            if hasattr(local, "numel") and local.dim() > 0:
                state += local.numel() * local.element_size()
    masters = 0
    for bucket in getattr(strategy, "buckets", []):
        if bucket.master is not bucket.model_flat:  # DDP's exchange steps the model's own buffer
            masters += bucket.master.numel() * bucket.master.element_size()
    return {"state": state, "masters": masters}


def warm_codec() -> None:
    """Run every kernel of SDP4Bit's default CPU codec once on a few values (numba compiles them on first use: a
    one-time cost per process, reported apart from what training holds)."""
    import torch

    from lightning_sdp.plugins.sdp4bit.exchange import NumbaOps, RoundingRNG

    ops, rng, x = NumbaOps(), RoundingRNG(0, 0, torch.device("cpu")), torch.randn(4096)
    payload, scales = ops.encode(x, 8, 128, "stochastic", rng, hadamard=32)
    payload, scales = ops.dequantize_sum_requantize(
        payload.view(2, -1), scales.view(2, -1), 8, 4, 128, "stochastic", rng
    )
    ops.dequantize_sum_hadamard(payload.view(1, -1), scales.view(1, -1), 4, 128, 32)
    payload, scales = ops.encode(x, 4, 2048, "stochastic", rng, reference=torch.zeros_like(x))
    ops.dequantize_add_(torch.zeros_like(x), payload, scales, 4, 2048)


def analytic_bytes(method: str, params: int, world: int, block: int, replicated: bool, padded: int) -> int:
    """The bytes ``method`` should hold per rank for ``params`` fp32 parameters (see the module docstring)."""
    p = params
    if method == "ddp" or (method.startswith("sdp4bit") and replicated):
        return 20 * p
    if method == "zero_ddp":
        return 12 * p + 8 * p // world
    if method == "fsdp2":
        return 16 * p // world + 8 * block
    return 12 * p + 12 * padded // world


def _largest_block(model: Any) -> int:
    blocks = getattr(getattr(model, "transformer", None), "h", [])
    return max((sum(p.numel() for p in block.parameters()) for block in blocks), default=0)


def _run(method: str, model_name: str, steps: int, world: int, accelerator: str) -> dict[str, Any]:
    """One rank of one run: build, train, measure."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.tools.sdp4bit import build_method

    codec = rss_bytes()
    if method.startswith("sdp4bit") and accelerator == "cpu" and importlib.util.find_spec("numba") is not None:
        warm_codec()
    base = rss_bytes()
    codec = base - codec
    args = argparse.Namespace(
        **MODELS[model_name], block=BLOCK, lr=1e-3, warmup_lr=2, steps=steps, seed=0, pg_timeout=600.0, world=world
    )
    model, strategy = build_method(method, args, VOCAB)
    params = sum(p.numel() for p in model.parameters())
    block = _largest_block(model)
    tokens = torch.randint(0, VOCAB, (64 * world, BLOCK + 1), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=accelerator,
        devices=world,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    if accelerator == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, train_dataloaders=loader)
    opt = optimizer_bytes(strategy, trainer.optimizers[0])
    decisions = getattr(strategy, "auto_decisions", [])
    replicated = bool(decisions) and decisions[-1].chosen.replicated
    padded = sum(b.padded for b in getattr(strategy, "buckets", [])) or params
    return {
        "method": method,
        "model": model_name,
        "world": world,
        "rank": dist.get_rank(),
        "params": params,
        "steps": trainer.global_step,
        "base_rss": base,
        "codec_rss": codec,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "end_rss": rss_bytes(),
        "cuda_peak": torch.cuda.max_memory_allocated() if accelerator == "cuda" else None,
        "optimizer_state": opt["state"],
        "masters": opt["masters"],
        "analytic": analytic_bytes(method, params, world, block, replicated, padded),
        "auto_choice": decisions[-1].chosen.describe() if decisions else None,
        "replicated": replicated,
    }


def _worker(rank: int, world: int, port: int, job: tuple[str, str, int, str], queue: Any) -> None:
    import warnings

    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", NODE_RANK="0",
    )  # fmt: skip
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    method, model_name, steps, accelerator = job
    try:
        queue.put((rank, _run(method, model_name, steps, world, accelerator)))
    except Exception:  # the run is recorded as failed, the others go on
        queue.put((rank, {"error": traceback.format_exc()}))


# ------------------------------------------------------------------------------------------------ driver side
def launch(job: tuple[str, str, int, str], world: int, context: Any, timeout: float) -> list[dict[str, Any]]:
    """Run one job on ``world`` fresh processes; their rows by rank (an ``error`` row per failed rank)."""
    queue = context.SimpleQueue()
    port = free_port()
    procs = [context.Process(target=_worker, args=(r, world, port, job, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    rows: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(rows) < world and time.monotonic() < deadline:
        if not queue.empty():
            rank, row = queue.get()
            rows[rank] = row
        elif any(p.exitcode not in (None, 0) for p in procs):
            break
        else:
            time.sleep(0.1)
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    return [rows.get(r, {"error": "no result (crashed or timed out)"}) for r in range(world)]


def summarise(rows: list[dict[str, Any]], args: argparse.Namespace) -> tuple[dict[str, Any], str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    ok = [r for r in rows if "error" not in r]
    table = []
    for model in args.models:
        for world in args.worlds:
            ranks = {m: [r for r in ok if r["model"] == model and r["world"] == world and r["method"] == m]
                     for m in args.methods}  # fmt: skip
            ddp_state = max((r["optimizer_state"] for r in ranks.get("ddp", [])), default=None)
            for method, group in ranks.items():
                if not group:
                    continue
                worst = max(group, key=lambda r: r["peak_rss"])
                state = max(r["optimizer_state"] for r in group)
                table.append({
                    "model": model, "params (M)": group[0]["params"] / 1e6, "ranks": world, "method": method,
                    "peak RSS MiB/rank (max)": worst["peak_rss"] / mib,
                    "added MiB/rank (peak - start)": max(r["peak_rss"] - r["base_rss"] for r in group) / mib,
                    "analytic MiB/rank": group[0]["analytic"] / mib,
                    "optimizer state MiB/rank": state / mib,
                    "state vs DDP": state / ddp_state if ddp_state else float("nan"),
                    "1/ranks": 1 / world,
                    "fp32 masters MiB/rank": max(r["masters"] for r in group) / mib,
                    "codec MiB (once)": max(r["codec_rss"] for r in group) / mib,
                    "GPU peak MiB": worst["cuda_peak"] / mib if worst["cuda_peak"] is not None else "",
                    "auto chose": group[0]["auto_choice"] or "",
                })  # fmt: skip
    fig, axes = plt.subplots(1, len(args.models), figsize=(6 * len(args.models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], args.models, strict=True):
        for world, marker in zip(args.worlds, "os^", strict=False):
            cells = [t for t in table if t["model"] == model and t["ranks"] == world]
            ax.plot([t["method"] for t in cells], [t["added MiB/rank (peak - start)"] for t in cells], marker=marker,
                    label=f"{world} ranks, measured")  # fmt: skip
            ax.plot([t["method"] for t in cells], [t["analytic MiB/rank"] for t in cells], marker=marker, ls="--",
                    label=f"{world} ranks, analytic")  # fmt: skip
        ax.set(title=model, ylabel="MiB per rank (peak added by training)")
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    failed = [f"- `{r.get('method')}`: {r['error'].strip().splitlines()[-1]}" for r in rows if "error" in r]
    md = [
        "# Peak memory per rank: SDP4Bit, DDP, ZeRO + DDP, FSDP2",
        "",
        f"Char GPT on random tokens, block {BLOCK}, batch 2 per rank, AdamW, fp32, gloo on the CPU; {args.steps} "
        f"steps ({AUTO_STEPS} for `sdp4bit_auto`, which trains until it has decided). Peak RSS: `ru_maxrss` of each "
        "rank (a fresh process per run, forked from one that imported torch and Lightning); added: the peak less "
        "the resident memory before the model was built. Analytic: the bytes the method should hold per rank "
        "without activations (see the module docstring). Optimizer state: the bytes of its state tensors on this "
        "rank (AdamW's two moments, the local shards where sharded), its ratio to DDP's beside 1/ranks; fp32 "
        "masters: SDP4Bit's master shards (the whole buffers while it runs DDP's exchange on a bf16 model; none "
        "on an fp32 one, which steps the weights in place). Codec: what SDP4Bit's numba codec adds to a process "
        "once (import and compilation, before the baseline).",
        "",
        markdown_table(table, floatfmt="{:.4g}"),
        "",
    ]
    if failed:
        md += ["## Runs that failed", "", *failed, ""]
    payload = {"args": vars(args), "rows": rows, "table": table}
    return payload, "\n".join(md), fig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the small GPT, 2 processes, 2 steps; writes *_quick.*")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=None, help=f"default {list(MODELS)}")
    p.add_argument("--worlds", type=int, nargs="+", default=None, help=f"processes per run (default {WORLDS})")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=None, help=f"default {METHODS}")
    p.add_argument("--steps", type=int, default=None, help="steps per run but sdp4bit_auto's (default 4)")
    p.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take before it is abandoned")
    p.add_argument("--name", default="sdp4bit_memory", help="stem of the files in benchmarks/results/")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    import torch.multiprocessing as mp

    args = _parser().parse_args(argv)
    if args.quick:
        args.models = args.models or ["gpt_3m"]
        args.worlds = args.worlds or [2]
        args.steps = args.steps or 2
    args.models = args.models or list(MODELS)
    args.worlds = args.worlds or WORLDS
    args.methods = args.methods or METHODS
    args.steps = args.steps or 4
    if args.steps < 1:
        raise SystemExit(f"--steps must be at least 1, got {args.steps}.")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    load_start, t0 = os.getloadavg(), time.perf_counter()
    rows: list[dict[str, Any]] = []
    for model in args.models:
        for world in args.worlds:
            for method in args.methods:
                steps = AUTO_STEPS if method == "sdp4bit_auto" and not args.quick else args.steps
                started = time.perf_counter()
                ranks = launch((method, model, steps, args.accelerator), world, context, args.timeout)
                rows += [{"method": method, "model": model, "world": world, **r} for r in ranks]
                peak = max((r["peak_rss"] for r in ranks if "peak_rss" in r), default=float("nan"))
                print(f"[memory] {model} x {world} {method:<20} peak {peak / 2**20:8.1f} MiB/rank "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    payload, md, fig = summarise(rows, args)
    payload["total_wall_s"] = time.perf_counter() - t0
    payload["load_avg_start"], payload["load_avg_end"] = load_start, os.getloadavg()
    md += f"\nTotal wall time {payload['total_wall_s']:.0f} s; {machine_info()['cores']} cores.\n"
    write_results(args.name + ("_quick" if args.quick else ""), payload, md, fig)
    print(md)


if __name__ == "__main__":
    main()
