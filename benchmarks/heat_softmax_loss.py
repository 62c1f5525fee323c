"""HEAT's own loss vs SimpleX's CCL: quality and positives/s of MF trained by the fused kernel with each loss.

HEAT's paper describes training with SimpleX's cosine contrastive loss (CCL); its C++ code trains a softmax
cross-entropy over cosines divided by a temperature of 0.07 and clips every gradient coordinate to 0.1 (Gowalla
config). This benchmark trains MF (``g = 1``) with the fused kernel (:meth:`SimpleXModule.fused_step`, per-sample
SGD, learning rate decayed linearly to 0 over the run) for each of:

* ``ccl``: CCL, margin 0.9, negative weight 150 (the project's MF-CCL setting);
* ``softmax``: ``loss="softmax", temperature=0.07``;
* ``softmax+clip``: the same with ``grad_clip=0.1`` (HEAT's code);

on a generated catalogue (a seeded power-law ``InteractionsDataModule``) and, when ``../shared/data/gowalla`` exists,
on the Gowalla LightGCN split. Each loss gets its learning rate from a small grid, chosen on the validation split
(carved from training); the test split is scored once, for the chosen rate only, and chooses nothing. Throughput is
positives/s of the fused step for each loss at d in ``--dims``, 64 negatives, 1 and 2 threads.

Run from the repo root: ``.venv/bin/python -m benchmarks.heat_softmax_loss`` (``--quick``: a few minutes, fewer
epochs and a shorter grid). Writes ``benchmarks/results/heat_softmax_loss.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._common import SHARED_DATA, markdown_table, write_results
from benchmarks.tools.heat import measure_fused, shuffled_pairs
from lightning_sdp.datamodules.interactions import InteractionsDataModule
from lightning_sdp.metrics import NDCGAtK, RecallAtK
from lightning_sdp.models.simplex import SimpleXModule
from lightning_sdp.plugins.heat import set_cpu_threads

NAME = "heat_softmax_loss"
LOSSES: dict[str, dict[str, Any]] = {
    "ccl": {"loss": "ccl", "margin": 0.9, "negative_weight": 150.0},
    "softmax": {"loss": "softmax", "temperature": 0.07, "grad_clip": None},
    "softmax+clip": {"loss": "softmax", "temperature": 0.07, "grad_clip": 0.1},
}


def _model(dm: InteractionsDataModule, loss: str, dim: int, negatives: int, seed: int) -> SimpleXModule:
    m = SimpleXModule(
        dm.num_users, dm.num_items, dim=dim, num_negatives=negatives, init_std=0.1, seed=seed, **LOSSES[loss]
    )
    m.set_interactions(*dm.train_csr)
    return m


def _score(m: SimpleXModule, loader: Any) -> tuple[float, float]:
    """Recall@20 and NDCG@20 of ``m`` on an evaluation loader (full ranking, known items masked)."""
    recall, ndcg = RecallAtK(20), NDCGAtK(20)
    m.on_validation_epoch_start()
    for batch in loader:
        m.evaluate_batch(batch, recall, ndcg)
    m.on_validation_epoch_end()
    return float(recall.compute()), float(ndcg.compute())


def train(m: SimpleXModule, dm: InteractionsDataModule, epochs: int, lr: float) -> float:
    """Per-sample SGD for ``epochs`` epochs, the rate decayed linearly from ``lr`` to 0; returns the training seconds."""
    loader = dm.train_dataloader()
    total, step, seconds = epochs * len(loader), 0, 0.0
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        start = time.perf_counter()
        for users, items in loader:
            losses = m.fused_step(users, items, lr * (1.0 - step / total))
            step += 1
        seconds += time.perf_counter() - start
        if not torch.isfinite(losses).all():
            raise FloatingPointError(f"non-finite loss at epoch {epoch} (lr {lr})")
    return seconds


def quality(
    dm: InteractionsDataModule, data: str, lrs: dict[str, list[float]], epochs: int, dim: int, negatives: int, seed: int
) -> tuple[list[dict], list[dict]]:
    """Every (loss, lr) on validation; the test split for each loss's best rate. Returns (grid rows, chosen rows)."""
    grid, chosen = [], []
    for loss, rates in lrs.items():
        best: tuple[float, SimpleXModule, dict] | None = None
        for lr in rates:
            m = _model(dm, loss, dim, negatives, seed)
            try:
                seconds = train(m, dm, epochs, lr)
            except FloatingPointError as err:
                print(f"{data} {loss} lr {lr}: {err}", flush=True)
                continue
            val_recall, val_ndcg = _score(m, dm.val_dataloader())
            row = {
                "data": data,
                "loss": loss,
                "lr": lr,
                "epochs": epochs,
                "s_per_epoch": seconds / epochs,
                "val_recall@20": val_recall,
                "val_ndcg@20": val_ndcg,
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
            grid.append(row)
            print(row, flush=True)
            if best is None or val_recall > best[0]:
                best = (val_recall, m, row)
        if best is None:
            continue
        test_recall, test_ndcg = _score(best[1], dm.test_dataloader())
        chosen.append({**best[2], "test_recall@20": test_recall, "test_ndcg@20": test_ndcg})
    return grid, chosen


def throughput(
    dm: InteractionsDataModule, data: str, dims: list[int], threads_list: list[int], seconds: float
) -> list[dict]:
    """Positives/s of the fused step for each loss (64 negatives, uniform sampler, batches of 16,384)."""
    users, items = shuffled_pairs(dm)
    rows = []
    for dim in dims:
        for threads in threads_list:
            set_cpu_threads(threads)
            row: dict[str, Any] = {"data": data, "d": dim, "threads": threads}
            for loss in LOSSES:
                row[loss] = measure_fused(_model(dm, loss, dim, 64, 0), users, items, seconds)
            for loss in list(LOSSES)[1:]:
                row[f"{loss}/ccl"] = row[loss] / row["ccl"]
            row["load_avg_1m"] = round(os.getloadavg()[0], 2)
            rows.append(row)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return rows


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--data", default=str(SHARED_DATA / "gowalla"), help="LightGCN folder (default: Gowalla)")
    parser.add_argument("--epochs", type=int, default=30, help="epochs per run on the generated catalogue")
    parser.add_argument("--gowalla-epochs", type=int, default=20, help="epochs per run on Gowalla (0: skip)")
    parser.add_argument("--dim", type=int, default=64, help="embedding dimension of the quality runs")
    parser.add_argument("--negatives", type=int, default=64)
    parser.add_argument("--dims", default="64,128", help="embedding dimensions of the throughput runs")
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per throughput configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="fewer epochs, a shorter grid (a few minutes)")
    return parser


