"""Validation learning curves of the budgeted recipe's candidate configurations (validation only, no test split).

Each configuration of the recipe's seed sample (:func:`~lightning_sdp.recipes.sample_configs`, led by
the anchor and the cheap anchor, as :func:`~lightning_sdp.recipes.fit_simplex_within_budget` does) is
trained as complete linear schedules of ``--steps`` steps, the search's trial lengths, and as one schedule sized to
``--final-seconds`` of training, the final fit of a short budget; each is scored on the validation split carved from
the training interactions (``heat_vs_peers``'s split, seed 0). It shows where short trials rank configurations
differently from the final fit (a configuration that levels off early, one that takes off late), which is what the
search's extrapolation rules (``extrapolate_recall``) have to get right. Quality, not speed: timings are reported but
compare nothing.

``PYTHONPATH=. python benchmarks/heat_budget_curves.py --dataset synthetic_fresh`` (about 4 minutes on 2 cores);
``--quick`` runs tiny synthetic data in seconds.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from benchmarks._common import SHARED_DATA, markdown_table, write_results
from benchmarks.tools.heat import DATASETS, load_split, set_threads
from lightning_sdp.recipes import (
    CCL_GRID,
    SimpleXRunner,
    default_batch_size,
    evaluate_ranking,
    recipe_configs,
)

NAME = "heat_budget_curves"


def _label(config: dict[str, Any]) -> str:
    return (
        f"d{config['dim']} n{config['num_negatives']} m{config['margin']:g} w{config['negative_weight']:g} "
        f"lr{config['lr']:g}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="synthetic_fresh", choices=DATASETS)
    parser.add_argument("--data", default=str(SHARED_DATA / "gowalla"), help="LightGCN folder of the Gowalla split")
    parser.add_argument("--configs", type=int, default=8, help="configurations of the recipe's sample")
    parser.add_argument("--steps", default="50,100,200,400", help="trial lengths (steps), comma list")
    parser.add_argument("--final-seconds", type=float, default=20.0, help="training time of the long schedule")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=NAME, help="stem of the results files")
    parser.add_argument("--quick", action="store_true", help="tiny synthetic data, seconds (smoke test)")
    args = parser.parse_args(argv)
    load_start = os.getloadavg()[0]  # the machine info written with the results has the load at the end
    steps_list = [int(s) for s in args.steps.split(",")]
    if args.quick:
        args.dataset, args.configs, steps_list, args.final_seconds = "synthetic", 2, [5, 10], 1.0
        args.name = f"{NAME}_quick"
    limiter = set_threads(args.threads)  # noqa: F841  (keeps the BLAS limit alive)
    split = load_split(args.dataset, args.data, 0.1, args.quick)
    if split is None:
        raise SystemExit(1)
    train, val, num_items = split.train, split.val, split.num_items
    batch_size = default_batch_size(len(train[1]))
    runner = SimpleXRunner(train, num_items, batch_size, args.threads, args.seed, {})
    configs = recipe_configs(CCL_GRID, args.configs, args.seed)
    runner.fit(configs[0], 1)  # compiles the kernel
    rows: list[dict[str, Any]] = []
    for config in configs:
        row: dict[str, Any] = {"config": _label(config)}
        for steps in steps_list:
            model, clock, _ = runner.fit(config, steps)
            row[f"val@{steps}"] = evaluate_ranking(model.score, train, val, num_items, 20, None)[0]
        model, final_steps, train_s, _ = runner.fit_for_seconds(config, args.final_seconds)
        row["final_steps"] = final_steps
        row["val_final"] = evaluate_ranking(model.score, train, val, num_items, 20, None)[0]
        row["final_train_s"] = train_s
        rows.append(row)
        print(row, flush=True)
    payload = {
        "args": vars(args),
        "split": split.describe(),
        "batch_size": batch_size,
        "load_avg_1m_start": load_start,
        "configs": configs,
        "rows": rows,
    }
    markdown = (
        f"Validation Recall@20 of the recipe's seed-{args.seed} sample on `{split.name}` after complete linear "
        f"schedules of {', '.join(map(str, steps_list))} steps and of {args.final_seconds:g} s of training "
        f"(batch {batch_size}, {args.threads} threads; load {load_start:.2f} at the start). Validation only; the "
        "test split is not read.\n\n" + markdown_table(rows)
    )
    write_results(args.name, payload, markdown)
    return payload


if __name__ == "__main__":
    main()
