"""Candidates for HEAT's budgeted recipe, by validation Recall at fixed training lengths (quality only, no timing).

The recipe trains the anchor of the grid the data calls for (``auto_grid``: HEAT's softmax loss from 0.15% density
up, CCL below). Each candidate changes one thing about that anchor and trains it for the same number of epochs
(the rate decaying linearly to 0 through the recipe's own :class:`~lightning_sdp.recipes.runner.SimpleXRunner`):

* ``anchor``: the grid's first values, as the recipe's search starts;
* ``svd``: the same with the tables warm-started from a truncated SVD of the training matrix (``init="svd"``);
* ``T=0.1`` / ``T=0.15``: the softmax temperature (HEAT's code: 0.07), softmax data only.

Scored on the validation split carved from training (10% per user, seed 0, as ``heat_vs_peers``); the test split is
not read. Data: the development suite's real data sets (Gowalla, Last.fm) and generated catalogues. The timed
comparison against ALS is ``heat_vs_peers``'s job.

Run from the repo root: ``.venv/bin/python -m benchmarks.heat_recipe_candidates`` (``--quick``: tiny synthetic
data). Writes ``benchmarks/results/<--name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks._common import SHARED_DATA, machine_info, markdown_table, write_results
from benchmarks.tools.heat import load_split
from lightning_sdp.metrics import evaluate_ranking
from lightning_sdp.models.simplex.auto import auto_grid
from lightning_sdp.recipes.runner import SimpleXRunner, default_batch_size

NAME = "heat_recipe_candidates"
DATASETS = ("lastfm", "gowalla", "suite_sparse_skewed", "suite_mid_flat", "suite_dense", "suite_aside2")
CANDIDATES: dict[str, dict[str, Any]] = {
    "anchor": {},
    "svd": {"init": "svd"},
    "T=0.1": {"temperature": 0.1},
    "T=0.15": {"temperature": 0.15},
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    datasets = ["synthetic"] if args.quick else args.datasets
    for name in datasets:
        split = load_split(name, args.data, 0.1, args.quick)
        if split is None:
            continue
        runner = SimpleXRunner(
            split.train, split.num_items, default_batch_size(len(split.train[1])), args.threads, 0, {}
        )
        anchor = {key: values[0] for key, values in auto_grid(runner.stats).items()}
        for label in args.candidates:
            change = CANDIDATES[label]
            if "temperature" in change and anchor["loss"] != "softmax":
                continue  # the temperature is the softmax loss's
            for count in args.epochs:
                steps = max(1, int(count * runner.steps_per_epoch))
                began = time.perf_counter()
                model, _, _ = runner.fit({**anchor, **change}, steps)
                recall, ndcg = evaluate_ranking(model.score, split.train, split.val, split.num_items, 20, None)
                rows.append(
                    {
                        "dataset": name,
                        "loss": anchor["loss"],
                        "candidate": label,
                        "epochs": count,
                        "val_recall@20": recall,
                        "val_ndcg@20": ndcg,
                        "wall_s": time.perf_counter() - began,
                    }
                )
                print(f"  {name} {label} {count:g} epochs: val Recall@20 {recall:.4f}", flush=True)
    return {"args": vars(args), "machine": machine_info(), "rows": rows}


def report(results: dict[str, Any]) -> str:
    rows = results["rows"]
    labels = list(dict.fromkeys(r["candidate"] for r in rows))
    table = []
    for name in dict.fromkeys(r["dataset"] for r in rows):
        for count in dict.fromkeys(r["epochs"] for r in rows):
            cells = {r["candidate"]: r for r in rows if r["dataset"] == name and r["epochs"] == count}
            if not cells:
                continue
            best = max(r["val_recall@20"] for r in cells.values())
            row = {"dataset": name, "loss": next(iter(cells.values()))["loss"], "epochs": f"{count:g}"}
            for label in labels:
                value = cells[label]["val_recall@20"] if label in cells else None
                row[label] = "" if value is None else (f"**{value:.4f}**" if value == best else f"{value:.4f}")
            table.append(row)
    return (
        "Validation Recall@20 (10% of each user's training items, seed 0; the test split is not read) of the recipe's "
        "anchor configuration and of one change at a time, each trained for a fixed number of epochs with its rate "
        "decaying linearly to 0. Best of a row in bold. One seed: differences under about 0.005 are within "
        "run-to-run spread.\n\n" + markdown_table(table, ["dataset", "loss", "epochs", *labels]) + "\n"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--datasets", type=lambda s: s.split(","), default=list(DATASETS))
    parser.add_argument("--candidates", type=lambda s: s.split(","), default=list(CANDIDATES))
    parser.add_argument("--epochs", type=lambda s: [float(x) for x in s.split(",")], default=[5.0, 20.0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data", default=str(SHARED_DATA / "gowalla"), help="Gowalla's folder (Last.fm's beside it)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--name", default=None, help=f"results file stem (default {NAME}, {NAME}_quick)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.candidates) - set(CANDIDATES))
    if unknown:
        raise SystemExit(f"unknown candidates {unknown}; choose from {', '.join(CANDIDATES)}")
    if args.quick:
        args.epochs = [2.0]
    results = run(args)
    write_results(args.name or (f"{NAME}_quick" if args.quick else NAME), results, report(results))
    return results


if __name__ == "__main__":
    main()
