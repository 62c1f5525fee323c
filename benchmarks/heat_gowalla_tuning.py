"""HEAT optimiser study on Gowalla: one short MF-CCL/SimpleX run per call, all runs collected in one report.

Each call trains with the fused kernel directly (``SimpleXModule.fused_step``, the code ``training_step`` runs, but
without a Trainer so a run costs only its epochs), evaluates Recall/NDCG@20 on the Gowalla test split every
``eval_every`` epochs and adds the run to ``benchmarks/results/heat_gowalla_tuning.{json,md,png}``; a run with the
same name replaces the earlier one. The settings are ``key=value`` pairs (defaults in ``DEFAULTS``):

    .venv/bin/python -m benchmarks.heat_gowalla_tuning lin_n64 negatives=64 schedule=linear lr=1.0 epochs=40

``optimizer`` is ``sgd`` or ``rowwise_adagrad``; ``schedule`` ``constant`` or ``linear`` (per batch, to 0 at the
end); ``row_norm > 0`` projects every row to that norm after each batch. ``--report`` only rewrites the report.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks._common import RESULTS_DIR, SHARED_DATA, markdown_table, write_results
from benchmarks.heat_throughput import recall_ndcg_at_20, set_threads
from lightning_sdp.datamodules.interactions import InteractionsDataModule
from lightning_sdp.models.simplex import SimpleXModule

NAME = "heat_gowalla_tuning"
DEFAULTS: dict[str, object] = {
    "g": 1.0, "negatives": 800, "negative_weight": 150.0, "margin": 0.9, "dim": 64, "optimizer": "sgd", "lr": 0.5,
    "schedule": "constant", "epochs": 30, "init_std": 0.1, "weight_decay": 0.0, "row_norm": 0.0, "batch_size": 16384,
    "eval_every": 10, "threads": 2, "seed": 0, "aggregator_lr_scale": 1.0, "aggregator_weight_decay": 0.0,
}
COLUMNS = ["name", "dim", "g", "aggregator_lr_scale", "aggregator_weight_decay", "negatives", "negative_weight", "margin", "optimizer", "schedule", "lr", "init_std",
           "weight_decay", "row_norm", "user_init_scale", "epochs", "recall@20", "ndcg@20", "train_s", "threads", "script"]


def _parse(pairs: list[str]) -> dict[str, object]:
    cfg = dict(DEFAULTS)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in DEFAULTS:
            raise SystemExit(f"unknown setting {pair!r}; use key=value with key one of {sorted(DEFAULTS)}")
        cfg[key] = value if isinstance(DEFAULTS[key], str) else type(DEFAULTS[key])(value)
    if cfg["optimizer"] not in ("sgd", "rowwise_adagrad") or cfg["schedule"] not in ("constant", "linear"):
        raise SystemExit("optimizer must be sgd or rowwise_adagrad; schedule constant or linear")
    return cfg


@torch.no_grad()
def _norms(model: SimpleXModule) -> dict[str, float]:
    """Mean row norms of both tables and, for SimpleX, of the two terms of the user vector (drift diagnostics)."""
    users, items = model.user_embedding.weight, model.item_embedding.weight
    out = {"user_norm": float(users.norm(dim=1).mean()), "item_norm": float(items.norm(dim=1).mean())}
    if model.hparams.g < 1:
        g = model.hparams.g
        sample = torch.arange(0, model.num_users, max(1, model.num_users // 2000))
        full = model.user_vectors(sample)
        own = g * users[sample]
        out["V_norm"] = float(model.aggregator.norm())
        out["own_term_norm"] = float(own.norm(dim=1).mean())
        out["history_term_norm"] = float((full - own).norm(dim=1).mean())
    return out


def train(name: str, cfg: dict[str, object], data: Path) -> dict:
    set_threads(int(cfg["threads"]))
    dm = InteractionsDataModule(data, batch_size=int(cfg["batch_size"]), eval_batch_size=1024, seed=int(cfg["seed"]))
    dm.setup()
    model = SimpleXModule(
        dm.num_users, dm.num_items, dim=int(cfg["dim"]), g=float(cfg["g"]), margin=float(cfg["margin"]),
        negative_weight=float(cfg["negative_weight"]), num_negatives=int(cfg["negatives"]), max_history=100,
        backend="fused", optimizer=str(cfg["optimizer"]), lr=float(cfg["lr"]), init_std=float(cfg["init_std"]),
        weight_decay=float(cfg["weight_decay"]), seed=int(cfg["seed"]), aggregator_lr_scale=float(cfg["aggregator_lr_scale"]),
        aggregator_weight_decay=float(cfg["aggregator_weight_decay"]),
    )
    model.set_interactions(*dm.train_csr())
    sums = None
    if cfg["optimizer"] == "rowwise_adagrad":
        sums = (torch.zeros(dm.num_users), torch.zeros(dm.num_items))
    loader = dm.train_dataloader()
    epochs, total, step, train_s, curve = int(cfg["epochs"]), int(cfg["epochs"]) * len(loader), 0, 0.0, []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        start = time.perf_counter()
        for users, items in loader:
            lr = float(cfg["lr"]) * ((1.0 - step / total) if cfg["schedule"] == "linear" else 1.0)
            model.fused_step(users, items, lr, row_sums=sums)
            if float(cfg["row_norm"]) > 0:
                model.project_rows(float(cfg["row_norm"]))
            step += 1
        train_s += time.perf_counter() - start
        if (epoch + 1) % int(cfg["eval_every"]) == 0 or epoch + 1 == epochs:
            recall, ndcg = recall_ndcg_at_20(model, dm)
            curve.append({"epochs": epoch + 1, "train_s": round(train_s, 1), "recall@20": recall, "ndcg@20": ndcg,
                          **_norms(model)})
            print(name, curve[-1], flush=True)
    return {"name": name, **cfg, **curve[-1], "curve": curve, "load_avg_1m": round(os.getloadavg()[0], 2)}


def report(runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in sorted(runs, key=lambda r: -r["recall@20"])[:8]:
        ax.plot([c["epochs"] for c in run["curve"]], [c["recall@20"] for c in run["curve"]], "-o", ms=3, label=run["name"])
    ax.axhline(0.1837, color="k", ls="--", lw=0.8, label="MF-CCL published (Adam)")
    ax.axhline(0.180, color="r", ls=":", lw=0.8, label="target 0.180")
    ax.set_xscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("Recall@20 (Gowalla test)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("HEAT fused kernel: optimiser settings (best 8 runs)", fontsize=10)
    md = (
        "Fused kernel called directly (no Trainer), Gowalla LightGCN split, d=64 unless listed, w=150, m=0.9 unless listed, "
        "uniform negatives, batches of 16,384 positives; Recall/NDCG@20 after the last epoch (full ranking, training "
        "items masked). `train_s` is training time only and depends on the load (several runs shared the 2 cores). "
        "`script` = `prototype`: run by this script's first version in the session that wrote it (the same kernel calls "
        "and metric definitions, its own shuffling and evaluation loop, no timing kept); `user_init_scale` multiplied "
        "the initial user rows.\n\n"
        + markdown_table(sorted(runs, key=lambda r: -r["recall@20"]), COLUMNS, floatfmt="{:.4g}")
    )
    write_results(NAME, {"runs": runs}, md, fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", nargs="?", help="run name (a run with the same name is replaced)")
    parser.add_argument("settings", nargs="*", help="key=value settings, see DEFAULTS")
    parser.add_argument("--data", default=str(SHARED_DATA / "gowalla"))
    parser.add_argument("--report", action="store_true", help="only rewrite the report from the stored runs")
    args = parser.parse_args()
    path = RESULTS_DIR / f"{NAME}.json"
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    if not args.report:
        if not args.name:
            raise SystemExit("give a run name and key=value settings, or --report")
        if not Path(args.data).is_dir():
            raise SystemExit(f"{args.data} not found; pass --data")
        result = train(args.name, _parse(args.settings), Path(args.data))
        runs = [r for r in runs if r["name"] != args.name] + [result]
    if runs:
        report(runs)


if __name__ == "__main__":
    main()
