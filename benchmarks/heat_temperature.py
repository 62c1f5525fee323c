"""How the softmax loss's temperature changes what HEAT's model reaches, catalogue by catalogue and with training length.

HEAT's code trains its softmax over ``cos / temperature`` at a temperature of 0.07, which the budgeted recipe keeps.
This study trains the recipe's cheapest softmax shape (MF, d=64, 64 negatives, clipping 0.1, SGD at rate 0.1 decaying
linearly to 0, through the same :class:`~lightning_sdp.recipes.runner.SimpleXRunner` the recipe uses) for a fixed
number of epochs at several fixed temperatures, and with the temperature annealed over the schedule (``1 / T``
linear from ``1 / T0`` at the start to ``1 / T1`` at the end: a soft start that sharpens), on the softmax side of the
development suite (``benchmarks/tools/catalogues.py``). Scored on the validation split carved from training (10%
per user, seed 0, as ``heat_vs_peers``); the test split is not read. Quality only: the temperature does not change a
step's cost.

Run from the repo root: ``.venv/bin/python -m benchmarks.heat_temperature`` (about 20 minutes on 2 cores;
``--quick``: one catalogue, 2 and 4 epochs). Writes ``benchmarks/results/heat_temperature.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from benchmarks._common import machine_info, markdown_table, write_results
from benchmarks.tools.heat import load_split
from lightning_sdp.metrics import evaluate_ranking
from lightning_sdp.recipes.runner import SimpleXRunner, default_batch_size

NAME = "heat_temperature"
DATASETS = (
    "suite_mid_flat",
    "suite_popularity_only",
    "suite_long_histories",
    "suite_dense",
    "suite_very_dense",
    "suite_aside",
    "suite_aside2",
    "suite_aside3",
)
CONFIG: dict[str, Any] = {"loss": "softmax", "grad_clip": 0.1, "dim": 64, "num_negatives": 64, "lr": 0.1}


class AnnealTemperature(Callback):
    """Sets the module's softmax temperature before every step: ``1 / T`` linear from ``1 / start`` to ``1 / end``
    over ``steps`` steps (the fused kernel reads the temperature from the module's config at every step)."""

    def __init__(self, start: float, end: float, steps: int) -> None:
        self.start, self.end, self.steps = start, end, max(1, steps)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        progress = min(1.0, trainer.global_step / self.steps)
        inverse = (1.0 - progress) / self.start + progress / self.end
        pl_module.config = dataclasses.replace(pl_module.config, temperature=1.0 / inverse)  # type: ignore[union-attr]


def _schedules(temperatures: list[float], anneal: list[str]) -> list[tuple[str, float, float]]:
    """``(label, start, end)`` for every fixed temperature and every ``"T0:T1"`` anneal."""
    out = [(f"{t:g}", t, t) for t in temperatures]
    for pair in anneal:
        start, end = (float(x) for x in pair.split(":"))
        out.append((f"{start:g}->{end:g}", start, end))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    datasets = ["synthetic"] if args.quick else args.datasets
    epochs = [2.0, 4.0] if args.quick else args.epochs
    for name in datasets:
        split = load_split(name, args.data, 0.1, args.quick)
        if split is None:
            continue
        # one runner per catalogue (its positive pairs and statistics); every fit builds a fresh model
        runner = SimpleXRunner(
            split.train, split.num_items, default_batch_size(len(split.train[1])), args.threads, 0, {}
        )
        for label, start, end in _schedules(args.temperatures, args.anneal):
            for count in epochs:
                steps = max(1, int(count * runner.steps_per_epoch))
                callbacks = [] if start == end else [AnnealTemperature(start, end, steps)]
                config = {**CONFIG, "temperature": start}
                began = time.perf_counter()
                model, _, _ = runner.fit(config, steps, callbacks=callbacks)
                recall, ndcg = evaluate_ranking(model.score, split.train, split.val, split.num_items, 20, None)
                row = {
                    "dataset": name,
                    "temperature": label,
                    "epochs": count,
                    "steps": steps,
                    "val_recall@20": recall,
                    "val_ndcg@20": ndcg,
                    "wall_s": time.perf_counter() - began,
                }
                print(f"  {name} T={label} {count:g} epochs: val Recall@20 {recall:.4f}", flush=True)
                rows.append(row)
    return {"args": vars(args), "config": CONFIG, "machine": machine_info(), "rows": rows}


def report(results: dict[str, Any]) -> str:
    rows = results["rows"]
    labels = list(dict.fromkeys(r["temperature"] for r in rows))
    table = []
    for name in dict.fromkeys(r["dataset"] for r in rows):
        for count in dict.fromkeys(r["epochs"] for r in rows):
            cells = {
                r["temperature"]: r["val_recall@20"] for r in rows if r["dataset"] == name and r["epochs"] == count
            }
            if not cells:
                continue
            best = max(cells.values())
            table.append(
                {
                    "dataset": name,
                    "epochs": f"{count:g}",
                    **{f"T={k}": f"**{v:.4f}**" if v == best else f"{v:.4f}" for k, v in cells.items()},
                }
            )
    columns = ["dataset", "epochs", *(f"T={k}" for k in labels)]
    return (
        f"Validation Recall@20 (10% of each user's training items, seed 0; the test split is not read) of MF with "
        f"HEAT's softmax loss, {results['config']}, trained for a fixed number of epochs with its rate decaying "
        "linearly to 0, at fixed temperatures and with `1 / T` annealed linearly from `T0` to `T1` (`T0->T1`). "
        "Best of a row in bold. One seed: differences under about 0.005 are within run-to-run spread.\n\n"
        f"{markdown_table(table, columns)}\n"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", type=lambda s: s.split(","), default=list(DATASETS))
    parser.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.07, 0.1, 0.15])
    parser.add_argument("--anneal", type=lambda s: [x for x in s.split(",") if x], default=["0.15:0.07"])
    parser.add_argument("--epochs", type=lambda s: [float(x) for x in s.split(",")], default=[20.0, 60.0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data", default="../shared/data")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--name", default=NAME)
    args = parser.parse_args(argv)
    results = run(args)
    write_results(f"{args.name}_quick" if args.quick else args.name, results, report(results))
    return results


if __name__ == "__main__":
    main()
