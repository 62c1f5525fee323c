"""Demo part ``gpt``: the character-level GPT on the built-in corpus."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def run(out: Path, quick: bool) -> dict[str, Any]:
    """Train the character-level GPT on the built-in corpus; report validation loss and throughput."""
    import torch
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.loggers import CSVLogger

    from lightning_sdp.datamodules.text import CharTextDataModule
    from lightning_sdp.models.gpt import GPT

    seed_everything(1337, workers=True)
    steps = 40 if quick else 300
    data = CharTextDataModule(block_size=64, batch_size=16)
    model = GPT(n_layer=4, n_head=4, n_embd=128, block_size=64, warmup_steps=min(100, steps // 5), max_steps=steps)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        val_check_interval=min(100, steps),
        limit_val_batches=20,
        check_val_every_n_epoch=None,
        logger=CSVLogger(out, name="gpt", version=""),
        default_root_dir=out,
        enable_checkpointing=True,
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    elapsed = time.perf_counter() - start
    val = trainer.callback_metrics.get("val/loss")
    ckpt = out / "gpt" / "gpt.ckpt"
    trainer.save_checkpoint(ckpt)
    prompt = data.encode("The ").unsqueeze(0)
    sample = data.decode(model.generate(prompt, 120, temperature=0.8, top_k=20)[0])
    png = _plot_gpt_curve(out / "gpt" / "metrics.csv", out / "gpt.png")
    return {
        "headline": f"val loss {float(val) if val is not None else float('nan'):.3f} nats after {steps} steps "
        f"({steps * 16 * 64 / elapsed:,.0f} tokens/s incl. validation)",
        "val_loss": float(val) if val is not None else None,
        "steps": steps,
        "seconds": round(elapsed, 1),
        "checkpoint": str(ckpt),
        "metrics": str(out / "gpt" / "metrics.csv"),
        "sample": sample,
        "threads": torch.get_num_threads(),
        "png": str(png) if png else None,
    }


def _plot_gpt_curve(csv_path: Path, png: Path) -> Path | None:
    """Training and validation loss against the step, from the CSVLogger's file."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not csv_path.exists():
        return None
    train, val = [], []
    with csv_path.open() as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            if row.get("train/loss"):
                train.append((step, float(row["train/loss"])))
            if row.get("val/loss"):
                val.append((step, float(row["val/loss"])))
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    if train:
        ax.plot(*zip(*train, strict=True), label="train/loss")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="val/loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title("Character GPT on the built-in corpus", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
