"""HEAT quality on Gowalla: train MF-CCL and SimpleX with the fused backend under a time budget, report Recall/NDCG@20.

Uses the real Lightning path: ``Trainer(accelerator="heat")`` + ``SimpleXModule(backend="fused")`` +
``InteractionsDataModule`` on ``../shared/data/gowalla`` (LightGCN split; full ranking, training items masked).
Each model trains until ``--budget-minutes`` (Lightning's ``max_time``, validation included) or ``--max-epochs``;
Recall@20 / NDCG@20 are recorded every ``--eval-every`` epochs and after the last one, and compared with the
published numbers (MF-CCL 0.1837 / 0.1493, SimpleX 0.1872 / 0.1557). Writes
``benchmarks/results/heat_gowalla_quality.{json,md,png}`` with the epochs reached and the machine load.

Run from the repo root: ``.venv/bin/python -m benchmarks.heat_gowalla_quality --budget-minutes 20``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer

import lightning_sdp  # noqa: F401  (registers accelerator="heat")
from benchmarks._common import SHARED_DATA, markdown_table, write_results
from benchmarks.tools.heat import ValidationHistory
from lightning_sdp.datamodules.interactions import InteractionsDataModule
from lightning_sdp.models.simplex import SimpleXModule

PUBLISHED = {"MF-CCL": (0.1837, 0.1493), "SimpleX": (0.1872, 0.1557)}


def run(name: str, g: float, args: argparse.Namespace, dm: InteractionsDataModule) -> dict:
    model = SimpleXModule(
        dim=args.dim,
        g=g,
        loss="ccl",
        margin=0.9,
        negative_weight=args.negative_weight,
        num_negatives=args.negatives,
        max_history=100,
        backend="fused",
        lr=args.lr,
        init_std=0.1,
        sampler=args.sampler,
        aggregator_lr_scale=args.aggregator_lr_scale,
        optimizer=args.optimizer,
        lr_schedule=args.lr_schedule,
        row_norm=args.row_norm,
        aggregator_weight_decay=args.aggregator_weight_decay,
        aggregator=args.aggregator,
        dropout=args.dropout,
        seed=args.seed,
    )
    history = ValidationHistory()
    trainer = Trainer(
        accelerator="heat",
        devices=1,
        max_epochs=args.max_epochs,
        max_time={"minutes": args.budget_minutes},
        check_val_every_n_epoch=args.eval_every,
        limit_val_batches=0 if args.refit else None,  # refit: no validation split to score
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[history],
    )
    start = time.perf_counter()
    trainer.fit(model, dm)
    train_wall = time.perf_counter() - start
    epochs = trainer.current_epoch
    if not args.refit and (not history.rows or history.rows[-1]["epochs"] != epochs):
        trainer.validate(model, dm, verbose=False)
        history.rows[-1]["epochs"] = epochs
    final = history.rows[-1] if history.rows else {"recall@20": float("nan"), "ndcg@20": float("nan")}
    pub = PUBLISHED[name]
    # the curve above is validation (carved from train); the test split is scored once, here, after the last epoch
    test = trainer.test(model, dm, verbose=False)[0]
    return {
        "model": name,
        "g": g,
        "epochs": epochs,
        "wall_s": train_wall,
        "val_recall@20": final["recall@20"],
        "val_ndcg@20": final["ndcg@20"],
        "recall@20": test["test/recall@20"],
        "ndcg@20": test["test/ndcg@20"],
        "published_recall@20": pub[0],
        "published_ndcg@20": pub[1],
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "curve": history.rows,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--data", default=str(SHARED_DATA / "gowalla"))
    parser.add_argument("--models", default="MF-CCL,SimpleX", help="comma list of MF-CCL, SimpleX")
    parser.add_argument("--budget-minutes", type=float, default=30.0, help="training time per model (<= 30)")
    parser.add_argument("--max-epochs", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--negatives", type=int, default=800, help="MF-CCL's published setting")
    parser.add_argument("--negative-weight", type=float, default=150.0)
    parser.add_argument("--lr", type=float, default=1.0, help="per-sample learning rate of the fused kernel")
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "rowwise_adagrad"])
    parser.add_argument(
        "--lr-schedule",
        default="linear",
        choices=["constant", "linear"],
        help="linear decays to 0 over --max-epochs (choose it so that the fit ends inside the budget)",
    )
    parser.add_argument("--row-norm", type=float, default=None, help="project rows to this norm after each step")
    parser.add_argument("--sampler", default="uniform", choices=["uniform", "tile"])
    parser.add_argument("--aggregator-lr-scale", type=float, default=1.0, help="SimpleX: lr of V relative to lr")
    parser.add_argument("--aggregator-weight-decay", type=float, default=0.0, help="SimpleX: L2 on V per sample")
    parser.add_argument(
        "--aggregator", default="mean", choices=["mean", "user_attention", "self_attention"], help="SimpleX only"
    )
    parser.add_argument("--dropout", type=float, default=0.0, help="SimpleX's net_dropout on the user vector")
    parser.add_argument(
        "--refit",
        action="store_true",
        help="train on the whole training split (no validation carved out, no curve): for settings already chosen "
        "on validation (e.g. with heat_gowalla_tuning); the test split is still scored once, at the end",
    )
    parser.add_argument("--batch-size", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0, help="initialisation, negatives and shuffling")
    parser.add_argument("--quick", action="store_true", help="tiny synthetic run (smoke test)")
    parser.add_argument("--name", default=None, help="results file stem (default heat_gowalla_quality)")
    parser.add_argument("--note", default="", help="a sentence added to the report (e.g. how the runs were made)")
    parser.add_argument(
        "--combine",
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: merge earlier results JSONs (one run per model or setting) into results/<--name>.*",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.combine:
        combined_report(combine_runs([Path(f) for f in args.combine]), args.name or "heat_gowalla_quality", args.note)
        return

    val_fraction = 0.0 if args.refit else 0.1  # refit: settings were chosen on validation beforehand
    if args.quick:
        dm = InteractionsDataModule(
            num_users=400, num_items=300, batch_size=2048, eval_batch_size=256, val_fraction=val_fraction
        )
        args.max_epochs, args.eval_every, args.negatives, args.dim = 2, 1, 16, 16
    else:
        if not Path(args.data).is_dir():
            raise SystemExit(f"{args.data} not found; pass --data or use --quick")
        dm = InteractionsDataModule(
            args.data,
            batch_size=args.batch_size,
            eval_batch_size=1024,
            seed=args.seed,
            val_fraction=val_fraction,
        )
    results = []
    for name in args.models.split(","):
        results.append(run(name, 1.0 if name == "MF-CCL" else 0.8, args, dm))
    report(results, args, {})


def report(results: list[dict], args: argparse.Namespace, extra: dict) -> None:
    """Write the table, the recall-vs-epoch plot and the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    optimizer, schedule = getattr(args, "optimizer", "sgd"), getattr(args, "lr_schedule", "constant")  # older JSONs
    tile = inspect.signature(SimpleXModule).parameters  # run() leaves the tile settings at the module's defaults
    sampler = (
        f"tile sampler: {tile['tile_size'].default} items per thread, "
        f"redrawn every {tile['tile_refresh'].default} samples"
        if args.sampler == "tile"
        else "uniform over all items"
    )
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        curve = r["curve"]
        line = ax.plot(
            [c["epochs"] for c in curve], [c["recall@20"] for c in curve], "-o", label=f"{r['model']} (fused)"
        )
        ax.axhline(
            r["published_recall@20"], color=line[0].get_color(), ls="--", lw=0.8, label=f"{r['model']} published"
        )
    ax.set_xlabel("epoch")
    ax.set_ylabel("Recall@20 (Gowalla validation)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(
        f"HEAT fused {optimizer} ({schedule} lr), {args.negatives} negatives, d={args.dim}, "
        f"budget {args.budget_minutes:g} min/model",
        fontsize=9,
    )

    cols = [
        "model",
        "epochs",
        "wall_s",
        "val_recall@20",
        "recall@20",
        "published_recall@20",
        "ndcg@20",
        "published_ndcg@20",
        "load_avg_1m",
    ]
    md = (
        f'Fused backend, `Trainer(accelerator="heat")`, d={args.dim}, {args.negatives} negatives per positive '
        f"({sampler}), seed {getattr(args, 'seed', 0)}, w={args.negative_weight:g}, m=0.9, "
        f"per-sample {optimizer} lr {args.lr:g} "
        f"({schedule} schedule over {args.max_epochs} epochs), row norm {getattr(args, 'row_norm', None)}, "
        "init std 0.1, "
        f"batch {args.batch_size}; SimpleX g=0.8 {getattr(args, 'aggregator', 'mean')} aggregator, dropout "
        f"{getattr(args, 'dropout', 0.0):g}, history 100, V lr x{args.aggregator_lr_scale:g}, "
        f"V weight decay {getattr(args, 'aggregator_weight_decay', 0.0):g}. Budget {args.budget_minutes:g} min per "
        "model (Lightning `max_time`, validation included). "
        + (
            "**Refit**: the model trains on the whole training split (settings chosen on validation beforehand), so "
            "there is no validation curve; "
            if getattr(args, "refit", False)
            else "A validation split (10% of each user's training items, seeded by the run's seed) is carved out of "
            "the training interactions: the per-epoch curve and `val_recall@20` are scored on it; "
        )
        + "`recall@20` / `ndcg@20` are the test split, scored once after training.\n\n"
        + (f"{extra['note']}\n\n" if extra.get("note") else "")
        + markdown_table(results, cols)
        + "\n\n## Validation Recall@20 by epoch\n\n"
        + "\n\n".join(f"### {r['model']}\n\n" + markdown_table(r["curve"]) for r in results)
    )
    name = args.name or ("heat_gowalla_quality" if not args.quick else "heat_gowalla_quality_quick")
    write_results(name, {"results": results, "args": vars(args), **extra}, md, fig)


