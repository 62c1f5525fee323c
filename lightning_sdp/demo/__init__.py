"""``lightning-sdp demo``: a short tour of the five plugins and the GPT on built-in data, with a report.

Runs offline on a fresh CPU machine (about 5-10 minutes on 2 cores; ``--quick`` takes about a minute). Every part
uses the plugin's public API, compares it with its baseline in the same run, and writes into ``<out>/<part>/``
(a ``result.json`` and one PNG). The demo then writes ``<out>/index.md`` with a table of the headline numbers and
the pictures, and prints a short summary with the report's path.

Parts (``--only PART``, repeatable): ``sdp4bit`` (2-4 gloo processes: bytes per step with and without 4-bit
communication), ``fastclip`` (FastCLIP-v3 vs the OpenCLIP loss at a small batch), ``solar`` (SolarDataModule vs a
plain DataLoader on a generated HDF5 file with emulated shared storage), ``heat`` (fused vs plain-PyTorch SimpleX
throughput), ``profiler`` (EngineProfiler's report on the GPT) and ``gpt`` (the character-level GPT).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# A CLIP small enough for 2 CPU cores: ViT with 8 px patches on 32 px images, 1-layer towers.
_CLIP_MODEL: dict[str, Any] = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 48, "head_width": 24, "mlp_ratio": 2.0, "patch_size": 8},
    "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 16, "heads": 1, "layers": 1, "mlp_ratio": 2.0},
}


def _quiet_lightning() -> None:
    """Keep Lightning's info lines (GPU available, model summary) out of the tour's output."""
    import logging
    import warnings

    import lightning.pytorch  # noqa: F401  (sets its loggers' levels on import; override them after)

    for name in ("lightning.pytorch", "lightning.fabric", "lightning_sdp"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=r".*barebones.*")


def _bar_plot(path: Path, labels: list[str], values: list[float], ylabel: str, title: str) -> Path:
    """One bar chart with the values written on the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    bars = ax.bar(labels, values, color=["#9e9e9e", "#1f77b4", "#ff7f0e", "#2ca02c"][: len(values)])
    for bar, value in zip(bars, values, strict=True):
        ax.annotate(f"{value:,.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _trainer_kwargs(quick: bool) -> dict[str, Any]:
    return dict(
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        enable_progress_bar=True,
    )


# ---------------------------------------------------------------------------------------------------- sdp4bit
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
        start_method="spawn",
    )
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, limit_val_batches=0,
        **_trainer_kwargs(False),
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("sdp4bit/", "train/"))}
    metrics["wall_s"] = time.perf_counter() - start
    return metrics


