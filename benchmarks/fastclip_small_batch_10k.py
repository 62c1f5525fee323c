"""FastCLIP vs OpenCLIP, SigLIP and SogCLR at small global batches on 10,240 procedural pairs (CPU), with a
diagnostic of the per-sample estimators u.

For every global batch size (16, 32, 64), loss (FastCLIP-v3, OpenCLIP, SigLIP, SogCLR) and seed (3), trains the same
small open_clip model for the same number of epochs with ``FastCLIPModule`` + ``GammaScheduler`` +
``TemperatureScheduler`` (Lightning ``Trainer``, one process per run, two runs in parallel) on the built-in
captioned shapes (10,240 generated training pairs, 1,000 held-out pairs from another generator seed), and evaluates
zero-shot top-1/top-5 (40 ``colour shape`` classes, classifier from ``open_clip.build_zero_shot_classifier``) and
image<->text retrieval R@1 with ``ZeroShotEvaluation`` on the held-out pairs.

The u diagnostic (compositional losses only): at the end of every epoch, a fixed sample of 256 training anchors is
scored exactly against the *whole* training set with the current model and temperature: the full-data inner
function ``g1_i = mean_{j != i} exp((e1_i.e2_j - e1_i.e2_i) / tau)`` (and ``g2_i``, text anchors). Reported: the
median relative error ``|u_i - g_i| / g_i`` of the estimators against it, next to the median relative error of the
mini-batch estimate that OpenCLIP's loss uses (the same mean over ``B - 1`` random negatives, B the global batch).
If the estimators do their job, the first is clearly below the second.

    .venv/bin/python -m benchmarks.fastclip_small_batch_10k            # full run (about 10 minutes on 2 idle cores)
    .venv/bin/python -m benchmarks.fastclip_small_batch_10k --quick    # smoke run (2 short runs in-process, < 1 min)

Writes ``benchmarks/results/fastclip_small_batch_10k.{json,md,png}`` (``..._quick`` with ``--quick``), and after
every finished run ``benchmarks/results/fastclip_small_batch_10k.partial.json``. The model is
``lightning_sdp.integrations.open_clip.NANO_CONFIG`` (``BENCH_MODEL`` in the stored results, its earlier name).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, markdown_table, write_results
from benchmarks.tools.fastclip import (
    add_training_args,
    run_jobs,
    run_quietly,
)
from benchmarks.tools.fastclip import small_batch_payload as _payload
from benchmarks.tools.fastclip import train_with_u_probe as train_one

# inherited by the spawned worker processes, which import torch after this is set
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _train_job(job: tuple[str, int, int, argparse.Namespace]) -> dict[str, Any]:
    return run_quietly(train_one, job)


def render_markdown(payload: dict[str, Any]) -> str:
    """The result tables (from a payload, so ``--from-json`` can re-render a run)."""
    a = payload["args"]
    sizes = payload["data_sizes"]
    cols = [
        "batch",
        "loss",
        "seeds",
        "zeroshot_top1_mean",
        "zeroshot_top1_range",
        "zeroshot_top5_mean",
        "retrieval_r1_mean",
        "retrieval_r1_range",
        "final_tau",
        "u_err_median",
        "minibatch_err_median",
        "wall_s",
    ]
    done = f"{len(payload['runs'])} of {payload['planned_runs']} runs"
    status = "complete" if payload.get("complete") else f"PARTIAL ({done})"
    what = {
        "shapes": "Built-in captioned shapes (400 distinct captions",
        "scenes": "Built-in captioned scenes (12,960 distinct captions",
    }[a["dataset"]]
    md = [
        f"{what}; 40 zero-shot `colour shape` classes), {sizes['train']} train / {sizes['val']} "
        f"held-out pairs, {a['epochs']} epochs for every run, seeds 0..{a['seeds'] - 1}, model `NANO_CONFIG` "
        f"(open_clip "
        f"ViT, 32 px, 1-layer towers), lr {a['lr']}, tau0 {a['temperature']} (SigLIP: its default 0.1, bias -10), "
        f"GammaScheduler(gamma_min={a['gamma_min']}, decay over {a['gamma_decay_fraction']:.2g} of the epochs), "
        f"v3: rho {a['rho']}, lr_tau {a['lr_tau']}, temperature_gradient='reference'. Metrics in %, mean over seeds; "
        f"`_range` = max - min over seeds. Status: {status}; wall time {payload['total_wall_s'] / 60:.1f} min.",
        "",
        markdown_table(payload["summary"], cols, floatfmt="{:.3g}"),
        "",
        "FastCLIP-v3 minus each peer (points); the target is `v3_minus_peer > seed_spread` (the larger of the two "
        "methods' min-max ranges over the seeds):",
        "",
        markdown_table(payload["comparisons"], floatfmt="{:.3g}"),
        "",
        f"u diagnostic (end of each epoch, {a.get('probe_anchors', 256)} fixed training anchors, both sides; mean over "
        "seeds): median and 90th "
        "percentile of |u - g| / g against the exact full-data inner function g, next to the same for a mini-batch "
        "estimate from B - 1 random negatives (what the mini-batch loss divides by):",
        "",
        markdown_table(payload["probe"], floatfmt="{:.3g}"),
    ]
    return "\n".join(md)


def _figure(summary: list[dict[str, Any]], probe: list[dict[str, Any]], losses: list[str], batches: list[int]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    panels = ((axes[0], "zeroshot_top1", "zero-shot top-1 (%)"), (axes[1], "retrieval_r1", "retrieval R@1 (%)"))
    for ax, key, title in panels:
        for loss in losses:
            rows = [r for r in summary if r["loss"] == loss]
            if not rows:
                continue
            mean = [r[f"{key}_mean"] for r in rows]
            half = [r[f"{key}_range"] / 2 for r in rows]
            ax.errorbar([r["batch"] for r in rows], mean, yerr=half, marker="o", capsize=3, label=loss)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("global batch")
        ax.set_title(title + ", bars: seed range")
        ax.grid(alpha=0.3)
    axes[0].legend()
    ax = axes[2]
    for loss, b in sorted({(r["loss"], r["batch"]) for r in probe}):
        rows = [r for r in probe if r["loss"] == loss and r["batch"] == b]
        epochs = [r["epoch"] for r in rows]
        line = ax.plot(epochs, [r["u_rel_err_median"] for r in rows], marker="o", label=f"u {loss} B={b}")
        ax.plot(
            [r["epoch"] for r in rows],
            [r["minibatch_rel_err_median"] for r in rows],
            ls="--",
            color=line[0].get_color(),
            label=f"mini-batch B={b}",
        )
    ax.set_xlabel("epoch")
    ax.set_yscale("log")
    ax.set_title("median |estimate - g| / g")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: fastclip_v3 and openclip, 128 pairs, batch 16")
    parser.add_argument("--losses", default="fastclip_v3,openclip,siglip,sogclr")
    parser.add_argument("--batches", default="16,32,64")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    add_training_args(parser, "scenes", ["shapes", "scenes"], num_train=10_240, num_val=1_000)
    parser.add_argument("--gamma-min", type=float, default=0.2, help="the paper scripts' value")
    parser.add_argument(
        "--gamma-decay-fraction", type=float, default=0.5, help="cosine decay over this part of the epochs"
    )
    parser.add_argument("--probe-anchors", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--workers", type=int, default=2, help="training runs in parallel processes (1: in-process)")
    parser.add_argument("--order", default="batch", choices=["batch", "seed"], help="job order (see main)")
    parser.add_argument("--name", default="fastclip_small_batch_10k")
    parser.add_argument("--from-json", default=None, help="re-render the tables and plot of a (partial) run's JSON")
    args = parser.parse_args()
    if args.from_json:
        payload = json.loads(Path(args.from_json).read_text())
        a = argparse.Namespace(**payload["args"])
        payload = _payload(a, payload["runs"], payload["planned_runs"], payload["total_wall_s"])
        fig = _figure(payload["summary"], payload["probe"], a.losses.split(","), [int(b) for b in a.batches.split(",")])
        write_results(a.name, payload, render_markdown(payload), fig)
        return
    if args.quick:
        args.losses, args.batches, args.seeds, args.epochs = "fastclip_v3,openclip", "16", 1, 2
        args.num_train, args.num_val, args.probe_anchors, args.workers = 128, 48, 32, 1
        args.name += "_quick"
    losses = args.losses.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    t_start = time.perf_counter()
    # batch-major order (smallest batch first, where the claim is): a run stopped early has every loss and seed at
    # the batches it finished; --order seed gives every (batch, loss) for the seeds it finished instead
    if args.order == "batch":
        jobs = [(loss, b, seed, args) for b in batches for seed in range(args.seeds) for loss in losses]
    else:
        jobs = [(loss, b, seed, args) for seed in range(args.seeds) for b in batches for loss in losses]
    runs: list[dict[str, Any]] = []
    partial = RESULTS_DIR / f"{args.name}.partial.json"
    for r in run_jobs(_train_job, jobs, args.workers):
        runs.append(r)
        p = r["u_probe"][-1] if r["u_probe"] else None
        diag = f" u-err {p['u_rel_err_median']:.3f} mb-err {p['minibatch_rel_err_median']:.3f}" if p else ""
        print(
            f"batch {r['batch']:3d} seed {r['seed']} {r['loss']:12s} top1 {100 * r['zeroshot_top1']:5.1f} R@1 "
            f"{100 * r['retrieval_r1']:5.1f} tau {r['final_tau']:.3f}{diag} ({r['wall_s']:.0f}s, total "
            f"{time.perf_counter() - t_start:.0f}s)",
            flush=True,
        )
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(_payload(args, runs, len(jobs), time.perf_counter() - t_start), indent=1) + "\n")
    payload = _payload(args, runs, len(jobs), time.perf_counter() - t_start)
    figure = _figure(payload["summary"], payload["probe"], losses, batches)
    write_results(args.name, payload, render_markdown(payload), figure)


if __name__ == "__main__":
    main()