# ---------------------------------------------------------------------------------------------------- merged runs
_NOT_OPTIONS = ("data", "quick", "combine", "note", "name")


def command_of(args: dict[str, Any]) -> str:
    """The command line that repeats a stored run with today's options (only what differs from their defaults)."""
    defaults = vars(_parser().parse_args([]))
    parts = ["python -m benchmarks.heat_gowalla_quality"]
    for key, value in args.items():
        if key in _NOT_OPTIONS or key not in defaults or value == defaults[key] or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        parts.append(flag if value is True else f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    return " ".join([*parts, f"--name {args['name']}"])


def _setting(args: dict[str, Any], model: str) -> str:
    setting = f"d={args['dim']}, {args['negatives']} {args['sampler']} negatives, w={args['negative_weight']:g}"
    setting += f", {args.get('optimizer', 'sgd')} lr {args['lr']:g} ({args.get('lr_schedule', 'constant')})"
    setting += f", row norm {args.get('row_norm')}, seed {args.get('seed', 0)}"
    if model == "SimpleX":
        setting += f", {args.get('aggregator', 'mean')} aggregator, V lr x{args['aggregator_lr_scale']:g}"
        setting += f", V decay {args.get('aggregator_weight_decay', 0.0):g}"
    return setting


def combine_runs(paths: list[Path]) -> dict[str, Any]:
    """One results document from stored runs (``results/<stem>.json``), numbers unchanged: every row names its
    source run, its setting and the command that repeats it; a merged document's rows merge again as they are."""
    rows, sources = [], []
    for path in paths:
        doc = json.loads(path.read_text())
        if "sources" in doc:
            rows += doc["results"]
            sources += doc["sources"]
            continue
        args = doc["args"]
        source = {"name": path.stem, "command": command_of({**args, "name": path.stem}), "machine": doc["machine"]}
        # runs from before the module carved a validation split scored the test split along the way
        source["validation"] = any("val_recall@20" in r for r in doc["results"])
        sources.append(source)
        rows += [{"source": path.stem, "setting": _setting(args, r["model"]), **r} for r in doc["results"]]
    return {"results": rows, "sources": sources, "machine": sources[0]["machine"]}


def combined_report(doc: dict[str, Any], name: str, note: str = "") -> None:
    """Write ``results/<name>.{json,md,png}`` for :func:`combine_runs`' document."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in doc["results"]:
        ax.plot([c["epochs"] for c in r["curve"]], [c["recall@20"] for c in r["curve"]], "-o", ms=3, label=r["source"])
    for model, (recall, _) in PUBLISHED.items():
        ax.axhline(recall, ls="--", lw=0.8, color="grey")
        ax.text(0.01, recall, f"{model} published", fontsize=7, color="grey", transform=ax.get_yaxis_transform())
    ax.set_xlabel("epoch")
    ax.set_ylabel("Recall@20 (Gowalla)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    ax.set_title('HEAT fused backend, `Trainer(accelerator="heat")`, Gowalla', fontsize=9)
    cols = ["source", "model", "setting", "epochs", "wall_s", "recall@20", "ndcg@20"]
    cols += ["published_recall@20", "published_ndcg@20", "load_avg_1m"]
    md = [
        "Merged from the stored runs below (numbers as measured, not rerun). Each trains with the fused backend "
        'through `Trainer(accelerator="heat")` on the LightGCN Gowalla split, with per-sample SGD whose rate decays '
        "linearly to 0 over the run's epochs; `recall@20` / `ndcg@20` are the test split after the last epoch.",
        *([note] if note else []),
        markdown_table(doc["results"], cols),
        "## Source runs",
    ]
    for source in doc["sources"]:
        m = source["machine"]
        split = (
            "validation carved from train for the curve"
            if source["validation"]
            else "trained on the whole training split with the curve scored on the test split, the module's "
            "protocol before it carved a validation split: add `--refit` to train on the whole split today"
        )
        md.append(
            f"- `{source['name']}`: `{source['command']}` ({m.get('date', '')}, {m.get('cpu', '')}, load "
            f"{m.get('load_avg_1m')}; {split})"
        )
    md.append("## Recall@20 by epoch")
    md += [f"### {r['source']} ({r['model']})\n\n" + markdown_table(r["curve"]) for r in doc["results"]]
    write_results(name, doc, "\n\n".join(md), fig)


if __name__ == "__main__":
    main()
