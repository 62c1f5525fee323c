"""Character-level GPT on tiny Shakespeare on the CPU: validation loss against steps and wall time, tokens/s.

nanoGPT's small CPU configuration (4 layers, 4 heads, width 128, context 64, batch 12, lr 1e-3 cosine to 1e-4,
2000 steps) reaches about 1.88 nats; the target here is < 2.0 nats within a 10-minute CPU run. A second table
compares the three attention implementations' training throughput on the same model.

    python -m benchmarks.gpt_char_cpu            # full run (about 5-10 minutes on 2 cores)
    python -m benchmarks.gpt_char_cpu --quick    # smoke test
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything

from benchmarks._common import SHARED_DATA, markdown_table, write_results
from benchmarks.tools.step_timer import StepTimer
from lightning_sdp.datamodules.text import CharTextDataModule
from lightning_sdp.models.gpt import GPT


class _Recorder(StepTimer):
    """Step times (:class:`StepTimer`), trained tokens, the validation curve, and a stop after ``budget_s``."""

    def __init__(self, budget_s: float) -> None:
        super().__init__()
        self.budget_s = budget_s
        self.curve: list[dict[str, float]] = []
        self.start = 0.0
        self.tokens = 0

    @property
    def train_time(self) -> float:
        """Seconds spent inside training batches (validation and data loading between batches excluded)."""
        return sum(self.durations())

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.tokens += batch[0].numel()
        if time.perf_counter() - self.start > self.budget_s:
            trainer.should_stop = True

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        self.curve.append(
            {
                "step": trainer.global_step,
                "val_loss": float(trainer.callback_metrics["val/loss"]),
                "wall_s": round(time.perf_counter() - self.start, 1),
            }
        )


MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128}
"""nanoGPT's small CPU configuration."""
QUICK_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 64}
"""``--quick``: a smaller GPT, so the smoke run stays under a minute on a busy machine."""


def _train(
    path: str | None,
    steps: int,
    attention: str,
    eval_every: int,
    budget_s: float,
    val_batches: int | float,
    dims: dict[str, int],
):
    seed_everything(1337)
    data = CharTextDataModule(path, block_size=64, batch_size=12)
    model = GPT(
        **dims,
        block_size=64,
        dropout=0.0,
        attention=attention,
        learning_rate=1e-3,
        warmup_steps=min(100, steps),
        min_lr_ratio=0.1,
        max_steps=steps,
    )
    rec = _Recorder(budget_s)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        val_check_interval=eval_every,
        check_val_every_n_epoch=None,
        limit_val_batches=val_batches,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rec],
    )
    trainer.fit(model, datamodule=data)
    return rec, model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(SHARED_DATA / "tinyshakespeare" / "input.txt"))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--budget-minutes", type=float, default=10.0)
    parser.add_argument("--throughput-steps", type=int, default=150)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    path = args.data if Path(args.data).exists() else None
    if path is None:
        print(f"{args.data} not found: using the built-in corpus")
    steps, tp_steps, eval_every, val_batches, dims = args.steps, args.throughput_steps, 250, 1.0, MODEL
    if args.quick:
        steps, tp_steps, eval_every, val_batches, dims = 20, 8, 10, 4, QUICK_MODEL

    rec, _ = _train(path, steps, "sdpa", eval_every, args.budget_minutes * 60, val_batches, dims)
    final = rec.curve[-1]
    rows = [dict(r) for r in rec.curve]
    tokens_per_s = rec.tokens / rec.train_time

    _write(args, path, rows, final, tokens_per_s, [], steps, dims)
    tp_rows = []
    for attention in ("sdpa", "explicit", "linear"):
        r, _ = _train(path, tp_steps, attention, tp_steps, 1e9, 2, dims)
        tp_rows.append({"attention": attention, "train_tokens_per_s": round(r.tokens / r.train_time)})
    base = tp_rows[0]["train_tokens_per_s"]
    for r in tp_rows:
        r["vs_sdpa"] = round(r["train_tokens_per_s"] / base, 2)

    _write(args, path, rows, final, tokens_per_s, tp_rows, steps, dims)


def _write(args, path, rows, final, tokens_per_s, tp_rows, steps, dims) -> None:
    shape = f"{dims['n_layer']} layers x {dims['n_head']} heads x {dims['n_embd']}"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    label = f"GPT {dims['n_layer']}x{dims['n_embd']}, sdpa"
    ax.plot([r["step"] for r in rows], [r["val_loss"] for r in rows], marker="o", label=label)
    ax.axhline(2.0, color="grey", ls="--", label="target 2.0")
    ax.axhline(1.88, color="green", ls=":", label="nanoGPT CPU config ~1.88")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title(f"char GPT, {'tiny Shakespeare' if path else 'built-in corpus'}, CPU")
    ax.legend()
    md = (
        f"Data: {'tiny Shakespeare' if path else 'built-in corpus'}; GPT {shape}, context 64, "
        f"batch 12, AdamW 1e-3 cosine to 1e-4, {torch.get_num_threads()} torch threads.\n\n"
        f"Final validation loss **{final['val_loss']:.3f}** nats at step {final['step']} after {final['wall_s']} s "
        f"(target < 2.0 within 600 s); training throughput {tokens_per_s:,.0f} tokens/s.\n\n"
        + markdown_table(rows, ["step", "val_loss", "wall_s"])
        + (
            "\n\nAttention implementations, training throughput on the same model:\n\n"
            + markdown_table(tp_rows, ["attention", "train_tokens_per_s", "vs_sdpa"])
            if tp_rows
            else ""
        )
    )
    write_results(
        "gpt_char_cpu" + ("_quick" if args.quick else ""),
        {
            "data": path or "builtin",
            "curve": rows,
            "final": final,
            "train_tokens_per_s": tokens_per_s,
            "attention_throughput": tp_rows,
            "steps": steps,
            "model": dims,
        },
        md,
        fig,
    )
    print(md)


if __name__ == "__main__":
    main()
