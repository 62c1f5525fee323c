"""Demo part ``profiler``: EngineProfiler's matrix vs vector engine shares on the GPT."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_sdp.demo.common import trainer_kwargs


def run(out: Path, quick: bool) -> dict[str, Any]:
    """EngineProfiler on the GPT: matrix-engine vs vector-engine time for explicit attention at a long sequence."""
    from lightning.pytorch import Trainer, seed_everything

    from lightning_sdp.callbacks import EngineProfiler
    from lightning_sdp.datamodules.text import CharTextDataModule
    from lightning_sdp.models.gpt import GPT

    seed_everything(1337, workers=True)
    block = 128 if quick else 256
    data = CharTextDataModule(block_size=block, batch_size=4)
    model = GPT(n_layer=2, n_head=4, n_embd=128, block_size=block, attention="explicit", max_steps=8)
    profiler = EngineProfiler(wait=1, warmup=1, active=2 if quick else 3, dirpath=str(out), print_summary=False)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=5 if quick else 6, limit_val_batches=0, callbacks=[profiler],
        **trainer_kwargs(),
    )  # fmt: skip
    print(f"Profiler part: GPT (2 layers, width 128, explicit attention), sequence {block}, batch 4")
    trainer.fit(model, datamodule=data)
    report = profiler.reports[-1]
    fr = report.fractions
    png = out / "engine_profile.png"
    matrix = fr.get("matrix", 0.0)
    vector = fr.get("vector", 0.0)
    modules = {k: float(v.frac) for k, v in report.modules.items()}
    top = sorted(modules.items(), key=lambda kv: -kv[1])[:3]
    return {
        "headline": f"matrix engine {matrix:.0%} of the step, vector engines {vector:.0%}, memory "
        f"{fr.get('memory', 0.0):.0%}, host {fr.get('host_other', 0.0):.0%}"
        f"; attention blocks {modules.get('attention', 0.0):.0%} ({report.step_time_s * 1e3:.0f} ms/step, "
        f"sequence {block})",
        "fractions": {k: float(v) for k, v in fr.items()},
        "step_time_s": float(report.step_time_s),
        "top_modules": dict(top),
        "findings": report.to_dict()["findings"],  # the JSON form of the findings
        "report_json": str(out / "engine_profile-summary.json"),
        "png": str(png) if png.exists() else None,
    }
