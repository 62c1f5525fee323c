"""HEAT throughput: positives/s of the fused numba kernel vs plain-PyTorch SimpleX, 1 and 2 threads.

Measures, on the Gowalla LightGCN split (810,128 training positives), for MF-CCL (g = 1) and SimpleX (g = 0.8,
mean aggregator, history 100), d in {64, 128}, 64 negatives:

* ``fused``: :meth:`SimpleXModule.fused_step` (the code ``training_step`` runs), batches of 16,384 positives;
* ``reference``: plain PyTorch SimpleX, batch 256 (the SimpleX setting), autograd + dense Adam;
* ``reference-b4096``: the same with batch 4096, the strongest plain-torch variant we found (it amortises the dense
  Adam update of the whole tables over more positives);

and the tile sampler against uniform sampling (speed, and Recall@20 during and after ``--sampler-epochs`` epochs of a
linear decay). Each throughput measurement runs for ``--seconds`` after a warm-up. Writes
``benchmarks/results/heat_throughput.{json,md,png}``.

Run from the repo root: ``.venv/bin/python -m benchmarks.heat_throughput`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks._common import SHARED_DATA, markdown_table, write_results
from benchmarks.tools.heat import measure_fused, measure_reference, shuffled_pairs
from lightning_sdp.datamodules.interactions import InteractionsDataModule
from lightning_sdp.models.simplex import SimpleXModule
from lightning_sdp.plugins.heat import set_cpu_threads


def _model(
    dm: InteractionsDataModule, backend: str, g: float, dim: int, negatives: int, sampler: str = "uniform"
) -> SimpleXModule:
    m = SimpleXModule(
        dm.num_users,
        dm.num_items,
        dim=dim,
        g=g,
        num_negatives=negatives,
        loss="ccl",
        negative_weight=150.0,
        margin=0.9,
        max_history=100,
        backend=backend,
        sampler=sampler,
        lr=0.5 if backend == "fused" else 1e-4,
        init_std=0.1 if backend == "fused" else 1e-4,
    )
    m.set_interactions(*dm.train_csr)
    return m


SAMPLER_LR = 1.0  # per-sample SGD, decayed linearly to 0 over the run (as in heat_gowalla_quality.py)


def recall_ndcg_at_20(m: SimpleXModule, dm: InteractionsDataModule) -> tuple[float, float]:
    """Recall@20 and NDCG@20 of ``m`` on ``dm``'s validation split, outside a Trainer (``m.evaluate_batch``)."""
    from lightning_sdp.metrics import NDCGAtK, RecallAtK

    recall, ndcg = RecallAtK(20), NDCGAtK(20)
    m.on_validation_epoch_start()
    for batch in dm.val_dataloader():
        m.evaluate_batch(batch, recall, ndcg)
    m.on_validation_epoch_end()
    return float(recall.compute()), float(ndcg.compute())