def _run_sdp4bit(out: Path, quick: bool) -> dict[str, Any]:
    """SDP4Bit vs plain sharded data parallelism: same GPT, same steps, gloo processes on the CPU."""
    devices, intra = (2, 1) if quick else (4, 2)
    steps = 4 if quick else 30
    layout = f"{devices // intra} nodes x {intra}"
    print(f"Training a small GPT on {devices} CPU processes ({layout}), {steps} steps, without then with 4-bit")
    base = _sdp4bit_fit(False, devices, intra, steps)
    q = _sdp4bit_fit(True, devices, intra, steps)
    b0, b1 = base["sdp4bit/bytes_per_step"], q["sdp4bit/bytes_per_step"]
    png = _bar_plot(
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
        "runs (benchmarks/results/sdp4bit_convergence*.md) show the loss staying within about 1% of uncompressed.",
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


# ---------------------------------------------------------------------------------------------------- fastclip
def _run_fastclip(out: Path, quick: bool) -> dict[str, Any]:
    """FastCLIP-v3 vs the OpenCLIP loss, same small CLIP, same data order, batch 16, zero-shot accuracy."""
    import lightning.pytorch as pl

    from lightning_sdp.callbacks import GammaScheduler, TemperatureScheduler, ZeroShotEvaluation
    from lightning_sdp.datamodules import ImageTextDataModule
    from lightning_sdp.models import FastCLIPModule

    batch, epochs = 16, (1 if quick else 4)
    num_train, num_val = (64, 64) if quick else (640, 200)
    dm = ImageTextDataModule(
        dataset="shapes", model=_CLIP_MODEL, batch_size=batch, val_batch_size=256, num_train=num_train,
        num_val=num_val, seed=0, augment=False,
    )  # fmt: skip
    dm.setup("fit")
    results: dict[str, dict[str, float]] = {}
    for loss in ("openclip", "fastclip_v3"):
        print(f"FastCLIP part: {loss} loss, batch {batch}, {epochs} epoch(s) on {num_train} captioned shapes")
        pl.seed_everything(0, verbose=False)
        steps = epochs * (num_train // batch)
        module = FastCLIPModule(
            model=_CLIP_MODEL, loss=loss, lr=2e-3, weight_decay=0.1, warmup_steps=max(1, steps // 20),
            max_steps=steps, temperature=0.07,
            lr_tau=4e-4 if loss == "fastclip_v3" else None, rho=6.5 if loss == "fastclip_v3" else None,
        )  # fmt: skip
        zs = ZeroShotEvaluation()
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_epochs=epochs, check_val_every_n_epoch=epochs,
            callbacks=[GammaScheduler(gamma_min=0.8, decay_epochs=max(1, epochs // 2)), TemperatureScheduler(), zs],
            **_trainer_kwargs(quick),
        )  # fmt: skip
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
    png = _bar_plot(
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
        "The 3-seed comparison over batch sizes is benchmarks/results/fastclip_small_batch.md.",
        "openclip": o,
        "fastclip_v3": f,
        "batch": batch,
        "epochs": epochs,
        "png": str(png),
    }


# ---------------------------------------------------------------------------------------------------- solar
def _run_solar(out: Path, quick: bool) -> dict[str, Any]:
    """SolarDataModule vs a shuffled torch DataLoader with per-sample h5py reads, on emulated shared storage."""
    import h5py
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Dataset
    from tqdm.auto import tqdm

    from lightning_sdp.datamodules.solar import SolarDataModule, make_ptycho_h5
    from lightning_sdp.datamodules.solar.ptycho import INPUT_KEY, TARGET_KEYS
    from lightning_sdp.datamodules.solar.reader import StorageThrottle, ThrottledFile

    samples, size, epochs, batch = (256, 32, 2, 16) if quick else (1024, 32, 3, 32)
    latency, bandwidth = 1e-3, 200e6  # every read request: 1 ms + bytes / 200 MB/s
    path = out / "ptycho.h5"
    make_ptycho_h5(path, num_samples=samples, size=size, seed=0, overwrite=True)
    keys = [INPUT_KEY, *TARGET_KEYS]
    buffer = samples // 4

    class PerSampleH5(Dataset):
        """What a plain project does: ``__getitem__(i)`` reads row ``i`` of every key with h5py."""

        def __init__(self) -> None:
            self.file: Any = None

        def __len__(self) -> int:
            return samples

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            if self.file is None:
                raw = ThrottledFile(path, StorageThrottle(latency, bandwidth))
                self.file = h5py.File(raw, "r")
            return {k: torch.from_numpy(np.asarray(self.file[k][i])) for k in keys}

    sample_bytes = sum(int(np.prod(s)) * 4 for s in [(size, size)] * len(keys))
    print(f"SOLAR part: {samples} samples ({samples * sample_bytes / 2**20:.0f} MiB) in {path}, buffer {buffer} "
          f"samples (25%), {epochs} epochs, storage emulated as 1 ms + 200 MB/s per request")  # fmt: skip
    base_rates = []
    loader = DataLoader(PerSampleH5(), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    for epoch in range(epochs):
        start = time.perf_counter()
        n = sum(len(b[INPUT_KEY]) for b in tqdm(loader, desc=f"DataLoader epoch {epoch}", leave=False))
        base_rates.append(n / (time.perf_counter() - start))

    dm = SolarDataModule(
        str(path), input_key=INPUT_KEY, target_key=list(TARGET_KEYS), batch_size=batch, buffer_size=buffer,
        num_workers=0, max_epochs=epochs, storage_latency_s=latency, storage_bandwidth=bandwidth,
    )  # fmt: skip
    dm.setup("fit")
    solar_loader = dm.train_dataloader()
    solar_rates, hit_rates, mib = [], [], []
    for epoch in range(epochs):
        solar_loader.set_epoch(epoch)
        n = sum(len(b["input"]) for b in tqdm(solar_loader, desc=f"SOLAR epoch {epoch}", leave=False))
        stats = solar_loader.epoch_stats
        solar_rates.append(n / stats["wall_s"])
        hit_rates.append(stats["hits"] / stats["samples"])
        mib.append(stats["bytes"] / 2**20)
    solar_loader.close()
    later = slice(1, None)
    base_later, solar_later = float(np.mean(base_rates[later])), float(np.mean(solar_rates[later]))
    png = _bar_plot(
        out / "solar.png",
        ["DataLoader + h5py", "SolarDataModule"],
        [base_later, solar_later],
        "samples/s (epochs after the first)",
        f"{samples} samples, buffer 25%, emulated shared storage",
    )
    return {
        "headline": f"{solar_later:,.0f} samples/s vs {base_later:,.0f} with a plain DataLoader "
        f"({solar_later / base_later:.1f}x); buffer hit rate {hit_rates[-1]:.2f} (bound {dm.schedule.bound:.2f}) "
        f"vs 0",
        "note": "Loading only (no model), one rank; every read request costs 1 ms + bytes / 200 MB/s to emulate "
        "shared storage. The buffer holds 25% of the file, so at most 25% of an epoch can come from it.",
        "dataloader_samples_per_s": base_rates,
        "solar_samples_per_s": solar_rates,
        "solar_hit_rate": hit_rates,
        "solar_storage_mib": mib,
        "hit_rate_bound": float(dm.schedule.bound),
        "file": str(path),
        "png": str(png),
    }


# ---------------------------------------------------------------------------------------------------- heat
def _run_heat(out: Path, quick: bool) -> dict[str, Any]:
    """SimpleX on the synthetic interactions: HEAT's fused kernel vs the plain-PyTorch reference."""
    import numpy as np
    from lightning.pytorch import Callback, Trainer

    import lightning_sdp  # noqa: F401  (registers accelerator="heat")
    from lightning_sdp import InteractionsDataModule, SimpleXModule

    class BatchTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.sizes: list[int] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(time.perf_counter() - self._t)
            self.sizes.append(len(batch[0]))

    rates: dict[str, float] = {}
    recall: dict[str, float] = {}
    for backend in ("reference", "fused"):
        batch = 4096 if backend == "fused" else 512
        steps = (3 if quick else 8) if backend == "fused" else (3 if quick else 12)
        print(f"HEAT part: {backend} SimpleX, batch {batch}, {steps} steps on the synthetic interactions")
        dm = InteractionsDataModule(None, batch_size=batch)
        model = SimpleXModule(
            dim=64, g=1.0, margin=0.9, negative_weight=150.0, num_negatives=64, backend=backend,
            lr=0.5 if backend == "fused" else 1e-3,
        )  # fmt: skip
        timer = BatchTimer()
        trainer = Trainer(
            accelerator="heat" if backend == "fused" else "cpu", devices=1, max_steps=steps,
            limit_val_batches=1.0, val_check_interval=steps, check_val_every_n_epoch=None,
            callbacks=[timer], **_trainer_kwargs(quick),
        )  # fmt: skip
        trainer.fit(model, dm)
        # the first batch includes the kernel compilation (numba) and the optimizer's set-up: left out
        t, s = np.array(timer.times[1:]), np.array(timer.sizes[1:])
        rates[backend] = float(s.sum() / t.sum())
        recall[backend] = float(trainer.callback_metrics.get("val/recall@20", float("nan")))
    ratio = rates["fused"] / rates["reference"]
    png = _bar_plot(
        out / "heat.png",
        ["plain PyTorch (batch 512)", "HEAT fused (batch 4096)"],
        [rates["reference"], rates["fused"]],
        "training positives / s",
        "SimpleX, d=64, 64 negatives, synthetic interactions",
    )
    return {
        "headline": f"{rates['fused']:,.0f} positives/s fused vs {rates['reference']:,.0f} with plain PyTorch "
        f"({ratio:.0f}x)",
        "note": "Mean over the steps after the first (which includes numba compilation); the reference "
        "is autograd + Adam at batch 512, the fused kernel trains in place at batch 4096.",
        "positives_per_s": rates,
        "speedup": ratio,
        "val_recall@20_after_few_steps": recall,
        "png": str(png),
    }


# ---------------------------------------------------------------------------------------------------- profiler
def _run_profiler(out: Path, quick: bool) -> dict[str, Any]:
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
        **_trainer_kwargs(quick),
    )  # fmt: skip
    print(f"Profiler part: GPT (2 layers, width 128, explicit attention), sequence {block}, batch 4")
    trainer.fit(model, datamodule=data)
    report = profiler.reports[-1]
    fr = report["fractions"]
    png = out / "engine_profile.png"
    matrix = fr.get("matrix", 0.0)
    vector = fr.get("vector", 0.0)
    modules = {k: float(v["frac"]) for k, v in (report.get("modules") or {}).items()}
    top = sorted(modules.items(), key=lambda kv: -kv[1])[:3]
    return {
        "headline": f"matrix engine {matrix:.0%} of the step, vector engines {vector:.0%}, memory "
        f"{fr.get('memory', 0.0):.0%}, host {fr.get('host_other', 0.0):.0%}"
        f"; attention blocks {modules.get('attention', 0.0):.0%} ({report['step_time_s'] * 1e3:.0f} ms/step, "
        f"sequence {block})",
        "fractions": {k: float(v) for k, v in fr.items()},
        "step_time_s": float(report["step_time_s"]),
        "top_modules": dict(top),
        "findings": report.get("findings", []),
        "report_json": str(out / "engine_profile-summary.json"),
        "png": str(png) if png.exists() else None,
    }


# ---------------------------------------------------------------------------------------------------- gpt
def _run_gpt(out: Path, quick: bool) -> dict[str, Any]:
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
        "headline": f"val loss {float(val):.3f} nats after {steps} steps "
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


PARTS: dict[str, Callable[[Path, bool], dict[str, Any]]] = {
    "sdp4bit": _run_sdp4bit,
    "fastclip": _run_fastclip,
    "solar": _run_solar,
    "heat": _run_heat,
    "profiler": _run_profiler,
    "gpt": _run_gpt,
}

_TITLES = {
    "sdp4bit": "SDP4Bit: 4-bit communication for sharded data parallelism",
    "fastclip": "FastCLIP: CLIP training at a small batch",
    "solar": "SOLAR: schedule-aware HDF5 loading",
    "heat": "HEAT: fused CPU training of SimpleX",
    "profiler": "EngineProfiler: matrix vs vector engine time",
    "gpt": "The character-level GPT",
}


def _write_index(out: Path, results: dict[str, dict[str, Any]], quick: bool) -> Path:
    lines = [
        "# lightning-sdp demo report",
        "",
        f"{'Quick smoke run (`--quick`): numbers are from a few steps only.' if quick else 'Short runs on built-in data; the benchmarks in `benchmarks/results/` are the longer measurements.'}",
        "",
        "| part | headline | seconds |",
        "|---|---|---|",
    ]
    for name, res in results.items():
        lines.append(f"| {name} | {res['headline']} | {res.get('wall_s', res.get('seconds', ''))} |")
    for name, res in results.items():
        lines += ["", f"## {_TITLES.get(name, name)}", "", res["headline"], ""]
        if res.get("note"):
            lines += [res["note"], ""]
        if res.get("error"):
            lines += ["```", res["error"], "```", ""]
        if res.get("png"):
            rel = Path(res["png"]).resolve().relative_to(out.resolve())
            lines += [f"![{name}]({rel.as_posix()})", ""]
        lines.append(f"Details: [`{name}/result.json`]({name}/result.json)")
    if "gpt" in results and results["gpt"].get("sample"):
        lines += ["", "GPT sample:", "", "```", results["gpt"]["sample"], "```"]
    index = out / "index.md"
    index.write_text("\n".join(lines) + "\n")
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-sdp demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=list(PARTS), action="append", help="run only this part (repeatable)")
    parser.add_argument("--out", default="demo_report", help="report folder (default: demo_report)")
    parser.add_argument("--quick", action="store_true", help="a few steps of each part (smoke test, ~1 minute)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _quiet_lightning()
    names = list(dict.fromkeys(args.only)) if args.only else list(PARTS)
    results: dict[str, dict[str, Any]] = {}
    failed = []
    total = time.perf_counter()
    for i, name in enumerate(names, 1):
        print(f"\n=== lightning-sdp demo [{i}/{len(names)}]: {name} ===", flush=True)
        part_dir = out / name
        part_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            res = PARTS[name](part_dir, args.quick)
        except Exception as err:  # one broken part must not hide the others' results
            import traceback

            failed.append(name)
            res = {"headline": f"FAILED: {type(err).__name__}: {err}", "error": traceback.format_exc()}
        res["wall_s"] = round(time.perf_counter() - start, 1)
        (part_dir / "result.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        results[name] = res
    index = _write_index(out, results, args.quick)
    print(f"\n=== lightning-sdp demo summary ({time.perf_counter() - total:.0f} s) ===")
    for name, res in results.items():
        print(f"{name:>9}: {res['headline']}")
    print(f"report: {index.resolve()}")
    return 1 if failed else 0
