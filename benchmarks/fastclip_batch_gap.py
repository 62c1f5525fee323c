"""The batch-size gap: how much of OpenCLIP's large-batch advantage FastCLIP-v3 closes at a small batch (CPU).

FastCLIP's claim is that a small global batch with its per-sample estimators trains like a large one. That says
something only where a large batch is better. This benchmark trains, on the same data, for the same number of epochs,
from the same seeds (same initial weights and data order per seed):

* OpenCLIP's loss at the large global batch (512: the largest that runs a useful number of epochs on 2 cores),
* OpenCLIP's loss at the small batch (32),
* FastCLIP-v3 at the small batch,
* SigLIP at the small batch (the loss users pick for small batches today),

and reports the gap (large - small OpenCLIP) and the share of it FastCLIP-v3 (and SigLIP) closes, with the seed
spread. Data: the built-in captioned *scenes* (12,960 distinct captions of colour, shape, size, position and
background: most negatives differ from the positive in one attribute), 2,048 training pairs, 180 epochs. The earlier
small-batch benchmarks (``fastclip_small_batch``: shapes, 8 epochs; ``fastclip_many_visits``: scenes, 512 pairs)
tie because there a small batch is *better*: at a fixed number of epochs a large batch takes 16x fewer steps with the
same learning rate. Here the large batch gets its own learning rate (square-root scaling from the small batch's,
``--lr-scaling``; linear scaling made it diverge in a pilot run), a warm-up of 10 % of its steps, and enough epochs
to converge (720 steps: in a pilot, 240 steps left it far behind the small batch); its steps see 511 negatives (hard
ones among them), the small batch's 31. If the large batch still is not better by more than the seed spread, the
note says so: then this data cannot show the claim.

    .venv/bin/python -m benchmarks.fastclip_batch_gap --quick    # smoke run (in-process, < 1 min)
    .venv/bin/python -m benchmarks.fastclip_batch_gap            # full run: 4 configurations x 3 seeds, 2 workers
                                                                  # (about 50-60 min on 2 shared cores)

Writes ``benchmarks/results/fastclip_batch_gap.{json,md,png}`` (``..._quick`` with ``--quick``); while running,
``fastclip_batch_gap.partial.json`` after every finished run (removed at the end). Quality at fixed epochs, not
time: it may run on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from benchmarks._common import RESULTS_DIR, markdown_table, write_results
from benchmarks.tools.fastclip import add_training_args, cached_datamodule, fit_and_score, run_jobs, run_quietly
from lightning_sdp.integrations.open_clip import NANO_CONFIG

# inherited by the spawned worker processes, which import torch after this is set
os.environ.setdefault("OMP_NUM_THREADS", "1")

METRICS = ("zeroshot_top1", "retrieval_r1")


def configurations(large: int, small: int) -> list[tuple[str, str, int]]:
    """``(label, loss, global batch)`` of the four runs per seed."""
    return [
        ("openclip_large", "openclip", large),
        ("openclip_small", "openclip", small),
        ("fastclip_v3_small", "fastclip_v3", small),
        ("siglip_small", "siglip", small),
    ]


def learning_rate(batch: int, args: argparse.Namespace) -> float:
    """``args.lr`` at the small batch, scaled to ``batch`` by ``args.lr_scaling`` (``sqrt``, ``linear`` or ``none``)."""
    ratio = batch / args.small_batch
    return args.lr * {"sqrt": ratio**0.5, "linear": ratio, "none": 1.0}[args.lr_scaling]


def train_one(label: str, loss: str, batch: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run: ``FastCLIPModule`` on ``NANO_CONFIG`` with the callbacks a user adds, scored once at the end."""
    import lightning.pytorch as pl
    import torch

    from lightning_sdp.callbacks import GammaScheduler, TemperatureScheduler
    from lightning_sdp.models import FastCLIPModule

    torch.set_num_threads(args.threads)
    dm = cached_datamodule(args, batch, seed)
    pl.seed_everything(seed, verbose=False)  # the same initial weights for every configuration of a seed
    steps = args.epochs * (dm.data_size // batch)
    v3 = loss == "fastclip_v3"
    module = FastCLIPModule(
        model=NANO_CONFIG,
        loss=loss,
        lr=learning_rate(batch, args),
        weight_decay=0.1,
        warmup_steps=max(1, steps // 10),
        max_steps=steps,
        temperature=None if loss == "siglip" else args.temperature,
        lr_tau=args.lr_tau if v3 else None,
        rho=args.rho if v3 else None,
    )
    callbacks: list[Any] = [TemperatureScheduler()]
    if v3:
        callbacks.append(GammaScheduler(gamma_min=args.gamma_min, decay_epochs=max(1, args.epochs // 2)))
    scores = fit_and_score(module, dm, args.epochs, callbacks)
    run = {"label": label, "loss": loss, "batch": batch, "seed": seed, "steps": steps, "lr": module.hparams.lr}
    return {**run, **scores}


def _train_job(job: tuple[str, str, int, int, argparse.Namespace]) -> dict[str, Any]:
    return run_quietly(train_one, job)


def _points(runs: list[dict[str, Any]], label: str, metric: str) -> dict[int, float]:
    """Seed -> the metric in percent, for one configuration."""
    return {r["seed"]: 100 * r[metric] for r in runs if r["label"] == label}


def _spread(values: Sequence[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else float("nan")


def summarise(runs: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    """Per configuration: batch, seeds, and mean, sample std and min-max range of each metric (in %)."""
    rows = []
    for label in labels:
        mine = [r for r in runs if r["label"] == label]
        if not mine:
            continue
        row: dict[str, Any] = {"config": label, "batch": mine[0]["batch"], "lr": mine[0]["lr"], "seeds": len(mine)}
        for m in METRICS:
            values = list(_points(runs, label, m).values())
            row[f"{m}_mean"] = statistics.fmean(values)
            row[f"{m}_std"] = _spread(values)
            row[f"{m}_range"] = max(values) - min(values)
        row["final_tau"] = statistics.fmean(r["final_tau"] for r in mine)
        row["wall_s"] = statistics.fmean(r["wall_s"] for r in mine)
        rows.append(row)
    return rows


def gap_analysis(runs: list[dict[str, Any]], metric: str, peers: Sequence[str]) -> list[dict[str, Any]]:
    """The gap ``openclip_large - openclip_small`` and the share of it each peer closes, per seed (paired: the same
    seed is the same initial weights and data order) and over seeds.

    ``gap_std`` is the sample std of the per-seed gaps; ``seed_spread`` the larger sample std of the two OpenCLIP
    configurations. ``closed`` = (peer - small OpenCLIP) / gap, from the means; ``closed_per_seed`` from each seed.
    """
    large, small = _points(runs, "openclip_large", metric), _points(runs, "openclip_small", metric)
    seeds = sorted(set(large) & set(small))
    if not seeds:
        return []
    gaps = [large[s] - small[s] for s in seeds]
    gap = statistics.fmean(gaps)
    spread = max(_spread(list(large.values())), _spread(list(small.values())))
    rows = []
    for peer in peers:
        theirs = _points(runs, peer, metric)
        common = [s for s in seeds if s in theirs]
        if not common:
            continue
        gains = [theirs[s] - small[s] for s in common]
        per_seed = [
            g / (large[s] - small[s]) if large[s] != small[s] else float("nan")
            for s, g in zip(common, gains, strict=True)
        ]
        rows.append(
            {
                "metric": metric,
                "peer": peer,
                "gap": gap,
                "gap_std": _spread(gaps),
                "seed_spread": spread,
                "gap_beyond_spread": bool(gap > spread),
                "peer_minus_small": statistics.fmean(gains),
                "closed": statistics.fmean(gains) / gap if gap else float("nan"),
                "closed_per_seed": [round(x, 3) for x in per_seed],
                "seeds": len(common),
            }
        )
    return rows


def verdict(analysis: list[dict[str, Any]]) -> str:
    """One sentence per metric on the FastCLIP-v3 row: is there a gap, and how much of it does v3 close."""
    lines = []
    for row in analysis:
        if row["peer"] != "fastclip_v3_small":
            continue
        m = row["metric"]
        if row["seed_spread"] != row["seed_spread"]:  # nan: one seed
            lines.append(f"{m}: one seed, no spread to weigh the gap of {row['gap']:.2f} points against.")
        elif not row["gap_beyond_spread"]:
            lines.append(
                f"{m}: no gap larger than the seed spread (large - small OpenCLIP = {row['gap']:.2f} points, seed "
                f"std up to {row['seed_spread']:.2f}): this data cannot show the claim."
            )
        else:
            lines.append(
                f"{m}: the large batch is better by {row['gap']:.2f} points (seed std up to "
                f"{row['seed_spread']:.2f}); FastCLIP-v3 at the small batch closes {100 * row['closed']:.0f} % of it "
                f"(per seed: {', '.join(f'{100 * x:.0f} %' for x in row['closed_per_seed'])})."
            )
    return "\n".join(lines)


def _payload(args: argparse.Namespace, runs: list[dict[str, Any]], planned: int, wall_s: float) -> dict[str, Any]:
    labels = [c[0] for c in configurations(args.large_batch, args.small_batch)]
    analysis = [row for m in METRICS for row in gap_analysis(runs, m, ["fastclip_v3_small", "siglip_small"])]
    return {
        "args": {k: v for k, v in vars(args).items() if k != "from_json"},
        "planned_runs": planned,
        "complete": len(runs) == planned,
        "total_wall_s": wall_s,
        "runs": runs,
        "summary": summarise(runs, labels),
        "gap": analysis,
        "verdict": verdict(analysis),
    }


def render_markdown(payload: dict[str, Any]) -> str:
    a = payload["args"]
    status = "complete" if payload["complete"] else f"PARTIAL ({len(payload['runs'])} of {payload['planned_runs']})"
    cols = ["config", "batch", "lr", "seeds"]
    cols += [f"{m}_{s}" for m in METRICS for s in ("mean", "std", "range")] + ["final_tau", "wall_s"]
    gap_cols = ["metric", "peer", "gap", "gap_std", "seed_spread", "gap_beyond_spread", "peer_minus_small", "closed"]
    gap_cols += ["closed_per_seed"]
    return "\n".join(
        [
            f"Built-in captioned {a['dataset']}, {a['num_train']} train / {a['num_val']} held-out pairs, "
            f"{a['epochs']} epochs for every run, seeds 0..{a['seeds'] - 1} (a seed fixes the initial weights and "
            f"the data order of all four configurations), model `NANO_CONFIG`; learning rate {a['lr']} at batch "
            f"{a['small_batch']}, `{a['lr_scaling']}`-scaled for batch {a['large_batch']}; warm-up 10 % of the steps, "
            f"cosine after; tau0 {a['temperature']} (SigLIP: its own 0.1, bias -10); v3: rho {a['rho']}, lr_tau "
            f"{a['lr_tau']}, GammaScheduler(gamma_min={a['gamma_min']}, cosine over half the epochs). Zero-shot "
            f"top-1 over 40 `colour shape` classes and image<->text R@1, in %. Status: {status}; wall time "
            f"{payload['total_wall_s'] / 60:.1f} min.",
            "",
            markdown_table(payload["summary"], cols, floatfmt="{:.3g}"),
            "",
            "The gap (openclip_large - openclip_small, points; `gap_std` over the paired per-seed gaps, `seed_spread` "
            "the larger sample std of the two) and the share of it each small-batch peer closes "
            "(`closed` = (peer - openclip_small) / gap, from the means):",
            "",
            markdown_table(payload["gap"], gap_cols, floatfmt="{:.3g}"),
            "",
            payload["verdict"],
        ]
    )


def _figure(payload: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 4))
    summary = payload["summary"]
    for ax, m in zip(axes, METRICS, strict=True):
        names = [r["config"] for r in summary]
        ax.bar(names, [r[f"{m}_mean"] for r in summary], yerr=[r[f"{m}_std"] for r in summary], capsize=4)
        for r in payload["runs"]:
            ax.plot(names.index(r["label"]), 100 * r[m], "k.", alpha=0.6)
        ax.set_title(f"{m} (%): mean, seed std, seeds")
        ax.tick_params(axis="x", rotation=20)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 256 pairs, 2 epochs, batches 64/16")
    parser.add_argument("--large-batch", type=int, default=512)
    parser.add_argument("--small-batch", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--configs", default=None, help="comma-separated subset of the four labels (default: all)")
    parser.add_argument("--epochs", type=int, default=180)
    add_training_args(parser, "scenes", ["shapes", "scenes"], num_train=2048, num_val=1_000)
    parser.add_argument("--lr-scaling", default="sqrt", choices=["sqrt", "linear", "none"])
    parser.add_argument("--gamma-min", type=float, default=0.2, help="the paper scripts' value")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--workers", type=int, default=2, help="training runs in parallel processes (1: in-process)")
    parser.add_argument("--name", default="fastclip_batch_gap")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.quick:
        args.seeds, args.epochs, args.num_train, args.num_val = 1, 2, 256, 64
        args.large_batch, args.small_batch, args.workers = 64, 16, 1
        args.name = args.name if args.name.endswith("_quick") else args.name + "_quick"
    configs = configurations(args.large_batch, args.small_batch)
    if args.configs:
        configs = [c for c in configs if c[0] in args.configs.split(",")]
    # seed-major order: a run stopped early has every configuration of the seeds it finished
    jobs = [(label, loss, batch, seed, args) for seed in range(args.seeds) for label, loss, batch in configs]
    start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    partial = RESULTS_DIR / f"{args.name}.partial.json"
    for run in run_jobs(_train_job, jobs, args.workers):
        runs.append(run)
        print(
            f"{run['label']:18s} seed {run['seed']} top1 {100 * run['zeroshot_top1']:5.1f} R@1 "
            f"{100 * run['retrieval_r1']:5.1f} ({run['wall_s']:.0f}s, total {time.perf_counter() - start:.0f}s)",
            flush=True,
        )
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(_payload(args, runs, len(jobs), time.perf_counter() - start), indent=1) + "\n")
    payload = _payload(args, runs, len(jobs), time.perf_counter() - start)
    write_results(args.name, payload, render_markdown(payload), _figure(payload))
    partial.unlink(missing_ok=True)
    print(payload["verdict"])


if __name__ == "__main__":
    main()