def sampler_quality(
    dm: InteractionsDataModule, epochs: int, dim: int, negatives: int, threads: int
) -> tuple[list[dict], list[dict]]:
    """Tile vs uniform sampler on MF-CCL: seconds per epoch, and Recall/NDCG@20 during and after ``epochs`` epochs.

    Returns the final row per sampler and the curve (about eight evaluations per sampler).
    """
    rows, curve = [], []
    set_cpu_threads(threads)
    evals = {max(1, round(epochs * k / 8)) for k in range(1, 9)}
    for sampler in ("uniform", "tile"):
        m = _model(dm, "fused", 1.0, dim, negatives, sampler)
        loader = dm.train_dataloader()
        train_s, step, total = 0.0, 0, epochs * len(loader)
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)
            t = time.perf_counter()
            for u, i in loader:
                m.fused_step(u, i, SAMPLER_LR * (1.0 - step / total))
                step += 1
            train_s += time.perf_counter() - t
            if epoch + 1 in evals:
                recall, ndcg = recall_ndcg_at_20(m, dm)
                curve.append({"sampler": sampler, "epochs": epoch + 1, "recall@20": recall, "ndcg@20": ndcg})
        rows.append(
            {
                "sampler": sampler,
                "epochs": epochs,
                "s_per_epoch": train_s / epochs,
                "positives_per_s": epochs * dm.num_train_interactions / train_s,
                "recall@20": curve[-1]["recall@20"],
                "ndcg@20": curve[-1]["ndcg@20"],
            }
        )
        print(rows[-1], flush=True)
    return rows, curve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--data", default=str(SHARED_DATA / "gowalla"), help="LightGCN folder (default: Gowalla)")
    parser.add_argument("--seconds", type=float, default=4.0, help="measuring time per configuration")
    parser.add_argument("--negatives", type=int, default=64)
    parser.add_argument("--sampler-epochs", type=int, default=5, help="epochs per sampler in the tile/uniform test")
    parser.add_argument("--quick", action="store_true", help="tiny synthetic run (smoke test)")
    args = parser.parse_args(argv)

    if args.quick:
        dm = InteractionsDataModule(num_users=400, num_items=300, batch_size=2048, seed=0)
        dims, threads_list, seconds, sampler_epochs = [16], [1, 2], 0.3, 1
    else:
        if not Path(args.data).is_dir():
            raise SystemExit(f"{args.data} not found; pass --data or use --quick")
        dm = InteractionsDataModule(args.data, batch_size=16384)
        dims, threads_list, seconds, sampler_epochs = [64, 128], [1, 2], args.seconds, args.sampler_epochs
    dm.setup()
    users, items = shuffled_pairs(dm)
    max_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads_list = [t for t in threads_list if t <= max_threads]

    rows = []
    for model_name, g in (("MF-CCL", 1.0), ("SimpleX", 0.8)):
        for dim in dims:
            for threads in threads_list:
                set_cpu_threads(threads)
                row = {"model": model_name, "d": dim, "threads": threads}
                row["fused"] = measure_fused(_model(dm, "fused", g, dim, args.negatives), users, items, seconds)
                row["fused_tile"] = measure_fused(
                    _model(dm, "fused", g, dim, args.negatives, "tile"), users, items, seconds
                )
                row["reference"] = measure_reference(
                    _model(dm, "reference", g, dim, args.negatives), users, items, seconds, 256
                )
                row["reference_b4096"] = measure_reference(
                    _model(dm, "reference", g, dim, args.negatives), users, items, seconds, 4096
                )
                row["fused/reference"] = row["fused"] / row["reference"]
                row["fused/reference_b4096"] = row["fused"] / row["reference_b4096"]
                row["s_per_epoch_fused"] = dm.num_train_interactions / row["fused"]
                row["s_per_epoch_reference"] = dm.num_train_interactions / row["reference"]
                row["load_avg_1m"] = round(os.getloadavg()[0], 2)
                print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                rows.append(row)

    sampler_rows, sampler_curve = sampler_quality(dm, sampler_epochs, dims[0], args.negatives, max(threads_list))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, model_name in zip(axes, ("MF-CCL", "SimpleX"), strict=False):
        for dim in dims:
            for key, style in (("fused", "-o"), ("fused_tile", ":o"), ("reference", "--s"), ("reference_b4096", "-.^")):
                pts = [(r["threads"], r[key]) for r in rows if r["model"] == model_name and r["d"] == dim]
                ax.plot(*zip(*pts, strict=False), style, label=f"{key} d={dim}")
        ax.set_title(f"{model_name}, {args.negatives} negatives")
        ax.set_xlabel("threads")
        ax.set_xticks(threads_list)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("positives / s")
    axes[1].legend(fontsize=7)
    fig.suptitle(
        "HEAT fused kernel vs plain-PyTorch SimpleX (Gowalla)" if not args.quick else "HEAT (quick, synthetic)"
    )

    cols = [
        "model",
        "d",
        "threads",
        "fused",
        "fused_tile",
        "reference",
        "reference_b4096",
        "fused/reference",
        "fused/reference_b4096",
        "s_per_epoch_fused",
        "s_per_epoch_reference",
        "load_avg_1m",
    ]
    md = (
        f"Data: {'synthetic (quick)' if args.quick else args.data} ({dm.num_train_interactions:,} training positives), "
        f"{args.negatives} negatives, positives per second (higher is better); `fused` = HEAT numba kernel (batches "
        "of 16,384, uniform sampler), `fused_tile` = with the tile sampler (512 items, refresh 2048), `reference` = "
        "plain PyTorch, batch 256, autograd + Adam, `reference_b4096` = the same with batch 4096.\n\n"
        + markdown_table(rows, cols, floatfmt="{:.4g}")
        + "\n\n## Tile vs uniform sampler (MF-CCL, fused, "
        + f"d={dims[0]}, {max(threads_list)} threads, {sampler_epochs} epochs, lr {SAMPLER_LR:g} linear to 0)\n\n"
        + markdown_table(sampler_rows, floatfmt="{:.4g}")
        + "\n\n### Recall@20 by epoch (validation)\n\n"
        + markdown_table(sampler_curve, floatfmt="{:.4g}")
    )
    write_results(
        "heat_throughput" if not args.quick else "heat_throughput_quick",
        {
            "rows": rows,
            "sampler": sampler_rows,
            "sampler_curve": sampler_curve,
            "negatives": args.negatives,
            "quick": args.quick,
        },
        md,
        fig,
    )


if __name__ == "__main__":
    main()
