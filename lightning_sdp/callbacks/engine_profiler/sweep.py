"""The long-sequence study of the Gaudi paper as a tool: profile a model at growing sequence lengths.

``sequence_length_sweep`` trains a few steps at each sequence length and attention implementation under
:class:`~lightning_sdp.callbacks.EngineProfiler` and returns one row per point: matrix / vector / attention shares,
achieved TFLOPS, and the analytic model's prediction for the current device next to them. The command line::

    python -m lightning_sdp.callbacks.engine_profiler.sweep --seq-lens 64 128 256 512 \\
        --attention explicit sdpa linear --out sweep/

(also ``lightning-sdp sequence-sweep ...``) writes ``sweep.json``, ``sweep.md`` and ``sweep.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_sdp._files import write_text_atomic
from lightning_sdp.callbacks.engine_profiler.callback import EngineProfiler
from lightning_sdp.models.gpt import GPT
from lightning_sdp.profiling.peaks import calibrate_cpu
from lightning_sdp.profiling.results import EngineReport

ModelFactory = Callable[[str, int], LightningModule]

ROW_COLUMNS = [
    "attention",
    "seq_len",
    "step_ms",
    "matrix",
    "attention_fused",
    "vector",
    "memory",
    "host_other",
    "attn_module",
    "matrix_tflops",
    "total_tflops",
    "pred_attn_share",
    "pred_vector_share",
]


def gpt_factory(
    vocab_size: int = 65, n_layer: int = 2, n_head: int = 4, n_embd: int = 128, dropout: float = 0.0
) -> ModelFactory:
    """A ``(attention, seq_len) -> GPT`` factory for :func:`sequence_length_sweep`."""

    def make(attention: str, seq_len: int) -> LightningModule:
        return GPT(
            vocab_size=vocab_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            block_size=seq_len,
            dropout=dropout,
            attention=attention,  # type: ignore[arg-type]
            warmup_steps=1,
        )

    return make


def sequence_length_sweep(
    model_factory: ModelFactory | None = None,
    seq_lens: Sequence[int] = (64, 128, 256, 512, 1024, 2048),
    batch_size: int = 4,
    attentions: Sequence[str] = ("explicit", "sdpa", "linear"),
    steps: int = 2,
    wait: int = 1,
    warmup: int = 1,
    vocab_size: int = 65,
    accelerator: str = "auto",
    precision: str = "32-true",
    peaks: dict[str, float] | None = None,
    calibrate: bool = True,
    softmax_k: float = 6.0,
    dirpath: str | None = None,
    seed: int = 0,
    verbose: bool = True,
) -> list[dict[str, Any]]:
    """Profile ``steps`` training steps at every (attention, sequence length) point.

    Args:
        model_factory: ``(attention, seq_len) -> LightningModule`` taking ``(x, y)`` token batches of shape
            ``(batch_size, seq_len)``; default a 2-layer, 128-wide GPT (:func:`gpt_factory`).
        seq_lens: sequence lengths to profile (positive, increasing order is not required).
        batch_size: sequences per step.
        attentions: attention implementations passed to the factory (GPT: ``explicit``, ``sdpa``, ``linear``).
        steps: profiled (active) steps per point.
        wait: untimed steps before the warm-up step.
        warmup: warm-up steps; the last counts FLOPs (keep >= 1 for TFLOPS).
        vocab_size: token range of the random batches (must match the factory's model).
        accelerator: Lightning accelerator (``"auto"``, ``"cpu"``, ``"cuda"``, ``"hpu"``).
        precision: Lightning precision (``"bf16-mixed"`` on GPUs/Gaudi for tensor-core work).
        peaks: device peaks (``matrix_tflops``, ``vector_tflops``, ``mem_gbps``); on the CPU they are measured
            with :func:`~lightning_sdp.profiling.peaks.calibrate_cpu` when ``None`` and ``calibrate`` is true.
        calibrate: measure CPU peaks when none are given.
        softmax_k: element operations per attention score in the analytic model.
        dirpath: where the per-point EngineProfiler reports go (a temporary folder when ``None``).
        seed: seed of the random batches.
        verbose: print one line per point.

    Returns:
        One row per point with :data:`ROW_COLUMNS` plus the full report under ``"report"``.
    """
    if not seq_lens or any(int(n) <= 0 for n in seq_lens):
        raise ValueError(f"seq_lens must be positive integers, got {list(seq_lens)}")
    if batch_size <= 0 or steps <= 0:
        raise ValueError("batch_size and steps must be positive")
    if not attentions:
        raise ValueError("give at least one attention implementation")
    factory = model_factory or gpt_factory(vocab_size=vocab_size)
    if peaks is None and calibrate and _resolved_accelerator(accelerator) == "cpu":
        peaks = calibrate_cpu()
        if verbose:
            print(
                f"calibrated CPU peaks: matrix {peaks['matrix_tflops'] * 1e3:.1f} GFLOPS, "
                f"vector {peaks['vector_tflops'] * 1e3:.2f} Gelem/s"
            )
    out = Path(dirpath) if dirpath else Path(tempfile.mkdtemp(prefix="engine_sweep_"))
    rows: list[dict[str, Any]] = []
    n_steps = wait + warmup + steps
    for attention in attentions:
        for seq_len in seq_lens:
            g = torch.Generator().manual_seed(seed)
            x = torch.randint(0, vocab_size, (n_steps * batch_size, int(seq_len) + 1), generator=g)
            loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=batch_size)
            model = factory(attention, int(seq_len))
            cb = EngineProfiler(
                wait=wait,
                warmup=warmup,
                active=steps,
                dirpath=str(out / f"{attention}-{seq_len}"),
                export_trace=False,
                save_plot=False,
                print_summary=False,
                log_metrics=False,
                peaks=peaks,
                measure_peaks=peaks is None,  # calibrated peaks given: no second measurement
                softmax_k=softmax_k,
            )
            trainer = Trainer(
                accelerator=accelerator,
                devices=1,
                precision=precision,  # type: ignore[arg-type]
                max_steps=n_steps,
                callbacks=[cb],
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                limit_val_batches=0,
            )
            t0 = time.perf_counter()
            trainer.fit(model, loader)
            if not cb.reports:
                raise RuntimeError(f"no profiling report for attention={attention}, seq_len={seq_len}")
            row = sweep_row(cb.reports[-1], attention, int(seq_len))
            rows.append(row)
            if verbose:
                print(
                    f"{attention:>8} n={seq_len:>5}: {row['step_ms']:9.1f} ms/step, matrix {row['matrix']:.0%}, "
                    f"fused {row['attention_fused']:.0%}, vector {row['vector']:.0%}, attention module "
                    f"{row['attn_module']:.0%} ({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
    return rows


def _resolved_accelerator(accelerator: str) -> str:
    if accelerator != "auto":
        return accelerator
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def sweep_row(report: EngineReport, attention: str, seq_len: int) -> dict[str, Any]:
    """One table row from an EngineProfiler report (the report itself under ``"report"``)."""
    fr = report.fractions
    analytic = report.analytic
    pred = (analytic.predicted_at_seq_len if analytic is not None else None) or {}
    attention_module = report.modules.get("attention")
    return {
        "attention": attention,
        "seq_len": seq_len,
        "step_ms": report.step_time_s * 1e3,
        "matrix": fr["matrix"],
        "attention_fused": fr["attention_fused"],
        "vector": fr["vector"],
        "memory": fr["memory"],
        "host_other": fr["host_other"],
        "attn_module": attention_module.frac if attention_module is not None else 0.0,
        "matrix_tflops": report.throughput["matrix_tflops"],
        "total_tflops": report.throughput["total_tflops"],
        "pred_attn_share": pred.get("attention_share"),
        "pred_vector_share": pred.get("vector_share"),
        "crossover_seq_len": analytic.crossover_seq_len if analytic is not None else None,
        "findings": [f.check for f in report.findings],
        "report": report,
    }


def _flops_cell(tflops: float) -> str:
    """A rate in the unit that keeps it readable: TFLOP/s on accelerators, GFLOP/s on a CPU."""
    return f"{tflops:.1f} TFLOP/s" if tflops >= 1.0 else f"{tflops * 1e3:.2f} GFLOP/s"


def sweep_markdown(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the sweep rows (shares as percentages)."""
    head = "| " + " | ".join(ROW_COLUMNS) + " |\n|" + "---|" * len(ROW_COLUMNS) + "\n"
    lines = []
    for r in rows:
        cells = []
        for c in ROW_COLUMNS:
            v = r.get(c)
            if v is None:
                cells.append("n/a")
            elif c in (
                "matrix",
                "attention_fused",
                "vector",
                "memory",
                "host_other",
                "attn_module",
            ) or c.startswith("pred_"):
                cells.append(f"{v:.1%}")
            elif c == "step_ms":
                cells.append(f"{v:.1f}")
            elif c.endswith("tflops"):
                cells.append(_flops_cell(v))
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines)


