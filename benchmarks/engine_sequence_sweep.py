"""EngineProfiler benchmark: the Gaudi paper's long-sequence study on a small GPT, plus the callback's overhead.

1. Sweep: sequence lengths 64..2048, explicit (unfused softmax) and fused SDPA attention (optionally linear), a
   2-layer 128-wide GPT on the CPU: matrix / vector / attention shares and achieved GFLOP/s per point, with the
   analytic model's prediction from the measured (calibrated) CPU matrix and vector throughput.
2. Overhead: step time without the callback, with the callback outside its window, and inside its window
   (profiled); plus the cost of one hook call outside the window, timed directly.

    .venv/bin/python -m benchmarks.engine_sequence_sweep            # full (a few minutes on 2 shared cores)
    .venv/bin/python -m benchmarks.engine_sequence_sweep --quick    # smoke run (tiny GPT, well under a minute)

Writes ``benchmarks/results/engine_sequence_sweep.{json,md,png}`` (``engine_sequence_sweep_quick`` with --quick).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, TensorDataset

from benchmarks._common import machine_info, markdown_table, write_results
from benchmarks.tools.step_timer import StepTimer
from lightning_sdp.callbacks.engine_profiler import EngineProfiler
from lightning_sdp.callbacks.engine_profiler.sweep import (
    add_sweep_arguments,
    gpt_factory,
    plot_sweep,
    sequence_length_sweep,
    sweep_markdown,
)
from lightning_sdp.profiling.peaks import calibrate_cpu

VOCAB = 65


def _run(args: argparse.Namespace, callbacks: list[Callback], steps: int, seq_len: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (steps * args.batch_size, seq_len + 1), generator=g)
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=args.batch_size)
    model = gpt_factory(vocab_size=VOCAB, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)("sdpa", seq_len)
    Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    ).fit(model, loader)


def measure_overhead(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Step time: baseline vs callback outside its window vs inside it (same batches, interleaved repeats)."""
    steps, seq_len = args.overhead_steps, args.overhead_seq_len
    first, last = 2, steps - 1  # skip the first batches (allocator warm-up)
    base, outside, inside, window = [], [], [], []
    for rep in range(args.overhead_repeats):
        t = StepTimer()  # the same span the profiler measures: start of batch `first` to end of batch `last`
        _run(args, [t], steps, seq_len)
        base.append(t.per_step(first, last))
        t = StepTimer()
        _run(args, [EngineProfiler(wait=10**6, dirpath=str(tmp / f"o{rep}")), t], steps, seq_len)
        outside.append(t.per_step(first, last))
        t = StepTimer()
        # Profiled batches 2..steps-1 (warm-up batch 1 counts FLOPs and is not timed here).
        cb = EngineProfiler(
            wait=1,
            warmup=1,
            active=steps - 2,
            dirpath=str(tmp / f"i{rep}"),
            save_plot=False,
            print_summary=False,
        )
        _run(args, [t, cb], steps, seq_len)
        inside.append(cb.reports[0].step_time_s)  # the step time the profiler measured (profiler running)
        window.append(cb.reports[0].analysis_s)  # one-off: profiler stop, trace export, parsing, report
    # Cost of the hooks outside the window, timed directly (no training noise).
    cb = EngineProfiler(wait=10**9)
    n = 2000 if args.quick else 20000
    t0 = time.perf_counter()
    for _ in range(n):
        cb.on_train_batch_start(None, None, None, 0)  # type: ignore[arg-type]
        cb.on_train_batch_end(None, None, None, None, 0)  # type: ignore[arg-type]
    hook_us = (time.perf_counter() - t0) / n * 1e6
    b, o, i = statistics.median(base), statistics.median(outside), statistics.median(inside)
    w = statistics.median(window)
    return {
        "seq_len": seq_len,
        "steps": steps,
        "repeats": args.overhead_repeats,
        "baseline_ms": [v * 1e3 for v in base],
        "outside_window_ms": [v * 1e3 for v in outside],
        "inside_window_ms": [v * 1e3 for v in inside],
        "median_baseline_ms": b * 1e3,
        "median_outside_ms": o * 1e3,
        "median_inside_ms": i * 1e3,
        "analysis_s": window,
        "median_analysis_s": w,
        "outside_ratio": o / b,
        "inside_ratio": i / b,
        "hook_pair_us_outside_window": hook_us,
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    add_sweep_arguments(p, seq_lens=[64, 128, 256, 512, 1024, 2048], steps=3)
    p.add_argument("--overhead-steps", type=int, default=8)
    p.add_argument("--overhead-seq-len", type=int, default=256)
    p.add_argument("--overhead-repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadier on a loaded machine)")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_lens, args.n_layer, args.n_embd, args.batch_size, args.steps = [16, 32], 1, 32, 2, 1
        args.attention = [a for a in args.attention if a != "linear"]
        args.overhead_steps, args.overhead_seq_len, args.overhead_repeats = 5, 32, 1
    torch.set_num_threads(args.threads)
    name = "engine_sequence_sweep" + ("_quick" if args.quick else "")
    tmp = Path(tempfile.mkdtemp(prefix="engine_bench_"))
    t_start = time.perf_counter()
    load_before = machine_info().get("load_avg_1m")
    peaks = calibrate_cpu()
    print(f"CPU calibration: {peaks}")
    rows = sequence_length_sweep(
        gpt_factory(vocab_size=VOCAB, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd),
        seq_lens=args.seq_lens,
        batch_size=args.batch_size,
        attentions=args.attention,
        steps=args.steps,
        vocab_size=VOCAB,
        accelerator="cpu",
        peaks=peaks,
        dirpath=str(tmp / "sweep"),
        verbose=not args.quick,
    )
    t_sweep = time.perf_counter() - t_start
    overhead = measure_overhead(args, tmp)
    wall = time.perf_counter() - t_start

    crossover = next((r["crossover_seq_len"] for r in rows if r.get("crossover_seq_len")), None)
    ov_rows = [
        {
            "setting": "no callback",
            "ms/step (median)": overhead["median_baseline_ms"],
            "ratio": 1.0,
        },
        {
            "setting": "EngineProfiler outside its window",
            "ms/step (median)": overhead["median_outside_ms"],
            "ratio": overhead["outside_ratio"],
        },
        {
            "setting": "EngineProfiler inside its window: profiled step time",
            "ms/step (median)": overhead["median_inside_ms"],
            "ratio": overhead["inside_ratio"],
        },
    ]
    md = (
        f"Small GPT ({args.n_layer} layers, width {args.n_embd}, {args.n_head} heads), batch {args.batch_size}, "
        f"{args.steps} profiled steps per point, fp32 on the CPU with {args.threads} threads. Shares are of the "
        "measured step time (categories sum to it). `attn_module` is the per-module view's attention share "
        "(forward + backward of the attention blocks); `pred_*` is the analytic model from the calibrated CPU "
        f"throughput: matrix {peaks['matrix_tflops'] * 1e3:.1f} GFLOP/s, vector {peaks['vector_tflops'] * 1e3:.2f} "
        f"Gelem/s, so the analytic crossover n* = 24·d²·P_vec/(k·h·P_mat) ≈ "
        f"{crossover:,.0f} tokens (k = 6).\n\n"
        + sweep_markdown(rows)
        + "\n\n## Callback overhead\n\n"
        + f"Sequence length {overhead['seq_len']}, fused attention, batches 2..{overhead['steps'] - 1} of "
        f"{overhead['steps']}, median of {overhead['repeats']} interleaved repeats. One pair of hook calls outside "
        f"the window costs {overhead['hook_pair_us_outside_window']:.2f} µs (timed directly). After the window, "
        f"stopping the profiler, exporting the trace and building the report takes "
        f"{overhead['median_analysis_s']:.2f} s "
        f"once (for {overhead['steps'] - 2} profiled steps).\n\n"
        + markdown_table(ov_rows)
        + f"\n\nSweep {t_sweep:.0f} s, whole benchmark {wall:.0f} s. 1-minute load average before: {load_before} "
        "(the 2 cores are shared with other jobs; absolute times are noisy, compare shares and ratios)."
    )
    payload = {
        "config": vars(args),
        "cpu_calibration": peaks,
        "rows": [{k: v for k, v in r.items() if k != "report"} for r in rows],
        "overhead": overhead,
        "wall_s": wall,
        "load_avg_before": load_before,
    }
    fig = plot_sweep(rows)
    write_results(name, payload, md, fig)
    print(md)


if __name__ == "__main__":
    main()
