"""HEAT through the Trainer: positives/s of the fused kernel alone and of a Lightning fit, and what the fit adds.

The budgeted recipe trains through ``Trainer.fit`` (so users get Lightning's loops, callbacks and checkpoints), and
on Gowalla a fused step is short (MF-CCL d=64, 64 negatives: ~8 ms for 12,658 positives), so every millisecond a
step spends outside the kernel costs throughput. One run measures, on the same data and configuration:

* ``kernel``: :meth:`SimpleXModule.fused_step` in a plain loop over pre-shuffled batches (no Trainer);
* ``trainer``: the recipe's fit (:class:`SimpleXRunner`): Lightning loop, data loader, row projection, logging on
  Lightning's logging steps (``StepLogWindow``);
* ``trainer_log_every_step``: the same fit with the three training statistics logged at every step, as the module
  did at first (``self.log`` costs ~1 ms a call);
* ``trainer_torch_gather``: the same fit with the batches gathered by torch indexing, as the data set did at
  first (torch's gather competes for the cores with the kernel's still-spinning OpenMP threads);
* ``trainer_before``: both of the above, the fit as it was at first;

and the recipe's validation scoring (:func:`evaluate_ranking`, 5,000 users) with its default batches (~16 MB of
scores) against the 1,024-user batches it used at first.

Writes ``benchmarks/results/heat_trainer_overhead.{json,md}``. Run from the repo root:
``.venv/bin/python -m benchmarks.heat_trainer_overhead`` (``--quick``: small synthetic data, seconds).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback

from benchmarks._common import SHARED_DATA, markdown_table, write_results
from lightning_sdp.datamodules.interactions import InteractionsDataModule, PositivePairs
from lightning_sdp.plugins.heat import set_cpu_threads
from lightning_sdp.recipes import SimpleXRunner, default_batch_size, evaluate_ranking

CONFIG = {"dim": 64, "num_negatives": 64, "margin": 0.9, "negative_weight": 150.0, "lr": 0.1}


class _LogEveryStep(Callback):
    """Logs three statistics at every step, as ``SimpleXModule`` did before its logging window."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        for name in ("bench/loss", "bench/lr", "bench/positives_per_sec"):
            pl_module.log(name, 1.0)


