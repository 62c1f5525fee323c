"""Why FastCLIP's per-sample estimators u miss the full-data inner function g at small batches, measured.

Trains FastCLIP-v3 and SogCLR (``FastCLIPModule`` + ``GammaScheduler`` + ``TemperatureScheduler``, Lightning
``Trainer``, one process, one thread) on 10,240 generated ``scenes`` pairs, as ``benchmarks.fastclip_small_batch_10k``
does, with :class:`UDiagnosticProbe` attached. The probe follows a fixed sample of training anchors (both sides) and

* at every visit of an anchor (a training batch that contains it) records the estimator before (``u_old``) and after
  (``u_new``) the loss's update, and scores the anchor *exactly* against the whole training set with the parameters
  and temperature of that step (``g_then``, before the optimizer step, i.e. what the loss saw). ``u_new`` is the value
  whose inverse weights the anchor's gradient at that step, so ``|u_new - g_then| / g_then`` is the estimation error
  that matters; ``u_old`` against ``g_then`` is what the carried estimate brings in, and ``g_prev / g_then`` (``g_prev``
  the exact g at the anchor's previous visit) is how far g moved between two visits (staleness). The same moving
  average applied to ``g_batch / g_then`` (``g_batch`` the batch's own mini-batch g) is the ratio ``u / g`` would have
  if g had stood still (mini-batch sampling error alone); ``log(u_new / g_then)`` minus its log is the part that
  comes from g changing (``staleness_log_factor``);
* several times per epoch (``--probes-per-epoch``, default 4) scores all anchors exactly (``g_now``) and reports the
  total error of the stored u against ``g_now``, the error against ``g_then`` of the anchor's last update, the drift
  ``g_then / g_now``, the anchors' age in steps, the signed bias (median ``log(u / g)``, share of ``u > g``), the same
  for a fresh mini-batch estimate from ``B - 1`` random negatives, and the rare-terms statistics: the share of g
  carried by an anchor's top-1 and top-``(B - 1)`` negatives, the number of top negatives ``k50`` that carry half of
  g, and the probability that a random batch of ``B - 1`` negatives contains at least one of them.

The probe embeds the training set as training does (the training set's own transform; the runs use
``augment=False``, and the model has no dropout, so train and eval mode give the same embeddings) and checks it: from
the mini-batch g it recomputes with the batch's indices it predicts the loss's update ``(1 - gamma) u_old + gamma g``
and compares that with the ``u_new`` the loss stored (``probe_vs_training_u_rel_diff``, the largest relative
difference; at gamma = 1 this compares the two mini-batch g directly).

    .venv/bin/python -m benchmarks.fastclip_u_diagnostic            # 8 runs, 4 epochs (about 25 min, one core)
    .venv/bin/python -m benchmarks.fastclip_u_diagnostic --quick    # smoke run (< 1 min)
    .venv/bin/python -m benchmarks.fastclip_u_diagnostic --merge a.json b.json   # stored runs into one result

Writes ``benchmarks/results/fastclip_u_diagnostic.{json,md,png}`` (``..._quick`` with ``--quick``) and, after every
finished run, ``fastclip_u_diagnostic.partial.json``. ``--merge`` joins stored runs of the same settings (a later
file's run replaces an earlier one with the same label, after checking that they agree) into
``fastclip_u_diagnostic.*``, listing the files in the markdown; the committed result was made that way from the
8-run result and a rerun of three of its runs that added the "g stood still" columns.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import RESULTS_DIR, markdown_table, write_results
from benchmarks.tools.fastclip import (
    UDiagnosticProbe,
    add_training_args,
    bench_module,
    cached_datamodule,
    fit_and_score,
    run_quietly,
)
from lightning_sdp.integrations.open_clip import NANO_CONFIG

os.environ.setdefault("OMP_NUM_THREADS", "1")

DEFAULT_RUNS = (
    "fastclip_v3:16:0.2:0,sogclr:16:0.2:0,fastclip_v3:16:1.0:0,fastclip_v3:32:0.2:0,"
    "fastclip_v3:16:0.2:1,fastclip_v3:16:1.0:1,fastclip_v3:16:0.2:2,fastclip_v3:16:1.0:2"
)
"""``loss:global_batch:gamma_min:seed``; ``gamma_min = 1`` keeps gamma at 1 (u = the latest mini-batch estimate: no
carried, stale part), the controlled test of staleness, run with three seeds next to the default 0.2."""


def parse_runs(spec: str) -> list[tuple[str, int, float, int]]:
    """``"loss:batch:gamma_min[:seed],..."`` -> ``[(loss, batch, gamma_min, seed), ...]`` (seed default 0)."""
    out = []
    for item in spec.split(","):
        loss, batch, gamma_min, *seed = item.split(":")
        out.append((loss, int(batch), float(gamma_min), int(seed[0]) if seed else 0))
    return out


def train_one(loss: str, batch: int, gamma_min: float, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One training run with the probe; zero-shot scores, the probes and the per-epoch visit summary."""
    import lightning.pytorch as pl

    from lightning_sdp.callbacks import GammaScheduler, TemperatureScheduler

    torch.set_num_threads(args.threads)
    dm = cached_datamodule(args, batch, seed, val_batch_size=500)
    pl.seed_everything(seed, verbose=False)
    steps = args.epochs * (dm.data_size // batch)
    module = bench_module(loss, steps, args)
    anchors = torch.randperm(dm.data_size, generator=torch.Generator().manual_seed(12345))[: args.probe_anchors]
    probe = UDiagnosticProbe(anchors, batch, probes_per_epoch=args.probes_per_epoch)
    decay_epochs = max(1, round(args.epochs * args.gamma_decay_fraction))
    gamma = GammaScheduler(gamma_min=gamma_min, decay_epochs=decay_epochs)
    scores = fit_and_score(module, dm, args.epochs, [gamma, TemperatureScheduler(), probe])
    return {
        "loss": loss,
        "batch": batch,
        "gamma_min": gamma_min,
        "label": f"{loss} B={batch} gamma_min={gamma_min:g} seed {seed}",
        "seed": seed,
        "steps": steps,
        **scores,
        "probes": probe.probes,
        "visit_summary": probe.visit_summary(),
    }


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (for tables)."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def render_markdown(payload: dict[str, Any]) -> str:
    """The result tables."""
    a = payload["args"]
    runs = payload["runs"]
    head = [
        f"`{a['dataset']}`, {a['num_train']} train / {a['num_val']} held-out pairs, {a['epochs']} epochs, seeds "
        "as listed (a single seed's zero-shot number is not a comparison: the seed spread at 10k pairs is 10-14 "
        f"points), model `NANO_CONFIG`, lr {a['lr']}, tau0 {a['temperature']}, v3: rho {a['rho']}, lr_tau "
        f"{a['lr_tau']}; GammaScheduler cosine from 1 to gamma_min over {a['gamma_decay_fraction']:.2g} of the "
        f"epochs (constant gamma_min after epoch 0 for SogCLR); {a['probe_anchors']} fixed anchors x 2 sides. "
        f"Wall time {payload['total_wall_s'] / 60:.1f} min.",
        "",
        markdown_table(
            [
                {
                    "run": r["label"],
                    "zeroshot_top1": 100 * r["zeroshot_top1"],
                    "retrieval_r1": 100 * r["retrieval_r1"],
                    "final_tau": r["final_tau"],
                    "wall_s": r["wall_s"],
                }
                for r in runs
            ],
            floatfmt="{:.3g}",
        ),
        "",
        "**At every visit** (medians over the anchors' visits in each epoch): `u_new` is the estimate whose inverse "
        "weights the anchor's gradient at that step, `g_then` the exact full-data g at that step; `minibatch` is the "
        "g of the batch's own B - 1 negatives (what gamma = 1 would use); `u_old` the carried estimate; `drift` = "
        "g at the previous visit / g_then; `u_if_g_still` = the same moving average applied to g_batch / g_then (the "
        "error u would have if g had not changed between visits: mini-batch sampling alone), and "
        "`staleness_log_factor` = median log(u_new / (g_then * u_if_g_still)), the part of log(u_new / g_then) that "
        "comes from g changing. `rel_err` = median |est - g| / g, `log_ratio` = median log(est / g).",
        "",
    ]
    visit_cols = [
        "run",
        "epoch",
        "gamma",
        "u_new_vs_g_then.rel_err",
        "u_new_vs_g_then.log_ratio",
        "u_new_vs_g_then.above",
        "minibatch_vs_g_then.rel_err",
        "minibatch_vs_g_then.log_ratio",
        "u_old_vs_g_then.rel_err",
        "u_old_vs_g_then.log_ratio",
        "u_old_vs_g_prev.log_ratio",
        "drift_prev_over_then",
        "u_if_g_still.rel_err",
        "u_if_g_still.log_ratio",
        "staleness_log_factor",
        "gap_steps_median",
        "probe_vs_training_u_rel_diff",
    ]
    visit_rows = [_flat({"run": r["label"], **v}) for r in runs for v in r["visit_summary"]]
    probe_cols = [
        "run",
        "epoch",
        "tau",
        "age_median",
        "total.rel_err",
        "total.log_ratio",
        "total.above",
        "proper.rel_err",
        "proper.log_ratio",
        "drift_then_over_now",
        "minibatch.rel_err",
        "minibatch.log_ratio",
        "rare.top1_share",
        "rare.topb_share",
        "rare.k50",
        "rare.p_batch_has_k50",
    ]
    probe_rows = [_flat({"run": r["label"], **p}) for r in runs for p in r["probes"]]
    return "\n".join(
        [
            *head,
            markdown_table(visit_rows, visit_cols, floatfmt="{:.3g}"),
            "",
            f"**At the probes** ({a['probes_per_epoch']} per epoch, all anchors): `total` = stored u vs g now, "
            "`proper` = stored u vs g at its last update (g_then), `drift_then_over_now` = median g_then / g_now, "
            "`age` = optimizer steps since the last update (1 right after it); `minibatch` = a fresh estimate from "
            "B - 1 random negatives vs g now; `rare`: share of g in the top-1 and top-(B - 1) negatives, k50 = top "
            "negatives carrying half of g, and the probability that B - 1 random negatives contain one of them.",
            "",
            markdown_table(probe_rows, probe_cols, floatfmt="{:.3g}"),
        ]
    )


def _figure(runs: list[dict[str, Any]]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for r in runs:
        visits = [v for v in r["visit_summary"] if v["epoch"] > 0]
        ve = [v["epoch"] for v in visits]
        line = axes[0].plot(ve, [v["u_new_vs_g_then"]["log_ratio"] for v in visits], marker="o", label=r["label"])
        c = line[0].get_color()
        axes[0].plot(ve, [math.log(v["drift_prev_over_then"]) for v in visits], ls="--", color=c)
        axes[0].plot(ve, [v["minibatch_vs_g_then"]["log_ratio"] for v in visits], ls=":", color=c)
        ep = [p["epoch"] for p in r["probes"]]
        axes[1].plot(ep, [p["total"]["rel_err"] for p in r["probes"]], marker=".", color=c)
        axes[1].plot(ep, [p["proper"]["rel_err"] for p in r["probes"]], ls="--", color=c)
        axes[2].plot(ep, [p["rare"]["topb_share"] for p in r["probes"]], marker=".", color=c)
        axes[2].plot(ep, [p["rare"]["p_batch_has_k50"] for p in r["probes"]], ls="--", color=c)
    axes[0].set_title(
        "at each visit, medians: log(u_new / g_then) (solid), log(g_prev / g_then) = drift since the previous "
        "visit (dashed), log(batch's own g / g_then) (dotted)"
    )
    axes[0].axhline(0, color="k", lw=0.5)
    axes[1].set_title("probes: median |u - g| / g against g now (solid) and against g at u's last update (dashed)")
    axes[1].set_yscale("log")
    axes[2].set_title(
        "probes: share of g in the top B-1 negatives (solid), P(B-1 random negatives hold one of top-k50)"
    )
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.title.set_fontsize(7)
        ax.title.set_wrap(True)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    return fig


MERGE_SETTINGS = ("dataset", "num_train", "num_val", "data_seed", "epochs", "lr", "temperature", "lr_tau", "rho")
"""Arguments that stored runs must share to be merged."""


def merge_payloads(stored: list[tuple[str, dict[str, Any]]], name: str) -> dict[str, Any]:
    """Join the runs of stored results into one payload, numbers unchanged.

    Args:
        stored: ``(file name, payload)`` in order; a later payload's run replaces an earlier run with the same label
            (in its place), a new label is appended.
        name: the merged result's name (``args.name``).

    Raises:
        ValueError: payloads with different :data:`MERGE_SETTINGS`, or a replacing run whose scores differ from the
            run it replaces (then they are not the same run).
    """
    first = stored[0][1]
    runs = list(first["runs"])
    for source, payload in stored[1:]:
        differ = [k for k in MERGE_SETTINGS if payload["args"].get(k) != first["args"].get(k)]
        if differ:
            raise ValueError(f"{source} was run with other settings ({', '.join(differ)}); only like runs merge.")
        for run in payload["runs"]:
            at = next((i for i, r in enumerate(runs) if r["label"] == run["label"]), None)
            if at is None:
                runs.append(run)
                continue
            scores = ("zeroshot_top1", "retrieval_r1", "final_tau", "steps")
            if any(runs[at][k] != run[k] for k in scores):
                raise ValueError(f"{source}: run {run['label']!r} has other scores than the run it would replace.")
            runs[at] = run
    merged = {key: value for key, value in first.items() if key not in ("runs", "merged_from")}
    merged["args"] = {**first["args"], "name": name, "runs": ",".join(r["label"] for r in runs)}
    merged.update(
        runs=runs,
        planned_runs=len(runs),
        complete=all(p.get("complete", True) for _, p in stored),
        total_wall_s=sum(p["total_wall_s"] for _, p in stored),
        merged_from=[
            {"file": source, "runs": [r["label"] for r in p["runs"]], "machine": p.get("machine")}
            for source, p in stored
        ],
    )
    return merged


def _merged_markdown(payload: dict[str, Any]) -> str:
    lines = ["", "Merged from (a later file's run replaces the same run of an earlier one):", ""]
    for part in payload.get("merged_from", []):
        date = (part.get("machine") or {}).get("date", "?")
        lines.append(f"- `{part['file']}` ({date}): {'; '.join(part['runs'])}")
    return "\n".join(lines)


def _payload(args: argparse.Namespace, runs: list[dict[str, Any]], planned: int, t_start: float) -> dict[str, Any]:
    return {
        "args": vars(args),
        "runs": runs,
        "bench_model": NANO_CONFIG,
        "planned_runs": planned,
        "complete": len(runs) == planned,
        "total_wall_s": time.perf_counter() - t_start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: fastclip_v3, 256 pairs, batch 16, 2 epochs")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help="comma-separated loss:global_batch:gamma_min:seed")
    parser.add_argument("--epochs", type=int, default=4)
    add_training_args(parser, "scenes", ["shapes", "scenes"], num_train=10_240, num_val=1_000)
    parser.add_argument("--gamma-decay-fraction", type=float, default=0.5)
    parser.add_argument("--probe-anchors", type=int, default=128)
    parser.add_argument("--probes-per-epoch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="fastclip_u_diagnostic")
    parser.add_argument("--from-json", default=None, help="re-render the tables and plot of a (partial) run's JSON")
    parser.add_argument("--merge", nargs="+", default=None, help="stored results to join into --name's files")
    args = parser.parse_args()
    if args.from_json:
        payload = json.loads(Path(args.from_json).read_text())
        write_results(payload["args"]["name"], payload, render_markdown(payload), _figure(payload["runs"]))
        return
    if args.merge:
        stored = [(Path(f).name, json.loads(Path(f).read_text())) for f in args.merge]
        payload = merge_payloads(stored, args.name)
        md = render_markdown(payload) + _merged_markdown(payload)
        write_results(args.name, payload, md, _figure(payload["runs"]))
        return
    if args.quick:
        args.runs, args.epochs, args.num_train, args.num_val = "fastclip_v3:16:0.2:0", 2, 256, 48
        args.probe_anchors, args.name = 32, args.name + "_quick"
    jobs = parse_runs(args.runs)
    t_start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    partial = RESULTS_DIR / f"{args.name}.partial.json"
    for loss, batch, gamma_min, seed in jobs:  # one run at a time, in this process
        r = run_quietly(train_one, (loss, batch, gamma_min, seed, args))
        runs.append(r)
        last = r["visit_summary"][-1] if r["visit_summary"] else {}
        print(
            f"{r['label']:36s} top1 {100 * r['zeroshot_top1']:5.1f} R@1 {100 * r['retrieval_r1']:5.1f} "
            f"u_new err {last.get('u_new_vs_g_then', {}).get('rel_err', math.nan):.3f} "
            f"({r['wall_s']:.0f}s, total {time.perf_counter() - t_start:.0f}s)",
            flush=True,
        )
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(_payload(args, runs, len(jobs), t_start), indent=1) + "\n")
    payload = _payload(args, runs, len(jobs), t_start)
    write_results(args.name, payload, render_markdown(payload), _figure(runs))


if __name__ == "__main__":
    main()
