"""How far HEAT's fused kernel trails the plain-PyTorch reference with the same settings and epochs, across densities,
and how much of that is lock-free (Hogwild) collisions.

Three ways to train the same ``SimpleXModule`` (MF, d=64, 64 uniform negatives, the module's defaults otherwise)
through the same ``Trainer`` and ``InteractionsDataModule`` batches, for the same number of epochs:

* ``fused_1t``: the fused kernel on one thread: per-sample SGD with no concurrent writer (no collisions);
* ``fused_2t``: the fused kernel on two threads: lock-free updates, two writers on shared item rows;
* ``reference``: the plain-PyTorch backend (autograd, Adam per batch, its defaults).

``fused_2t / fused_1t`` is what the collisions cost; ``fused_1t / reference`` is what per-sample SGD against batched
Adam costs or buys. Each runs with both losses (``ccl``, ``softmax``) on every catalogue of the development suite
(``benchmarks/tools/catalogues.py``: 0.04% to 7.5% density), scored on the validation split carved from training
(the test split is not read), over ``--seeds`` seeds for the fused runs (their spread is the noise band).

Run from the repo root: ``.venv/bin/python -m benchmarks.heat_fused_gap`` (about 15 minutes on 2 cores; ``--quick``:
one small catalogue, 2 epochs). Writes ``benchmarks/results/heat_fused_gap.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
from lightning.pytorch import Trainer

from benchmarks._common import machine_info, machine_line, markdown_table, write_results
from benchmarks.tools.catalogues import SUITE
from lightning_sdp.datamodules.interactions import InteractionsDataModule
from lightning_sdp.models.simplex import InteractionStats, SimpleXModule
from lightning_sdp.plugins.heat import HEATAccelerator

NAME = "heat_fused_gap"
VARIANTS = ("fused_1t", "fused_2t", "reference")
LOSSES = ("ccl", "softmax")


def _datamodule(name: str, quick: bool) -> InteractionsDataModule:
    if quick:
        kwargs: dict[str, Any] = {"num_users": 300, "num_items": 200, "interactions_per_user": 15, "seed": 0}
    else:
        kwargs = SUITE[name].datamodule_kwargs()
    dm = InteractionsDataModule(**kwargs, batch_size=8192, eval_batch_size=512, val_fraction=0.1)
    dm.setup("fit")
    return dm


def run(dm: InteractionsDataModule, variant: str, loss: str, epochs: int, seed: int) -> dict[str, float]:
    """Train one variant for ``epochs`` epochs and score validation Recall@20 / NDCG@20."""
    backend = "reference" if variant == "reference" else "fused"
    model = SimpleXModule(dim=64, num_negatives=64, loss=loss, backend=backend, seed=seed)
    accelerator: Any = (
        "cpu" if backend == "reference" else HEATAccelerator(num_threads=1 if variant == "fused_1t" else 2)
    )
    trainer = Trainer(
        accelerator=accelerator,
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    seconds = time.perf_counter() - start
    metrics = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False).validate(
        model, datamodule=dm, verbose=False
    )[0]
    return {"val_recall@20": metrics["val/recall@20"], "val_ndcg@20": metrics["val/ndcg@20"], "train_s": seconds}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--datasets", default=",".join(SUITE), help="comma list of the suite's catalogues")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seeds", default="0,1", help="seeds of the fused runs (the reference runs the first)")
    parser.add_argument("--quick", action="store_true", help="one small catalogue, 2 epochs (smoke test)")
    args = parser.parse_args(argv)
    names = ["quick"] if args.quick else args.datasets.split(",")
    unknown = sorted(set(names) - set(SUITE) - {"quick"})
    if unknown:
        raise SystemExit(f"unknown datasets {unknown}; choose from {', '.join(SUITE)}")
    epochs = 2 if args.quick else args.epochs
    seeds = [int(s) for s in args.seeds.split(",")]
    rows: list[dict[str, Any]] = []
    for name in names:
        dm = _datamodule(name, args.quick)
        density = InteractionStats.from_csr(*dm.train_csr, dm.num_items).density
        for loss in LOSSES:
            row: dict[str, Any] = {"data": name, "density": float(density), "loss": loss, "epochs": epochs}
            for variant in VARIANTS:
                runs = [run(dm, variant, loss, epochs, s) for s in (seeds if variant != "reference" else seeds[:1])]
                recalls = [r["val_recall@20"] for r in runs]
                row[variant] = float(np.mean(recalls))
                row[f"{variant}_spread"] = float(np.max(recalls) - np.min(recalls))
                row[f"{variant}_s"] = float(np.mean([r["train_s"] for r in runs]))
            row["2t/1t"] = row["fused_2t"] / row["fused_1t"]
            row["2t/reference"] = row["fused_2t"] / row["reference"]
            row["load_avg_1m"] = round(os.getloadavg()[0], 2)
            rows.append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return report(rows, args, epochs, seeds)


def report(rows: list[dict[str, Any]], args: argparse.Namespace, epochs: int, seeds: list[int]) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LOSSES), figsize=(11, 4), sharey=True)
    for ax, loss in zip(axes, LOSSES, strict=True):
        mine = sorted((r for r in rows if r["loss"] == loss), key=lambda r: r["density"])
        x = [100 * r["density"] for r in mine]
        for variant in VARIANTS:
            ax.plot(x, [r[variant] for r in mine], marker="o", label=variant)
        ax.set_xscale("log")
        ax.set_xlabel("training density (%)")
        ax.set_title(f"loss={loss}, {epochs} epochs")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("validation Recall@20")
    columns = ["data", "density", "loss", *VARIANTS, "fused_1t_spread", "fused_2t_spread", "2t/1t", "2t/reference"]
    columns += ["fused_1t_s", "fused_2t_s", "reference_s", "load_avg_1m"]
    md = [
        f"# {NAME}\n",
        f"Machine: {machine_line()}\n",
        f"MF (g=1), d=64, 64 uniform negatives, module defaults, {epochs} epochs through the Trainer, batches of "
        f"8,192; validation Recall@20 (test not read); fused runs averaged over seeds {seeds} (`_spread`: max - min). "
        "`2t/1t`: what lock-free collisions cost; `2t/reference`: the gap to the plain-PyTorch backend (Adam).\n",
        markdown_table(rows, columns),
    ]
    payload = {"args": vars(args), "rows": rows, "machine": machine_info()}
    write_results(NAME + ("_quick" if args.quick else ""), payload, "\n".join(md), fig)
    return payload


if __name__ == "__main__":
    main()
