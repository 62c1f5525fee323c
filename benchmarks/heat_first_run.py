"""HEAT's first run on a fresh install: test Recall@20 after a ``max_time`` budget with an empty kernel cache, against
the same run once the cache is warm.

A user's first ``Trainer(accelerator="heat", max_time=...)`` with ``SimpleXModule(backend="fused")`` must not spend
its budget compiling numba kernels. Each repeat makes a new, empty cache folder (``NUMBA_CACHE_DIR``) and runs the
same fit twice in fresh processes: first with the cache empty (the first run), then with what that run cached (every
later run). Everything else is the user's defaults: ``SimpleXModule(backend="fused")``, ``InteractionsDataModule``
on the data folder, validation every epoch. Reported per run: test Recall@20 / NDCG@20, epochs trained, seconds
before training started (set-up, compilation included) and seconds the Trainer's clock counted. The target: the
first run reaches at least 0.9 of the warm run's Recall@20.

Run from the repo root: ``.venv/bin/python -m benchmarks.heat_first_run`` (Last.fm, 30 s, 2 repeats, about 3
minutes); ``--quick``: synthetic data, 3 s. Writes ``benchmarks/results/<--name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks._common import SHARED_DATA, markdown_table, write_results

NAME = "heat_first_run"


def fit_once(args: argparse.Namespace) -> dict[str, Any]:
    """One user-style fit in this process (the child): what it scored and where its time went."""
    from lightning.pytorch import Callback, Trainer

    import lightning_sdp  # noqa: F401  (registers accelerator="heat")
    from lightning_sdp.datamodules import InteractionsDataModule
    from lightning_sdp.models import SimpleXModule

    class FirstBatch(Callback):
        started: float | None = None

        def on_train_batch_start(self, *_: Any) -> None:
            self.started = self.started or time.perf_counter()

    began = time.perf_counter()
    data = InteractionsDataModule(path=args.data, drop_cold_test_users=True) if args.data else InteractionsDataModule()
    first = FirstBatch()
    trainer = Trainer(
        accelerator="heat",
        devices=1,
        max_time={"seconds": args.seconds},
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[first],
    )
    model = SimpleXModule(backend="fused")
    trainer.fit(model, data)
    fit_end = time.perf_counter()
    scores = trainer.test(model, data, verbose=False)[0]
    timer = next(cb for cb in trainer.callbacks if type(cb).__name__ == "Timer")
    return {
        "recall@20": scores["test/recall@20"],
        "ndcg@20": scores["test/ndcg@20"],
        "epochs": trainer.current_epoch,
        "steps": trainer.global_step,
        "seconds_before_training": (first.started or fit_end) - began,
        "seconds_on_the_clock": timer.time_elapsed("train"),
        "seconds_in_fit": fit_end - began,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="heat_first_run_cache_") as cache:
            for label in ("first run (empty cache)", "warm cache"):
                env = {**os.environ, "NUMBA_CACHE_DIR": cache}
                command = [sys.executable, "-m", "benchmarks.heat_first_run", "--child", *_child_args(args)]
                out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                runs.append({"repeat": repeat, "run": label, **row})
                print(f"{label}, repeat {repeat}: {row}", flush=True)
    first = [r["recall@20"] for r in runs if r["run"].startswith("first")]
    warm = [r["recall@20"] for r in runs if r["run"] == "warm cache"]
    ratios = [f / w for f, w in zip(first, warm, strict=True)]
    summary = {"first_over_warm": statistics.median(ratios), "ratios": ratios, "target": 0.9}
    return {"args": vars(args), "runs": runs, "summary": summary}


def _child_args(args: argparse.Namespace) -> list[str]:
    return ["--seconds", str(args.seconds), "--data", args.data]


def render(results: dict[str, Any]) -> tuple[str, None]:
    s, a = results["summary"], results["args"]
    data = a["data"] or "synthetic data"
    text = (
        f'`Trainer(accelerator="heat", max_time={a["seconds"]:g} s)` with `SimpleXModule(backend="fused")` '
        f"defaults on {data}, each repeat with a new, empty numba cache. The first run reached "
        f"{s['first_over_warm']:.3f} of the warm run's test Recall@20 (median over {len(s['ratios'])} repeats; "
        f"target >= {s['target']}).\n\n"
    )
    return text + markdown_table(results["runs"]), None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--data", default=str(SHARED_DATA / "lastfm"), help="LightGCN folder or CSV ('' synthetic)")
    parser.add_argument("--seconds", type=float, default=30.0, help="the Trainer's max_time")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="synthetic data, 3 s, one repeat")
    parser.add_argument("--name", default=None, help=f"results file stem (default {NAME}, {NAME}_quick)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.data, args.seconds, args.repeats = "", 3.0, 1
    if args.child:
        print(json.dumps(fit_once(args)))
        return {}
    if args.data and not os.path.exists(args.data):
        raise SystemExit(f"{args.data} not found; pass --data (a LightGCN folder or a CSV) or --data ''")
    results = run(args)
    write_results(args.name or (f"{NAME}_quick" if args.quick else NAME), results, *render(results))
    return results


if __name__ == "__main__":
    main()
