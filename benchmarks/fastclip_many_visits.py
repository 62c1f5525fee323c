"""FastCLIP-v3 vs OpenCLIP and SigLIP where the paper says FastCLIP's estimators work: many visits per sample.

``benchmarks.fastclip_small_batch_10k`` trains on 10,240 pairs for 3 epochs, so every sample is visited 3 times and
its estimator u (a moving average of the sample's mini-batch inner function g, updated only when the sample is in a
batch) cannot track g. This benchmark trains on 512 pairs for 30 epochs: every sample is visited 30 times, for half
the compute of a 10k run (15,360 sample visits against 30,720; ``--num-train 1024`` matches it, at twice the time:
the default was halved to fit a shared 2-core machine). It runs the same
training, the same held-out evaluation (1,000 pairs of another generator seed; zero-shot top-1/top-5 over 40
``colour shape`` classes, image<->text R@1) and the same end-of-epoch u diagnostic as the 10k run, at global batch
16 and 32 with 3 seeds, through that module's ``train_one``.

The u diagnostic comes in two parts, both for FastCLIP-v3:

* every run, at the end of every epoch (after ``epoch + 1`` visits of every sample): the median ``|u - g| / g`` of
  256 fixed training anchors' stored u against the exact full-data g, next to the same error of a fresh mini-batch
  estimate from ``B - 1`` random negatives (what OpenCLIP's loss divides by);
* the first ``--visit-probe-seeds`` seeds: ``benchmarks.fastclip_u_diagnostic.UDiagnosticProbe`` on
  ``--visit-probe-anchors`` anchors, scoring each anchor exactly at every visit (``u_new`` against ``g_then``, the
  error of the value that weights the anchor's gradient at that step; the drift of g between two visits).

    .venv/bin/python -m benchmarks.fastclip_many_visits            # full run (47 minutes on 2 loaded cores)
    .venv/bin/python -m benchmarks.fastclip_many_visits --quick    # smoke run (in-process, < 1 min)

Writes ``benchmarks/results/fastclip_many_visits.{json,md,png}`` (``..._quick`` with ``--quick``); while running,
``fastclip_many_visits.partial.json`` after every finished run (removed when the run completes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, markdown_table, write_results
from benchmarks.tools.fastclip import add_training_args, run_jobs, run_quietly, small_batch_payload, train_with_u_probe

# inherited by the spawned worker processes, which import torch after this is set
os.environ.setdefault("OMP_NUM_THREADS", "1")

REFERENCE_VISITS = 10_240 * 3
"""Sample visits of one ``fastclip_small_batch_10k`` run (10,240 pairs x 3 epochs): the compute this run matches."""


def train_one(loss: str, batch: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """The 10k benchmark's run (same module, callbacks, evaluation and end-of-epoch u probe), with the per-visit
    probe added to FastCLIP-v3's first ``args.visit_probe_seeds`` seeds."""
    import torch

    from benchmarks.tools.fastclip import UDiagnosticProbe

    extra: tuple[Any, ...] = ()
    if loss == "fastclip_v3" and seed < args.visit_probe_seeds:
        gen = torch.Generator().manual_seed(54321)
        anchors = torch.randperm(args.num_train, generator=gen)[: args.visit_probe_anchors]
        extra = (UDiagnosticProbe(anchors, batch, probes_per_epoch=1),)
    run = train_with_u_probe(loss, batch, seed, args, extra_callbacks=extra)
    run["visit_summary"] = extra[0].visit_summary() if extra else []
    return run


def _train_job(job: tuple[str, int, int, argparse.Namespace]) -> dict[str, Any]:
    return run_quietly(train_one, job)