class _TorchGatherPairs(PositivePairs):
    """The data set's earlier gather: torch indexing."""

    def __getitem__(self, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(np.asarray(index, dtype=np.int64))
        return self.users[idx], self.items[idx]


def _kernel_rate(runner: SimpleXRunner, steps: int) -> float:
    model = runner.model(CONFIG)
    order = np.random.default_rng(0).permutation(len(runner.pairs))
    users, items = runner.pairs.users[order], runner.pairs.items[order]
    b = runner.batch_size
    model.fused_step(users[:b], items[:b], 0.1)  # warm-up
    done, start = 0, time.perf_counter()
    for s in range(steps):
        lo = (s * b) % max(1, len(order) - b)
        model.fused_step(users[lo : lo + b], items[lo : lo + b], 0.1)
        if model.config.row_norm is not None:
            model.project_rows(model.config.row_norm)  # the fit projects every step too
        done += b
    return done / (time.perf_counter() - start)


def _trainer_rate(runner: SimpleXRunner, steps: int, variant: str) -> float:
    saved = runner.pairs
    if variant in ("trainer_torch_gather", "trainer_before"):
        runner.pairs = _TorchGatherPairs(saved.users.numpy(), saved.items.numpy())
    callbacks = [_LogEveryStep()] if variant in ("trainer_log_every_step", "trainer_before") else []
    try:
        _, clock, _ = runner.fit(CONFIG, steps, callbacks=callbacks)
    finally:
        runner.pairs = saved
    return runner.batch_size * (len(clock.ends) - 1) / (clock.ends[-1] - clock.ends[0])


def _scoring_seconds(model: Any, train: tuple, val: tuple, num_items: int, batch_size: int | None) -> float:
    users = np.flatnonzero(np.diff(val[0]) > 0)[:5000]
    start = time.perf_counter()
    evaluate_ranking(model.score, train, val, num_items, 20, users, batch_size=batch_size)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=str(SHARED_DATA / "gowalla"))
    parser.add_argument("--steps", type=int, default=300, help="training steps per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per variant (interleaved; median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    set_cpu_threads(args.threads)
    load_start = os.getloadavg()[0]
    if args.quick or not os.path.isdir(args.data):
        if not args.quick:
            print(f"{args.data} not found: using the synthetic catalogue (see ../shared/data/README.md)")
        dm = InteractionsDataModule(num_users=400, num_items=300, interactions_per_user=20, seed=0)
        args.steps, args.repeats, data_name = min(args.steps, 20), 1, "synthetic_quick"
    else:
        dm = InteractionsDataModule(args.data)
        data_name = "gowalla"
    dm.setup("fit")
    train = (np.asarray(dm.train_csr[0], np.int64), np.asarray(dm.train_csr[1], np.int64))
    batch = default_batch_size(len(train[1]))
    runner = SimpleXRunner(train, dm.num_items, batch, args.threads, 0, {})
    runner.fit(CONFIG, 2)  # compiles the kernel
    _kernel_rate(runner, min(args.steps, 50))  # warms the allocator and the thread pools up for every variant
    variants = ["kernel", "trainer", "trainer_log_every_step", "trainer_torch_gather", "trainer_before"]
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:  # interleaved, so a drift of the host touches every variant alike
            rate = _kernel_rate(runner, args.steps) if v == "kernel" else _trainer_rate(runner, args.steps, v)
            rates[v].append(rate)
    scored, _, _ = runner.fit(CONFIG, 2)
    val = (np.asarray(dm.val_csr[0], np.int64), np.asarray(dm.val_csr[1], np.int64))
    scoring: dict[str, list[float]] = {"batch_1024": [], "batch_default": []}
    for _ in range(args.repeats):
        scoring["batch_1024"].append(_scoring_seconds(scored, train, val, dm.num_items, 1024))
        scoring["batch_default"].append(_scoring_seconds(scored, train, val, dm.num_items, None))
    scoring_rows = [
        {"scoring": name, "seconds": float(np.median(t)), "runs": ", ".join(f"{x:.3g}" for x in t)}
        for name, t in scoring.items()
    ]
    median = {v: float(np.median(r)) for v, r in rates.items()}
    rows = [
        {
            "variant": v,
            "positives_per_s": median[v],
            "ms_per_step": 1e3 * batch / median[v],
            "vs_trainer": median[v] / median["trainer"],
            "runs": ", ".join(f"{r:.4g}" for r in rates[v]),
        }
        for v in variants
    ]
    load_end = os.getloadavg()[0]
    payload = {
        "args": vars(args),
        "data": data_name,
        "batch_size": batch,
        "config": CONFIG,
        "rows": rows,
        "scoring": scoring_rows,
        "load_avg_start": load_start,
        "load_avg_end": load_end,
    }
    md = (
        f"Data: {data_name} ({len(train[1]):,} training positives), MF-CCL {CONFIG}, tile sampler, unit-norm rows, "
        f"batches of {batch:,} positives, {args.threads} threads, {args.steps} steps per measurement, median of "
        f"{args.repeats} interleaved measurements; load average {load_start:.2f} at the start, {load_end:.2f} at the "
        "end. `kernel` = fused_step + row projection in a plain loop; `trainer` = the recipe's Trainer fit today; "
        "`trainer_log_every_step` and `trainer_torch_gather` restore one earlier behaviour each, `trainer_before` both.\n\n"
        + markdown_table(rows)
        + "\n\nValidation scoring of up to 5,000 users (`evaluate_ranking`), seconds, median of the same repeats:\n\n"
        + markdown_table(scoring_rows)
    )
    name = "heat_trainer_overhead_quick" if args.quick else "heat_trainer_overhead"
    write_results(name, payload, md)
    print(md)
    return payload


if __name__ == "__main__":
    main()
