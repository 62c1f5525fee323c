"""SDP4BitStrategy in one process against plain training: what the strategy costs when nothing is communicated.

With one process the strategy leaves the model, the optimizer and the precision plugin alone, so a step should cost
what a plain step costs (target: median step time at most 1.05x). The same character GPT (the model shapes of
``benchmarks/sdp4bit_throughput.py``: 4 layers x 4 heads x 256, context 64; batch 16, the 1024 tokens per step of
its 4 processes) is trained in this one CPU process with ``strategy="auto"`` and with ``strategy="sdp4bit"``: same
seed, steps, batch and model, runs alternating (auto, sdp4bit, auto, ...) so that a change in the machine's load
shows on both. Reported: the median wall time per step (from one batch's start to the next one's, so data loading,
the optimizer step and logging count) and the process CPU time per step, after the warm-up steps.

Lightning feeds a shuffling ``DistributedSampler`` to every strategy derived from DDP, this one too (as
``strategy="ddp", devices=1``), so the two runs see the same batches in a different order; the losses are reported
for that reason, not compared.

    python -m benchmarks.sdp4bit_single_process            # 5 pairs x 60 steps (a few minutes on 2 cores)
    python -m benchmarks.sdp4bit_single_process --quick    # smoke test: 1 pair x 8 steps, writes *_quick.*
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks._common import SHARED_DATA, markdown_table, write_results
from benchmarks.tools.step_timer import StepTimer

STRATEGIES = ("auto", "sdp4bit")
TARGET_RATIO = 1.05


class _Recorder(StepTimer):
    """:class:`StepTimer` plus the training loss of every step."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def _run(strategy_name: str, args: argparse.Namespace, path: str | None) -> dict[str, Any]:
    """Train the GPT for ``args.steps`` steps with one strategy; times of the steps after the warm-up."""
    import lightning.pytorch as pl

    from lightning_sdp import SDP4BitStrategy
    from lightning_sdp.datamodules.text import CharTextDataModule
    from lightning_sdp.models.gpt import GPT

    pl.seed_everything(args.seed, verbose=False)
    data = CharTextDataModule(path, block_size=args.block, batch_size=args.batch, seed=args.seed)
    data.setup("fit")
    model = GPT(
        vocab_size=data.vocab_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
        block_size=args.block, learning_rate=args.lr, warmup_steps=min(20, args.steps), max_steps=args.steps,
    )  # fmt: skip
    strategy: Any = SDP4BitStrategy() if strategy_name == "sdp4bit" else "auto"
    rec = _Recorder()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=args.steps, limit_val_batches=0,
        num_sanity_val_steps=0, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[rec],
    )  # fmt: skip
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strategy's one-process warning, Lightning's num_workers hint
        trainer.fit(model, data)
    wall = time.perf_counter() - t0
    steps = rec.intervals()[args.warmup :]  # batch start to the next batch's start: the whole step
    cpu = rec.cpu_starts[args.warmup :]
    return {
        "strategy": strategy_name,
        "median_step_ms": 1e3 * statistics.median(steps),
        "mean_step_ms": 1e3 * statistics.fmean(steps),
        "cpu_ms_per_step": 1e3 * (cpu[-1] - cpu[0]) / (len(cpu) - 1),
        "fit_s": wall,
        "final_loss": rec.losses[-1],
        "step_ms": [1e3 * s for s in steps],
        "sharded": bool(getattr(trainer.strategy, "buckets", [])),
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in STRATEGIES:
        mine = [r for r in runs if r["strategy"] == name]
        out[name] = {
            "median_step_ms": statistics.median([s for r in mine for s in r["step_ms"]]),
            "cpu_ms_per_step": statistics.median([r["cpu_ms_per_step"] for r in mine]),
            "run_medians_ms": [round(r["median_step_ms"], 2) for r in mine],
        }
    out["step_ratio"] = out["sdp4bit"]["median_step_ms"] / out["auto"]["median_step_ms"]
    out["cpu_ratio"] = out["sdp4bit"]["cpu_ms_per_step"] / out["auto"]["cpu_ms_per_step"]
    out["target_ratio"] = TARGET_RATIO
    out["meets_target"] = out["step_ratio"] <= TARGET_RATIO
    return out


def _figure(runs: list[dict[str, Any]], summary: dict[str, Any], title: str) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    data = [[s for r in runs if r["strategy"] == name for s in r["step_ms"]] for name in STRATEGIES]
    ax.boxplot(data, showfliers=False)
    ax.set_xticks([1, 2], [f'strategy="{name}"' for name in STRATEGIES])
    ax.set_ylabel("wall time per step (ms)")
    ax.set_title(f"{title}\nmedian ratio sdp4bit / auto = {summary['step_ratio']:.3f} (target <= {TARGET_RATIO})")
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 pair of runs x 8 steps; writes *_quick.*")
    parser.add_argument("--pairs", type=int, default=5, help="runs of each strategy, alternating")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    parser.add_argument("--data", default=str(SHARED_DATA / "tinyshakespeare" / "input.txt"))
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="windows per step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the usable cores)")
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs, args.steps, args.warmup = 1, 8, 2
    if args.steps - args.warmup < 3:
        parser.error("--steps must exceed --warmup by at least 3")
    # The same threads for both: Lightning sets torch's threads for strategies derived from DDP (cores / processes)
    # unless OMP_NUM_THREADS is set, which would make the two runs differ by more than the strategy.
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import torch

    from benchmarks._common import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.set_num_threads(int(threads or 1))
    path = args.data if Path(args.data).exists() else None
    if path is None:
        print(f"{args.data} not found: using the built-in corpus")

    runs = []
    for pair in range(args.pairs):
        for name in STRATEGIES:
            run = _run(name, args, path)
            run["pair"] = pair
            runs.append(run)
            print(
                f"pair {pair} {name:8s} median {run['median_step_ms']:.2f} ms/step, CPU {run['cpu_ms_per_step']:.2f} "
                f"ms/step, final loss {run['final_loss']:.3f}"
            )
    summary = _summary(runs)
    _write(args, path, runs, summary, threads)