# learning-rate grids, chosen on validation; per-sample SGD on cosines: the softmax gradients are ~1/temperature
# larger than CCL's, and clipped steps are at most lr * grad_clip per coordinate
GRIDS = {
    "ccl": [0.3, 1.0, 3.0, 10.0],
    "softmax": [0.01, 0.03, 0.1],
    "softmax+clip": [0.1, 0.3, 1.0],
}
QUICK_GRIDS = {"ccl": [1.0, 3.0], "softmax": [0.03, 0.1], "softmax+clip": [0.1, 0.3]}


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    grids = QUICK_GRIDS if args.quick else GRIDS
    max_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads_list = [t for t in (1, 2) if t <= max_threads]
    dims = [int(d) for d in args.dims.split(",")]
    if args.quick:
        args.epochs, args.gowalla_epochs, args.seconds, dims = 10, min(args.gowalla_epochs, 3), 1.0, dims[:1]
    set_cpu_threads(max(threads_list))

    synthetic = InteractionsDataModule(num_users=5000, num_items=3000, batch_size=16384, seed=args.seed)
    synthetic.setup()
    grid, chosen = quality(synthetic, "generated", grids, args.epochs, args.dim, args.negatives, args.seed)
    speed = throughput(synthetic, "generated", dims, threads_list, args.seconds)
    gowalla = Path(args.data)
    if args.gowalla_epochs > 0 and gowalla.is_dir():
        dm = InteractionsDataModule(str(gowalla), batch_size=16384, eval_batch_size=1024, seed=args.seed)
        dm.setup()
        # the grid's middle rate only on Gowalla: a grid there costs more than a quick run has
        rates = grids if not args.quick else {k: [v[len(v) // 2]] for k, v in grids.items()}
        set_cpu_threads(max(threads_list))
        g_grid, g_chosen = quality(dm, "gowalla", rates, args.gowalla_epochs, args.dim, args.negatives, args.seed)
        grid, chosen = grid + g_grid, chosen + g_chosen
        speed += throughput(dm, "gowalla", dims, threads_list, args.seconds)
    elif args.gowalla_epochs > 0:
        print(f"{gowalla} not found: generated catalogue only", flush=True)
    report(grid, chosen, speed, args)


def report(grid: list[dict], chosen: list[dict], speed: list[dict], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({r["data"] for r in chosen})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(LOSSES), 1)
    for k, loss in enumerate(LOSSES):
        vals = [
            next((r["test_recall@20"] for r in chosen if r["data"] == d and r["loss"] == loss), np.nan)
            for d in datasets
        ]
        axes[0].bar(np.arange(len(datasets)) + k * width, vals, width, label=loss)
        pts = [(f"{r['data']} d{r['d']} t{r['threads']}", r[loss]) for r in speed]
        axes[1].bar(np.arange(len(pts)) + k * width, [p[1] for p in pts], width, label=loss)
    axes[0].set_xticks(np.arange(len(datasets)) + width, datasets)
    axes[0].set_ylabel("test Recall@20 (lr chosen on validation)")
    axes[1].set_xticks(
        np.arange(len(speed)) + width, [f"{r['data']} d{r['d']} t{r['threads']}" for r in speed], fontsize=7
    )
    axes[1].set_ylabel("positives / s")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("MF with HEAT's softmax loss vs CCL (fused kernel)" + (" (quick)" if args.quick else ""))

    losses = ", ".join(f"`{k}` = {v}" for k, v in LOSSES.items())
    md = (
        f"MF (g = 1), d={args.dim}, {args.negatives} uniform negatives, fused kernel, per-sample SGD with the rate "
        f"decayed linearly to 0; {losses}. Each loss's rate is chosen on validation; the test split is scored for "
        "that rate only.\n\n## Chosen rate per loss\n\n"
        + markdown_table(chosen, floatfmt="{:.4g}")
        + "\n\n## Positives per second (64 negatives, batches of 16,384)\n\n"
        + markdown_table(speed, floatfmt="{:.4g}")
        + "\n\n## Every rate (validation)\n\n"
        + markdown_table(grid, floatfmt="{:.4g}")
    )
    payload = {"grid": grid, "chosen": chosen, "throughput": speed, "losses": LOSSES, "args": vars(args)}
    write_results(NAME if not args.quick else f"{NAME}_quick", payload, md, fig)


if __name__ == "__main__":
    main()
