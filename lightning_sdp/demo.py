"""``lightning-sdp demo``: the main job on built-in data, with progress bars, ending in a short report.

Runs offline on a fresh CPU machine. Each part writes into ``<out>/<part>/`` and the demo writes
``<out>/index.md`` with the headline numbers.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _run_gpt(out: Path, quick: bool) -> dict[str, Any]:
    """Train the character-level GPT on the built-in corpus; report validation loss and throughput."""
    import torch
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.loggers import CSVLogger

    from lightning_sdp.datamodules.text import CharTextDataModule
    from lightning_sdp.models.gpt import GPT

    seed_everything(1337, workers=True)
    steps = 40 if quick else 600
    data = CharTextDataModule(block_size=64, batch_size=16)
    model = GPT(n_layer=4, n_head=4, n_embd=128, block_size=64, warmup_steps=min(100, steps // 5), max_steps=steps)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        val_check_interval=min(200, steps),
        limit_val_batches=20,
        check_val_every_n_epoch=None,
        logger=CSVLogger(out, name="gpt", version=""),
        default_root_dir=out,
        enable_checkpointing=True,
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
    return {
        "headline": f"val loss {float(val):.3f} nats after {steps} steps "
        f"({steps * 16 * 64 / elapsed:,.0f} tokens/s incl. validation)",
        "val_loss": float(val) if val is not None else None,
        "steps": steps,
        "seconds": round(elapsed, 1),
        "checkpoint": str(ckpt),
        "metrics": str(out / "gpt" / "metrics.csv"),
        "sample": sample,
        "threads": torch.get_num_threads(),
    }


PARTS: dict[str, Callable[[Path, bool], dict[str, Any]]] = {"gpt": _run_gpt}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-sdp demo", description=__doc__)
    parser.add_argument("--only", choices=sorted(PARTS), action="append", help="run only this part (repeatable)")
    parser.add_argument("--out", default="demo_report", help="report folder (default: demo_report)")
    parser.add_argument("--quick", action="store_true", help="a few steps of each part (smoke test)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.only or list(PARTS):
        print(f"\n=== lightning-sdp demo: {name} ===")
        results[name] = PARTS[name](out / name, args.quick)
    lines = ["# lightning-sdp demo report", "", "| part | headline | details |", "|---|---|---|"]
    for name, res in results.items():
        details = ", ".join(f"{k}: {v}" for k, v in res.items() if k in ("checkpoint", "metrics", "seconds"))
        lines.append(f"| {name} | {res['headline']} | {details} |")
    if "gpt" in results:
        lines += ["", "GPT sample:", "", "```", results["gpt"]["sample"], "```"]
    index = out / "index.md"
    index.write_text("\n".join(lines) + "\n")
    print("\n=== summary ===")
    for name, res in results.items():
        print(f"{name}: {res['headline']}")
    print(f"report: {index.resolve()}")
    return 0
