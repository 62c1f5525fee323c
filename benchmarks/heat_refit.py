"""What the validation split costs: one HEAT configuration trained on train minus validation and on the whole train.

The budgeted recipe (``fit_simplex_within_budget``) chooses its configuration on a validation split carved out of
the training interactions; this measures what folding that split back in for the final fit (``refit``) is worth.
The same configuration, seed and number of epochs train twice through ``Trainer(accelerator="heat")``: on train
minus validation (``split_validation``, ``--val-fraction`` per user, seed 0) and on the whole training split; both
are scored once on the test split with every training item masked. Quality only (the epoch count is fixed), so the
machine's load does not change the result; the training times are reported for reference.

Run ``python -m benchmarks.heat_refit`` (Gowalla from ``../shared/data/gowalla``, about 8 minutes on 2 cores);
``--quick`` uses tiny synthetic data. Results: ``benchmarks/results/heat_refit.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from benchmarks._common import SHARED_DATA, machine_info, markdown_table, write_results
from benchmarks.tools.heat import heat_batch_size, load_split, set_threads
from lightning_sdp.recipes import SimpleXRunner, evaluate_ranking

NAME = "heat_refit"
#: The configuration the recipe chose at a 10-minute budget on Gowalla (held-out protocol, seed 0).
DEFAULT_CONFIG = {"dim": 64, "num_negatives": 200, "margin": 0.8, "negative_weight": 150.0, "lr": 0.3}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=str(SHARED_DATA / "gowalla"), help="LightGCN folder of the Gowalla split")
    parser.add_argument("--config", default=json.dumps(DEFAULT_CONFIG), help="SimpleXModule settings (JSON)")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny synthetic data, seconds (smoke test)")
    args = parser.parse_args(argv)
    config = json.loads(args.config)
    dataset, epochs = ("synthetic", 3) if args.quick else ("gowalla", args.epochs)
    limiter = set_threads(args.threads)
    split = load_split(dataset, args.data, args.val_fraction, args.quick)
    if split is None:
        return {}
    results: dict[str, Any] = {"args": vars(args), "config": config, "machine": machine_info(), "rows": []}
    batch = heat_batch_size(split)  # the recipe's batch size, the same for both
    for data, train in (("train minus validation", split.train), ("whole train (refit)", split.full_train)):
        runner = SimpleXRunner(train, split.num_items, batch, args.threads, args.seed, {})
        steps = epochs * runner.steps_per_epoch
        model, clock, _ = runner.fit(config, steps)
        recall, ndcg = evaluate_ranking(model.score, split.full_train, split.test, split.num_items)
        row = {
            "trained on": data,
            "positives": len(train[1]),
            "epochs": epochs,
            "steps": steps,
            "train_s": round(clock.train_seconds, 1),
            "test Recall@20": recall,
            "test NDCG@20": ndcg,
        }
        results["rows"].append(row)
        print(row, flush=True)
    del limiter
    held_out, refit = results["rows"]
    gain = refit["test Recall@20"] - held_out["test Recall@20"]
    md = (
        f"{split.name}, configuration {json.dumps(config)}, {epochs} epochs, batch {batch}, {args.threads} threads, "
        f"seed {args.seed}; validation {args.val_fraction:.0%} per user (`split_validation`, seed 0). Test scored "
        f"once per model, every training item masked.\n\n{markdown_table(results['rows'], floatfmt='{:.4f}')}\n\n"
        f"Refit gain: {gain:+.4f} Recall@20, {refit['test NDCG@20'] - held_out['test NDCG@20']:+.4f} NDCG@20."
    )
    write_results(NAME + ("_quick" if args.quick else ""), results, md)
    return results


if __name__ == "__main__":
    main()
