"""FastCLIP vs OpenCLIP at small global batches on the built-in captioned-shapes set (CPU).

For every global batch size, loss variant and seed, trains the same small open_clip model for the same number of
epochs with ``FastCLIPModule`` + ``GammaScheduler`` + ``TemperatureScheduler`` (Lightning ``Trainer``, one process)
and evaluates zero-shot top-1/top-5 (40 ``colour shape`` classes) and image<->text retrieval R@1 with
``ZeroShotEvaluation`` on a held-out split. Then measures, with 2 gloo processes, per-step time and bytes
communicated of OpenCLIP's reduction (gather with autograd) and FastCLIP's (no-grad gather of features and
estimator values).

    .venv/bin/python -m benchmarks.fastclip_small_batch            # full run (about 15 minutes on 2 cores)
    .venv/bin/python -m benchmarks.fastclip_small_batch --quick    # smoke run (2 short runs in-process, < 1 min)

Writes ``benchmarks/results/fastclip_small_batch.{json,md,png}`` (``..._quick`` with ``--quick``). The model is
``lightning_sdp.integrations.open_clip.NANO_CONFIG`` (``BENCH_MODEL`` in the stored results, its earlier name).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from benchmarks._common import free_port, markdown_table, write_results
from benchmarks.tools.fastclip import (
    add_training_args,
    bench_module,
    cached_datamodule,
    fit_and_score,
    run_jobs,
    run_quietly,
)
from lightning_sdp.integrations.open_clip import NANO_CONFIG

# inherited by the spawned worker processes, which import torch after this is set
os.environ.setdefault("OMP_NUM_THREADS", "2")


def train_one(loss: str, batch: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    from lightning_sdp.callbacks import GammaScheduler, TemperatureScheduler

    # One thread per process: on a loaded 2-core machine OpenMP threads spin-wait and cost ~10x the CPU time.
    torch.set_num_threads(args.threads)
    dm = cached_datamodule(args, batch, seed)
    pl.seed_everything(seed, verbose=False)
    steps = args.epochs * (dm.data_size // batch)
    module = bench_module(loss, steps, args)
    gamma = GammaScheduler(gamma_min=args.gamma_min, decay_epochs=max(1, args.epochs // 2))
    scores = fit_and_score(module, dm, args.epochs, [gamma, TemperatureScheduler()])
    return {"loss": loss, "batch": batch, "seed": seed, "steps": steps, **scores}


def _train_job(job: tuple[str, int, int, argparse.Namespace]) -> dict[str, Any]:
    return run_quietly(train_one, job)


def _comm_rank(rank: int, world: int, port: int, local_batch: int, steps: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_sdp.models.fastclip import FastCLIPModule
    from lightning_sdp.models.fastclip.distributed import GATHER_BYTES

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for loss in ("openclip", "fastclip_v3"):
        torch.manual_seed(0)
        module = FastCLIPModule(model=NANO_CONFIG, loss=loss, data_size=10_000, max_steps=100)
        ddp = DDP(module)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        times, loss_times = [], []
        GATHER_BYTES.reset()
        for step in range(steps + 2):
            images = torch.randn(local_batch, 3, 32, 32, generator=g)
            tokens = torch.randint(1, 400, (local_batch, 12), generator=g)
            idx = torch.arange(local_batch) + rank * local_batch + step * world * local_batch
            dist.barrier()
            t0 = time.perf_counter()
            e1, e2 = ddp(images, tokens)
            t1 = time.perf_counter()
            out_loss = module.loss_fn(e1, e2, idx, module.logit_scale_arg())
            t2 = time.perf_counter()
            out_loss.loss.backward()
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            if step >= 2:
                times.append(t3 - t0)
                loss_times.append(t2 - t1)
        d = NANO_CONFIG["embed_dim"]
        if loss == "openclip":
            # open_clip's gather_with_grad: forward all_gather of image and text features, backward all-to-all of
            # their gradients (torch.distributed.nn on gloo); bytes received by one rank per step
            feat_bytes = 2 * 2 * (world - 1) * local_batch * d * 4
        else:
            feat_bytes = GATHER_BYTES.bytes_received / (steps + 2)
        params = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        out[loss] = {
            "step_ms": 1000 * sorted(times)[len(times) // 2],
            "loss_forward_ms": 1000 * sorted(loss_times)[len(loss_times) // 2],
            "loss_bytes_per_step": feat_bytes,
            "param_allreduce_bytes": params,
        }
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def measure_comm(local_batches: list[int], steps: int) -> list[dict[str, Any]]:
    """Per-step time and loss bytes of OpenCLIP's and FastCLIP's reductions, 2 gloo processes per local batch."""
    import torch.multiprocessing as mp

    rows = []
    for b in local_batches:
        port = free_port()
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        procs = [ctx.Process(target=_comm_rank, args=(r, 2, port, b, steps, queue)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        res = queue.get()
        for loss, r in res.items():
            rows.append({"reduction": loss, "global_batch": 2 * b, **r})
    return rows


def summarise(runs: list[dict[str, Any]], losses: list[str], batches: list[int]) -> list[dict[str, Any]]:
    import numpy as np

    rows = []
    for b in batches:
        for loss in losses:
            sel = [r for r in runs if r["loss"] == loss and r["batch"] == b]
            if not sel:
                continue
            row = {"batch": b, "loss": loss, "seeds": len(sel)}
            for key in ("zeroshot_top1", "zeroshot_top5", "retrieval_r1"):
                vals = np.array([r[key] for r in sel]) * 100
                row[f"{key}_mean"] = float(vals.mean())
                row[f"{key}_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
            row["final_tau"] = float(np.mean([r["final_tau"] for r in sel]))
            row["wall_s"] = float(np.mean([r["wall_s"] for r in sel]))
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: openclip and fastclip_v3, batch 16, 64 pairs")
    parser.add_argument("--losses", default="openclip,sogclr,fastclip_v1,fastclip_v3")
    parser.add_argument("--batches", default="16,32,64,128")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    add_training_args(parser, "shapes", ["shapes", "digits"], num_train=1280, num_val=400)
    parser.add_argument("--gamma-min", type=float, default=0.8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--workers", type=int, default=2, help="training runs in parallel processes (1: in-process)")
    parser.add_argument("--comm-steps", type=int, default=10)
    parser.add_argument("--comm-batches", default="16,64")
    parser.add_argument("--no-comm", action="store_true")
    parser.add_argument("--name", default="fastclip_small_batch")
    parser.add_argument("--from-json", default=None, help="re-render the tables and plot of a finished run's JSON")
    args = parser.parse_args()
    if args.from_json:
        import json

        payload = json.loads(Path(args.from_json).read_text())
        md, payload["v3_vs_openclip"] = render_markdown(payload)
        a = payload["args"]
        fig = _figure(payload["summary"], a["losses"].split(","), [int(b) for b in str(a["batches"]).split(",")])
        write_results(a["name"], payload, md, fig)
        return
    if args.quick:
        args.losses, args.batches, args.seeds, args.epochs = "openclip,fastclip_v3", "16", 1, 1
        args.num_train, args.num_val, args.workers = 64, 48, 1
        args.comm_steps, args.comm_batches, args.name = 2, "8", "fastclip_small_batch_quick"
    losses = args.losses.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    runs = []
    t_start = time.perf_counter()
    jobs = [(loss, b, seed, args) for b in batches for seed in range(args.seeds) for loss in losses]
    jobs.sort(key=lambda j: j[1])  # small batches (most steps) first keeps the pool busy to the end
    for r in run_jobs(_train_job, jobs, args.workers):
        runs.append(r)
        print(
            f"batch {r['batch']:4d} seed {r['seed']} {r['loss']:12s} top1 {100 * r['zeroshot_top1']:5.1f} top5 "
            f"{100 * r['zeroshot_top5']:5.1f} R@1 {100 * r['retrieval_r1']:5.1f} tau {r['final_tau']:.3f} "
            f"({r['wall_s']:.0f}s, total {time.perf_counter() - t_start:.0f}s)",
            flush=True,
        )
    runs.sort(key=lambda r: (r["batch"], r["loss"], r["seed"]))
    summary = summarise(runs, losses, batches)
    comm = [] if args.no_comm else measure_comm([int(b) for b in args.comm_batches.split(",")], args.comm_steps)

    payload = {
        "args": vars(args),
        "runs": runs,
        "summary": summary,
        "v3_vs_openclip": [],
        "comm": comm,
        "bench_model": NANO_CONFIG,
        "total_wall_s": time.perf_counter() - t_start,
        "data_sizes": _data_sizes(args),
    }
    md, payload["v3_vs_openclip"] = render_markdown(payload)
    write_results(args.name, payload, md, _figure(summary, losses, batches))


def _data_sizes(args: argparse.Namespace) -> dict[str, int]:
    dm = cached_datamodule(args, 16, 0)
    return {"train": len(dm.train_set), "val": len(dm.val_set)}


def render_markdown(payload: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The result tables (from a payload, so ``--from-json`` can re-render a finished run)."""
    a = payload["args"]
    summary, comm = payload["summary"], payload["comm"]
    batches = [int(b) for b in str(a["batches"]).split(",")]
    sizes = payload.get("data_sizes", {"train": a["num_train"], "val": a["num_val"]})
    what = {
        "shapes": "Built-in captioned shapes (40 zero-shot `colour shape` classes)",
        "digits": "scikit-learn digits with prompt captions (10 zero-shot classes)",
    }[a["dataset"]]
    cols = [
        "batch",
        "loss",
        "seeds",
        "zeroshot_top1_mean",
        "zeroshot_top1_std",
        "zeroshot_top5_mean",
        "retrieval_r1_mean",
        "retrieval_r1_std",
        "final_tau",
        "wall_s",
    ]
    md = [
        f"{what}, {sizes['train']} train / {sizes['val']} val pairs, "
        f"{a['epochs']} epochs for every run, {a['seeds']} seeds, model `NANO_CONFIG` "
        f"(open_clip ViT, 32 px, 1-layer towers), lr {a['lr']}, tau0 {a['temperature']}, gamma_min {a['gamma_min']}, "
        f"v3: rho {a['rho']}, lr_tau {a['lr_tau']}. Metrics in %, mean and sample std over seeds; "
        f"total wall time {payload['total_wall_s'] / 60:.1f} min.",
        "",
        markdown_table(summary, cols, floatfmt="{:.3g}"),
    ]
    # v3 minus openclip, against the seed spread
    diff_rows = []
    for b in batches:
        v3 = next((r for r in summary if r["batch"] == b and r["loss"] == "fastclip_v3"), None)
        o = next((r for r in summary if r["batch"] == b and r["loss"] == "openclip"), None)
        if v3 and o:
            for key in ("zeroshot_top1", "retrieval_r1"):
                spread = max(v3[f"{key}_std"], o[f"{key}_std"])
                delta = v3[f"{key}_mean"] - o[f"{key}_mean"]
                diff_rows.append(
                    {
                        "batch": b,
                        "metric": key,
                        "v3_minus_openclip": delta,
                        "max_seed_std": spread,
                        "beats_by_more_than_spread": bool(delta > spread),
                    }
                )
    if diff_rows:
        md += ["", "FastCLIP-v3 minus OpenCLIP (points):", "", markdown_table(diff_rows, floatfmt="{:.3g}")]
    if comm:
        md += [
            "",
            "2 gloo processes (CPU), per-step median time and bytes each rank receives for the loss's feature "
            "reduction (OpenCLIP: all_gather with autograd + all-to-all of feature gradients; FastCLIP: no-grad "
            "all_gather of features, estimator values and indices). The DDP parameter all-reduce is the same for both.",
            "",
            markdown_table(comm, floatfmt="{:.4g}"),
        ]
    return "\n".join(md), diff_rows


def _figure(summary: list[dict[str, Any]], losses: list[str], batches: list[int]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    panels = ((axes[0], "zeroshot_top1", "zero-shot top-1 (%)"), (axes[1], "retrieval_r1", "retrieval R@1 (%)"))
    for ax, key, title in panels:
        for loss in losses:
            rows = [r for r in summary if r["loss"] == loss]
            if not rows:
                continue
            ax.errorbar(
                [r["batch"] for r in rows],
                [r[f"{key}_mean"] for r in rows],
                yerr=[r[f"{key}_std"] for r in rows],
                marker="o",
                capsize=3,
                label=loss,
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("global batch")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