def plot_sweep(rows: list[dict[str, Any]], path: str | Path | None = None) -> Any:
    """Figure: shares against sequence length per attention kind (with the analytic prediction) and TFLOPS.

    Returns the matplotlib figure (saved to ``path`` and closed when a path is given).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["attention"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds) + 1, figsize=(4.2 * (len(kinds) + 1), 4), squeeze=False)
    colors = {
        "matrix": "#1f77b4",
        "attention_fused": "#9467bd",
        "vector": "#ff7f0e",
        "memory": "#2ca02c",
        "host_other": "#7f7f7f",
    }
    for ax, kind in zip(axes[0], kinds, strict=False):
        rs = sorted((r for r in rows if r["attention"] == kind), key=lambda r: r["seq_len"])
        n = [r["seq_len"] for r in rs]
        bottom = [0.0] * len(rs)
        for c, col in colors.items():
            vals = [r[c] for r in rs]
            ax.fill_between(
                n,
                bottom,
                [b + v for b, v in zip(bottom, vals, strict=True)],
                color=col,
                alpha=0.8,
                label=c,
                step=None,
            )
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.plot(n, [r["attn_module"] for r in rs], "k-o", ms=3, label="attention module (measured)")
        if any(r["pred_attn_share"] is not None for r in rs):
            ax.plot(n, [r["pred_attn_share"] for r in rs], "k--", label="attention (analytic)")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1)
        ax.set_title(f"{kind} attention")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("share of step time")
    axes[0][0].legend(fontsize=7, loc="upper left")
    ax = axes[0][-1]
    for kind in kinds:
        rs = sorted((r for r in rows if r["attention"] == kind), key=lambda r: r["seq_len"])
        ax.plot([r["seq_len"] for r in rs], [(r["total_tflops"] or 0) * 1e3 for r in rs], "-o", ms=3, label=kind)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("achieved GFLOP/s (all matrix FLOPs / step time)")
    ax.set_title("throughput")
    ax.legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig


def add_sweep_arguments(p: argparse.ArgumentParser, seq_lens: Sequence[int], steps: int) -> None:
    """Add the sweep's shared options (sequence lengths, attention kinds, GPT size, steps) to a parser.

    Args:
        p: the parser to extend.
        seq_lens: default ``--seq-lens``.
        steps: default ``--steps`` (profiled steps per sweep point).
    """
    p.add_argument("--seq-lens", type=int, nargs="+", default=list(seq_lens))
    kinds = ["explicit", "sdpa", "linear"]
    p.add_argument("--attention", nargs="+", default=kinds, choices=kinds)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--steps", type=int, default=steps, help="profiled steps per sweep point")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line of the sweep; writes ``sweep.json``, ``sweep.md`` and ``sweep.png`` to ``--out``."""
    p = argparse.ArgumentParser(
        prog="lightning-sdp sequence-sweep",
        description="EngineProfiler sequence-length study of a small GPT (matrix vs vector engine shares).",
    )
    add_sweep_arguments(p, seq_lens=[64, 128, 256, 512, 1024], steps=2)
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--no-calibrate", action="store_true", help="do not measure CPU peaks")
    p.add_argument("--out", default="engine_sweep", help="output folder")
    args = p.parse_args(list(argv) if argv is not None else None)
    out = Path(args.out)
    rows = sequence_length_sweep(
        gpt_factory(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd),
        seq_lens=args.seq_lens,
        batch_size=args.batch_size,
        attentions=args.attention,
        steps=args.steps,
        accelerator=args.accelerator,
        precision=args.precision,
        calibrate=not args.no_calibrate,
        dirpath=str(out / "reports"),
    )
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(
        out / "sweep.json", json.dumps([{k: v for k, v in r.items() if k != "report"} for r in rows], indent=1) + "\n"
    )
    md = sweep_markdown(rows)
    write_text_atomic(out / "sweep.md", md + "\n")
    plot_sweep(rows, out / "sweep.png")
    print(md)
    print(f"wrote {out / 'sweep.json'}, {out / 'sweep.md'}, {out / 'sweep.png'}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