def _write(args: argparse.Namespace, path: str | None, runs: list[dict[str, Any]], summary: dict, threads: Any) -> None:
    corpus = "tiny Shakespeare" if path else "built-in corpus"
    shape = f"GPT {args.n_layer} layers x {args.n_head} heads x {args.n_embd}, context {args.block}"
    title = f"one CPU process, {shape}"
    rows = [
        {
            "strategy": f'"{name}"',
            "median ms/step": summary[name]["median_step_ms"],
            "vs auto": summary[name]["median_step_ms"] / summary["auto"]["median_step_ms"],
            "CPU ms/step": summary[name]["cpu_ms_per_step"],
            "CPU vs auto": summary[name]["cpu_ms_per_step"] / summary["auto"]["cpu_ms_per_step"],
            "median of each run (ms)": ", ".join(f"{v:.1f}" for v in summary[name]["run_medians_ms"]),
        }
        for name in STRATEGIES
    ]
    verdict = "meets" if summary["meets_target"] else "misses"
    md = (
        f"{shape}, batch {args.batch} ({args.batch * args.block} tokens per step), {corpus}, AdamW lr {args.lr}, "
        f"gradient clipping 1.0, 32-bit; runs alternating, {args.pairs} of each strategy, {args.steps} steps each, "
        f"the first {args.warmup} left out; {threads} torch threads. Median over the timed steps of all runs; CPU "
        f"time is this process's, median over runs.\n\n"
        + markdown_table(rows, list(rows[0]), floatfmt="{:.3f}")
        + f"\n\nRatio of median step times sdp4bit / auto: **{summary['step_ratio']:.3f}** ({verdict} the target "
        f"<= {TARGET_RATIO}).\n"
    )
    payload = {
        "config": {k: v for k, v in vars(args).items()} | {"data": path or "builtin", "threads": threads},
        "summary": summary,
        "runs": runs,
    }
    write_results(
        "sdp4bit_single_process" + ("_quick" if args.quick else ""), payload, md, _figure(runs, summary, title)
    )
    print(md)


if __name__ == "__main__":
    main()
