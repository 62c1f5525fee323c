"""Demo part ``sdp4bit``: SDP4Bit vs plain sharded data parallelism on a small GPT, gloo processes on the CPU."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lightning_sdp.demo.common import bar_plot, trainer_kwargs


def _sdp4bit_fit(compress: bool, devices: int, intra: int, steps: int) -> dict[str, float]:
    from lightning.pytorch import Trainer, seed_everything

    from lightning_sdp import SDP4BitStrategy
    from lightning_sdp.datamodules.text import CharTextDataModule
    from lightning_sdp.models.gpt import GPT

    seed_everything(1337, workers=True)
    data = CharTextDataModule(block_size=64, batch_size=8)
    model = GPT(n_layer=2, n_head=4, n_embd=64, block_size=64, learning_rate=3e-3, warmup_steps=5, max_steps=steps)
    strategy = SDP4BitStrategy(
        weight_compression="qwd" if compress else "none",
        gradient_compression="tlq_hs" if compress else "none",
        intra_node_size=intra,
        weight_group_size=512,
        start_method="forkserver",  # the ranks fork from a server that imported torch and Lightning once
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=0,
        **trainer_kwargs(),
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("sdp4bit/", "train/"))}
    metrics["wall_s"] = time.perf_counter() - start
    return metrics


def run(out: Path, quick: bool) -> dict[str, Any]:
    """SDP4Bit vs plain sharded data parallelism: same GPT, same steps, gloo processes on the CPU."""
    devices, intra = (2, 1) if quick else (4, 2)
    steps = 4 if quick else 30
    layout = f"{devices // intra} nodes x {intra}"
    print(f"Training a small GPT on {devices} CPU processes ({layout}), {steps} steps, without then with 4-bit")
    base = _sdp4bit_fit(False, devices, intra, steps)
    q = _sdp4bit_fit(True, devices, intra, steps)
    b0, b1 = base["sdp4bit/bytes_per_step"], q["sdp4bit/bytes_per_step"]
    png = bar_plot(
        out / "sdp4bit.png",
        ["uncompressed (fp32)", "SDP4Bit (qWD + TLq-HS)"],
        [b0 / 1e3, b1 / 1e3],
        "kB sent per step per rank",
        f"SDP4Bit, GPT on {devices} gloo processes ({layout})",
    )
    return {
        "headline": f"{b1 / 1e3:,.0f} kB sent per step per rank vs {b0 / 1e3:,.0f} kB uncompressed "
        f"({b0 / b1:.1f}x less); train loss {q.get('train/loss', float('nan')):.3f} vs "
        f"{base.get('train/loss', float('nan')):.3f} after {steps} steps",
        "note": "Bytes this rank sends per step in the weight all-gather and gradient reduce-scatter. Longer "
        "runs (benchmarks/results/sdp4bit_convergence.md) compare the validation loss with uncompressed training.",
        "bytes_per_step_uncompressed": b0,
        "bytes_per_step_sdp4bit": b1,
        "reduction": b0 / b1,
        "weight_bits_per_element": q.get("sdp4bit/weight_bits_per_element"),
        "grad_bits_per_element_intra": q.get("sdp4bit/grad_bits_per_element_intra"),
        "grad_bits_per_element_inter": q.get("sdp4bit/grad_bits_per_element_inter"),
        "train_loss_uncompressed": base.get("train/loss"),
        "train_loss_sdp4bit": q.get("train/loss"),
        "processes": devices,
        "steps": steps,
        "png": str(png),
    }
