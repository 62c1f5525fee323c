"""Demo part ``fastclip``: FastCLIP-v3 vs the OpenCLIP loss on a tiny CLIP at a small batch."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lightning_sdp.demo.common import bar_plot, trainer_kwargs


def run(out: Path, quick: bool) -> dict[str, Any]:
    """FastCLIP-v3 vs the OpenCLIP loss, same small CLIP, same data order, batch 16, zero-shot accuracy."""
    import lightning.pytorch as pl

    from lightning_sdp.callbacks import GammaScheduler, TemperatureScheduler, ZeroShotEvaluation
    from lightning_sdp.datamodules import ImageTextDataModule
    from lightning_sdp.integrations.open_clip import NANO_CONFIG  # a CLIP small enough for 2 CPU cores
    from lightning_sdp.models import FastCLIPModule

    batch, epochs = 16, (1 if quick else 4)
    num_train, num_val = (64, 64) if quick else (640, 200)
    dm = ImageTextDataModule(
        dataset="shapes",
        model=NANO_CONFIG,
        batch_size=batch,
        val_batch_size=256,
        num_train=num_train,
        num_val=num_val,
        seed=0,
        augment=False,
    )
    dm.setup("fit")
    results: dict[str, dict[str, float]] = {}
    for loss in ("openclip", "fastclip_v3"):
        print(f"FastCLIP part: {loss} loss, batch {batch}, {epochs} epoch(s) on {num_train} captioned shapes")
        pl.seed_everything(0, verbose=False)
        steps = epochs * (num_train // batch)
        module = FastCLIPModule(
            model=NANO_CONFIG,
            loss=loss,
            lr=2e-3,
            weight_decay=0.1,
            warmup_steps=max(1, steps // 20),
            max_steps=steps,
            temperature=0.07,
            lr_tau=4e-4 if loss == "fastclip_v3" else None,
            rho=6.5 if loss == "fastclip_v3" else None,
        )
        zs = ZeroShotEvaluation()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=epochs,
            check_val_every_n_epoch=epochs,
            callbacks=[GammaScheduler(gamma_min=0.8, decay_epochs=max(1, epochs // 2)), TemperatureScheduler(), zs],
            **trainer_kwargs(),
        )
        start = time.perf_counter()
        trainer.fit(module, dm)
        m = zs.metrics
        results[loss] = {
            "zeroshot_top1": 100 * float(m["val/zeroshot_top1"]),  # ZeroShotEvaluation reports fractions
            "retrieval_r1": 100 * float(m["val/i2t_r1"] + m["val/t2i_r1"]) / 2,
            "final_tau": float(module.temperature),
            "wall_s": time.perf_counter() - start,
        }
    o, f = results["openclip"], results["fastclip_v3"]
    png = bar_plot(
        out / "fastclip.png",
        ["OpenCLIP loss", "FastCLIP-v3"],
        [o["zeroshot_top1"], f["zeroshot_top1"]],
        "zero-shot top-1 (%)",
        f"Same CLIP, batch {batch}, {epochs} epoch(s), {num_val} held-out pairs",
    )
    return {
        "headline": f"zero-shot top-1 {f['zeroshot_top1']:.1f}% (FastCLIP-v3) vs {o['zeroshot_top1']:.1f}% (OpenCLIP "
        f"loss) at batch {batch}, {epochs} epoch(s), one seed",
        "note": "One seed and a few short epochs on a tiny CLIP: differences of a few points are within seed noise. "
        "The 3-seed comparisons are benchmarks/results/fastclip_small_batch_10k.md and fastclip_many_visits.md.",
        "openclip": o,
        "fastclip_v3": f,
        "batch": batch,
        "epochs": epochs,
        "png": str(png),
    }