def visit_curve(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (batch, visit) for FastCLIP-v3, from the per-visit probe: the error of ``u_new`` (the value that weights
    the gradient) and of the batch's own mini-batch g against the exact g at that step, and the drift of g since the
    anchor's previous visit; medians over the anchors, mean over the probed seeds."""
    import numpy as np

    rows = []
    for b in sorted({r["batch"] for r in runs if r.get("visit_summary")}):
        sel = [r["visit_summary"] for r in runs if r["batch"] == b and r.get("visit_summary")]
        for e in range(min(len(v) for v in sel)):

            def mean(get: Any, rows_: list[list[dict[str, Any]]] = sel, e_: int = e) -> float:
                vals = [get(v[e_]) for v in rows_]
                vals = [x for x in vals if not math.isnan(x)]
                return float(np.mean(vals)) if vals else math.nan

            rows.append(
                {
                    "batch": b,
                    "visit": e + 1,
                    "gamma": mean(lambda v: v["gamma"]),
                    "u_new_rel_err": mean(lambda v: v["u_new_vs_g_then"]["rel_err"]),
                    "u_new_log_ratio": mean(lambda v: v["u_new_vs_g_then"]["log_ratio"]),
                    "minibatch_rel_err": mean(lambda v: v["minibatch_vs_g_then"]["rel_err"]),
                    "drift_prev_over_then": mean(lambda v: v["drift_prev_over_then"]),
                    "gap_steps": mean(lambda v: v["gap_steps_median"]),
                    "visits_seen": int(sum(v[e]["visits"] for v in sel)),
                }
            )
    return rows


def render_markdown(payload: dict[str, Any]) -> str:
    """The result tables (from a payload, so ``--from-json`` can re-render a run)."""
    a = payload["args"]
    done = f"{len(payload['runs'])} of {payload['planned_runs']} runs"
    status = "complete" if payload.get("complete") else f"PARTIAL ({done})"
    visits = a["num_train"] * a["epochs"]
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
    probe = [r for r in payload["probe"] if r["loss"] == "fastclip_v3"]
    for r in probe:
        r["visits"] = r["epoch"] + 1
    probe_cols = ["batch", "visits", "gamma", "tau", "u_rel_err_median", "minibatch_rel_err_median", "u_rel_err_p90"]
    md = [
        f"Built-in captioned scenes, {a['num_train']} train / {a['num_val']} held-out pairs, {a['epochs']} epochs: "
        f"every sample visited {a['epochs']} times; {visits:,} sample visits per run = "
        f"{visits / REFERENCE_VISITS:.3g} x the compute of a `fastclip_small_batch_10k` run (10,240 pairs x 3 "
        f"epochs). Seeds 0..{a['seeds'] - 1}, model `NANO_CONFIG`, lr {a['lr']}, tau0 {a['temperature']} (SigLIP: its "
        f"default 0.1, bias -10), GammaScheduler(gamma_min={a['gamma_min']}, cosine over "
        f"{a['gamma_decay_fraction']:.2g} of the epochs), v3: rho {a['rho']}, lr_tau {a['lr_tau']}. Metrics in %, "
        f"mean over seeds; `_range` = max - min over seeds. Status: {status}; wall time "
        f"{payload['total_wall_s'] / 60:.1f} min.",
        "",
        markdown_table(payload["summary"], cols, floatfmt="{:.3g}"),
        "",
        "FastCLIP-v3 minus each peer (points), against the seed spread (the larger of the two min-max ranges):",
        "",
        markdown_table(payload["comparisons"], floatfmt="{:.3g}"),
        "",
        f"u error against visits, FastCLIP-v3 (end of each epoch, {a['probe_anchors']} fixed anchors, both sides, "
        "mean over seeds): median |u - g| / g of the stored u against the exact full-data g, next to a fresh "
        "mini-batch estimate from B - 1 random negatives:",
        "",
        markdown_table(probe, probe_cols, floatfmt="{:.3g}"),
        "",
        f"At every visit (per-visit probe, {a['visit_probe_anchors']} anchors x 2 sides, seeds "
        f"0..{a['visit_probe_seeds'] - 1}): `u_new_rel_err` = median |u_new - g_then| / g_then, u_new being the value "
        "that weights the anchor's gradient at that step and g_then the exact g at that step; `minibatch_rel_err` "
        "the same for the batch's own B - 1 negatives; `drift_prev_over_then` = g at the previous visit / g_then; "
        "`gap_steps` = optimizer steps between two visits.",
        "",
        markdown_table(payload["visit_curve"], floatfmt="{:.3g}"),
    ]
    return "\n".join(md)


def _figure(payload: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    summary = payload["summary"]
    batches = sorted({r["batch"] for r in summary})
    ax = axes[0]
    for loss in sorted({r["loss"] for r in summary}):
        rows = [r for r in summary if r["loss"] == loss]
        ax.errorbar(
            [r["batch"] for r in rows],
            [r["zeroshot_top1_mean"] for r in rows],
            yerr=[r["zeroshot_top1_range"] / 2 for r in rows],
            marker="o",
            capsize=3,
            label=loss,
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("global batch")
    ax.set_title("zero-shot top-1 (%), bars: seed range")
    ax.legend()
    for b in batches:
        rows = [r for r in payload["probe"] if r["loss"] == "fastclip_v3" and r["batch"] == b]
        line = axes[1].plot([r["epoch"] + 1 for r in rows], [r["u_rel_err_median"] for r in rows], label=f"u B={b}")
        axes[1].plot(
            [r["epoch"] + 1 for r in rows],
            [r["minibatch_rel_err_median"] for r in rows],
            ls="--",
            color=line[0].get_color(),
            label=f"mini-batch B={b}",
        )
        rows = [r for r in payload["visit_curve"] if r["batch"] == b]
        axes[2].plot([r["visit"] for r in rows], [r["u_new_rel_err"] for r in rows], marker=".", label=f"u_new B={b}")
    axes[1].set_title("end of epoch: median |estimate - g| / g (stored u vs g now)")
    axes[2].set_title("at each visit: median |u_new - g_then| / g_then")
    for ax in axes[1:]:
        ax.set_xlabel("visits per sample")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _payload(args: argparse.Namespace, runs: list[dict[str, Any]], planned: int, wall_s: float) -> dict[str, Any]:
    """The 10k benchmark's payload, its comparisons on zero-shot top-1 only, plus the per-visit u curve."""
    payload = small_batch_payload(args, runs, planned, wall_s)
    payload["comparisons"] = [c for c in payload["comparisons"] if c["metric"] == "zeroshot_top1"]
    payload["visit_curve"] = visit_curve(payload["runs"])
    return payload


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: v3 and openclip, 64 pairs, batch 16")
    parser.add_argument("--losses", default="fastclip_v3,openclip,siglip")
    parser.add_argument("--batches", default="16,32")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=30, help="visits per sample")
    add_training_args(parser, "scenes", ["shapes", "scenes"], num_train=512, num_val=1_000)
    parser.add_argument("--gamma-min", type=float, default=0.2, help="the paper scripts' value")
    parser.add_argument("--gamma-decay-fraction", type=float, default=0.5, help="cosine decay over this part")
    parser.add_argument("--probe-anchors", type=int, default=256, help="anchors of the end-of-epoch u probe")
    parser.add_argument("--visit-probe-anchors", type=int, default=8, help="anchors scored exactly at every visit")
    parser.add_argument("--visit-probe-seeds", type=int, default=1, help="v3 seeds that carry the per-visit probe")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--workers", type=int, default=2, help="training runs in parallel processes (1: in-process)")
    parser.add_argument("--name", default="fastclip_many_visits")
    parser.add_argument("--from-json", default=None, help="re-render the tables and plot of a (partial) run's JSON")
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.from_json:
        stored = json.loads(Path(args.from_json).read_text())
        a = argparse.Namespace(**stored["args"])
        payload = _payload(a, stored["runs"], stored["planned_runs"], stored["total_wall_s"])
        write_results(a.name, payload, render_markdown(payload), _figure(payload))
        return
    if args.quick:
        args.losses, args.batches, args.seeds, args.epochs = "fastclip_v3,openclip", "16", 1, 3
        args.num_train, args.num_val, args.probe_anchors, args.visit_probe_anchors = 64, 48, 16, 4
        args.workers, args.name = 1, args.name + "_quick"
    losses = args.losses.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    # seed-major order: a run stopped early has every (batch, loss) for the seeds it finished
    jobs = [(loss, b, seed, args) for seed in range(args.seeds) for b in batches for loss in losses]
    t_start = time.perf_counter()
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
        stored = _payload(args, runs, len(jobs), time.perf_counter() - t_start)
        partial.write_text(json.dumps(stored, indent=1) + "\n")
    payload = _payload(args, runs, len(jobs), time.perf_counter() - t_start)
    write_results(args.name, payload, render_markdown(payload), _figure(payload))
    partial.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
