"""Demo part ``solar``: what SolarDataModule saves in storage reads, counted, beside the real-device benchmark.

The demo counts, on a generated HDF5 file, the bytes and read requests that a plain shuffled DataLoader with
per-sample h5py reads issues and those of SOLAR's read plans for a slow device and for a fast disk (exact reads),
plus SOLAR's buffer hit rate. It
measures no speed: a local file in the page cache says nothing about shared storage, and an emulated delay per
request would only repeat the emulation's own assumptions. Speed comes from
``benchmarks/results/solar_vs_loaders.json`` (PtychoNN trained on a really throttled device), shown beside the counts
when that file is found.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, cast


class _CountedFile(io.FileIO):
    """A read-only file whose reads are counted: what a device without a page cache would serve."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path, "rb")
        self.bytes_read = 0
        self.requests = 0

    def readinto(self, buffer: Any) -> int:
        n = super().readinto(buffer) or 0
        self.bytes_read += n
        self.requests += 1
        return n


class _PerSampleReads:
    """What a plain project does with an HDF5 training set: ``dataset[i]`` reads row ``i`` of each key with h5py.

    Read here in this process only (``DataLoader(num_workers=0)``), through a :class:`_CountedFile`.

    Args:
        path: the HDF5 file.
        keys: the input key, then the target keys.
    """

    def __init__(self, path: str | os.PathLike, keys: list[str]) -> None:
        import h5py

        self.file = _CountedFile(path)
        self.h5 = h5py.File(self.file, "r")
        self.keys = keys

    def __len__(self) -> int:
        return int(self.h5[self.keys[0]].shape[0])

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        import torch

        return tuple(torch.from_numpy(self.h5[key][i]) for key in self.keys)


RESULTS_NAME = "solar_vs_loaders.json"
"""The real-device benchmark's results file (``python -m benchmarks.solar_vs_loaders``)."""


def find_benchmark_results(name: str = RESULTS_NAME) -> Path | None:
    """``benchmarks/results/<name>`` under the working directory or the source checkout, if there is one.

    Args:
        name: the results file's name.
    """
    import lightning_sdp

    roots = [Path.cwd(), Path(lightning_sdp.__file__).resolve().parents[1]]
    for root in roots:
        path = root / "benchmarks" / "results" / name
        if path.is_file():
            return path
    return None


def real_device_summary(path: Path) -> dict[str, Any]:
    """The SOLAR rows of the real-device benchmark, per rank count, next to the best DataLoader + h5py.

    Args:
        path: ``solar_vs_loaders.json``.

    Returns:
        ``{"source", "machine", "device", "rows", "failed"}``; each row has the rank count ``P``, samples/s of SOLAR
        (default and exact plan), of the best DataLoader and of litdata with their ratios to that DataLoader, and the
        device MiB and requests per epoch of SOLAR and of the best DataLoader; ``failed`` names the runs that did not
        finish (timed out, killed for memory), which the rows leave out.
    """
    payload = json.loads(path.read_text())
    # a run that failed (timed out, killed for memory) has a status where its speed would be
    failed = [f"{r['loader']} at P={r['P']} ({r['samples/s']})" for r in payload["summary"] if not _measured(r)]
    summary = [r for r in payload["summary"] if _measured(r)]
    rows = []
    for p in sorted({r["P"] for r in summary}):
        at = {r["loader"]: r for r in summary if r["P"] == p}
        loaders = [r for name, r in at.items() if name.startswith("dl")]
        if "solar" not in at or not loaders:
            continue
        best = max(loaders, key=lambda r: r["samples/s"])

        def ratio(name: str, best: dict[str, Any] = best, at: dict[str, Any] = at) -> float:
            # the benchmark's own column where it has one, so the numbers match its report
            return float(at[name].get("vs best DataLoader", round(at[name]["samples/s"] / best["samples/s"], 2)))

        row: dict[str, Any] = {
            "P": p,
            "best_dataloader": best["loader"],
            "dataloader_samples_per_s": best["samples/s"],
            "dataloader_device_mib": best["device MiB/epoch"],
            "dataloader_device_requests": best["device requests/epoch"],
            "solar_samples_per_s": at["solar"]["samples/s"],
            "solar_vs_dataloader": ratio("solar"),
            "solar_device_mib": at["solar"]["device MiB/epoch"],
            "solar_device_requests": at["solar"]["device requests/epoch"],
        }
        for other in ("solar_exact", "litdata"):
            if other in at:
                row[f"{other}_vs_dataloader"] = ratio(other)
        rows.append(row)
    device = payload.get("device", {})
    machine = payload.get("machine", {})
    return {
        "source": str(path),
        "machine": f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, {machine.get('date', '?')}",
        "device": f"{device.get('filesystem', 'a device')} limited to {device.get('read_bps', 0) / 1e6:.0f} MB/s "
        f"and {device.get('read_iops', '?')} read IOPS, page cache dropped before every epoch",
        "rows": rows,
        "failed": failed,
    }


def _measured(row: dict[str, Any]) -> bool:
    return isinstance(row.get("samples/s"), int | float)


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}x" if lo == hi else f"{lo:.2f}-{hi:.2f}x"


def _plot(path: Path, labels: list[str], mib: list[float], requests: list[float], title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.6))
    colors = ["#9e9e9e", "#1f77b4", "#ff7f0e"]
    for ax, values, ylabel in ((axes[0], mib, "MiB read per epoch"), (axes[1], requests, "read requests per epoch")):
        bars = ax.bar(labels, values, color=colors[: len(values)])
        for bar, value in zip(bars, values, strict=True):
            label = f"{value:,.0f}" if value >= 100 else f"{value:.3g}"
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", labelsize=8)
        ax.margins(y=0.15)
    axes[1].set_yscale("log")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(out: Path, quick: bool) -> dict[str, Any]:
    """Count the storage reads of a plain DataLoader and of SOLAR's two read plans; add the real-device result."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Dataset
    from tqdm.auto import tqdm

    from lightning_sdp.datamodules.solar import SolarDataModule, SolarReadOptions, make_ptycho_h5
    from lightning_sdp.datamodules.solar.ptycho import INPUT_KEY, TARGET_KEYS

    samples, size, epochs, batch = (256, 32, 2, 16) if quick else (1024, 32, 3, 32)
    path = out / "ptycho.h5"
    make_ptycho_h5(path, num_samples=samples, size=size, seed=0, overwrite=True)
    buffer = samples // 4
    file_mib = samples * (1 + len(TARGET_KEYS)) * size * size * 4 / 2**20
    print(
        f"SOLAR part: {samples} samples ({file_mib:.1f} MiB) in {path}, buffer {buffer} samples (25%), {epochs} "
        "epochs; counting the bytes and read requests each loader issues to the file"
    )

    # what a plain project does: a shuffled DataLoader whose dataset reads one sample per __getitem__ with h5py,
    # here through a file object that counts the requests
    baseline = _PerSampleReads(path, [INPUT_KEY, *TARGET_KEYS])
    # a map-style dataset by its __len__ and __getitem__ (torch is imported only when the demo runs)
    dataset = cast("Dataset[tuple[Any, ...]]", baseline)
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    base_mib: list[float] = []
    base_requests: list[float] = []
    for epoch in range(epochs):
        b0, r0 = baseline.file.bytes_read, baseline.file.requests
        for _ in tqdm(loader, desc=f"DataLoader epoch {epoch}", leave=False):
            pass
        base_mib.append((baseline.file.bytes_read - b0) / 2**20)
        base_requests.append(baseline.file.requests - r0)
    baseline.h5.close()

    # "default": the plan SOLAR chooses for a device of 40 MB/s and 400 read IOPS (the real-device benchmark's),
    # where a request costs as much as 100 KB; "exact": what it chooses for a fast local disk, like this one's.
    # Page-cache warming is off: it streams the file into a page cache these counts leave out
    slow_device = {"bandwidth_bytes_per_s": 40e6, "requests_per_s": 400.0, "overlap": 0.0}
    plans = {
        "default": SolarReadOptions(storage=slow_device, warm_page_cache=False),
        "exact": SolarReadOptions(read_window=1, max_gap=0),
    }
    solar: dict[str, dict[str, list[float]]] = {}
    bounds: dict[str, float] = {}
    for plan, reads in plans.items():
        keys = dict(input_key=INPUT_KEY, target_key=list(TARGET_KEYS))
        dm = SolarDataModule(
            str(path), **keys, batch_size=batch, buffer_size=buffer, max_epochs=epochs, log_metrics=False, reads=reads
        )
        dm.setup("fit")
        assert dm.schedule is not None
        bounds[plan] = dm.schedule.bound
        solar_loader = dm.train_dataloader()
        counts: dict[str, list[float]] = {"hit_rate": [], "mib": [], "requests": []}
        for epoch in range(epochs):
            solar_loader.set_epoch(epoch)
            r0 = solar_loader.reader.requests
            for _ in tqdm(solar_loader, desc=f"SOLAR ({plan} plan) epoch {epoch}", leave=False):
                pass
            stats = solar_loader.epoch_stats  # SOLAR's own counters
            counts["hit_rate"].append(stats.hit_rate)
            counts["mib"].append(stats.storage_bytes / 2**20)
            counts["requests"].append(solar_loader.reader.requests - r0)
        solar_loader.close()
        solar[plan] = counts

    later = slice(1, None)  # epoch 0 starts with an empty buffer

    def mean(values: list[float]) -> float:
        return float(np.mean(values[later]))

    base = (mean(base_mib), mean(base_requests))
    default = (mean(solar["default"]["mib"]), mean(solar["default"]["requests"]))
    exact = (mean(solar["exact"]["mib"]), mean(solar["exact"]["requests"]))
    hit, bound = mean(solar["exact"]["hit_rate"]), bounds["exact"]
    png = _plot(
        out / "solar.png",
        ["DataLoader + h5py", "SOLAR default plan", "SOLAR exact plan"],
        [base[0], default[0], exact[0]],
        [base[1], default[1], exact[1]],
        f"{samples} samples ({file_mib:.1f} MiB), buffer 25%: reads per epoch after the first",
    )
    headline = (
        f"buffer hit rate {hit:.2f} (bound {bound:.2f}); reads per epoch: exact plan {exact[0]:.1f} MiB in "
        f"{exact[1]:,.0f} requests, default plan {default[0]:.1f} MiB in {default[1]:,.0f}, plain DataLoader "
        f"{base[0]:.1f} MiB in {base[1]:,.0f}"
    )
    results = find_benchmark_results()
    real = real_device_summary(results) if results is not None else None
    if real is not None and real["rows"]:
        rows = real["rows"]
        headline += (
            f"; on a throttled device SOLAR trained {_span([r['solar_vs_dataloader'] for r in rows])} as fast as the "
            "best DataLoader + h5py"
        )
        if all("litdata_vs_dataloader" in r for r in rows):
            headline += f" (litdata, chunk shuffle: {_span([r['litdata_vs_dataloader'] for r in rows])})"
        unfinished = [run for run in real["failed"] if run.startswith("solar ")]
        headline += f"; did not finish: {', '.join(unfinished)}" if unfinished else ""
        headline += f" ({Path(real['source']).name})"
        per_p = "; ".join(
            f"P={r['P']}: SOLAR {r['solar_vs_dataloader']:.2f}x"
            + (f", exact plan {r['solar_exact_vs_dataloader']:.2f}x" if "solar_exact_vs_dataloader" in r else "")
            + (f", litdata {r['litdata_vs_dataloader']:.2f}x" if "litdata_vs_dataloader" in r else "")
            + f" (device: SOLAR {r['solar_device_mib']:.0f} MiB in {r['solar_device_requests']:,} requests, "
            f"DataLoader {r['dataloader_device_mib']:.0f} MiB in {r['dataloader_device_requests']:,})"
            for r in rows
        )
        real_note = (
            f"Speed on real storage, from {real['source']} (python -m benchmarks.solar_vs_loaders; "
            f"{real['machine']}; {real['device']}): PtychoNN trained through Trainer, samples/s relative to the "
            f"best DataLoader + h5py in the same run: {per_p}. litdata shuffles chunks, not samples."
            + (f" Runs that did not finish: {', '.join(real['failed'])}." if real["failed"] else "")
        )
    else:
        headline += "; no real-device result here (run python -m benchmarks.solar_vs_loaders)"
        real_note = (
            f"No {RESULTS_NAME} was found under benchmarks/results/ (of the working directory or the source "
            "checkout), so this report has no speed: `python -m benchmarks.solar_vs_loaders` (as root) measures it "
            "on a throttled loop device."
        )
    note = (
        "Loading only (no model), one rank, a local file: the counts are the bytes and read requests each loader "
        "issued to the file (h5py's metadata reads included for the DataLoader), what storage without a page cache "
        "would serve. buffer_size (25% of the samples) is the loader's whole memory: the buffer and the read-ahead "
        f"share it. The exact plan (read_window=1, max_gap=0, what SOLAR chooses on a fast local disk) keeps "
        f"{bound:.0%} of the samples buffered and reads only the misses, {1 - bound:.0%} of the bytes. The default "
        "plan is the one SOLAR chooses for a device of 40 MB/s and 400 read IOPS, where a request costs as much "
        "as 100 KB: it sorts several steps' reads together and reads through gaps, so it sends far fewer requests "
        "for more bytes, and gives the buffer's memory to the read-ahead (with the gaps read through, the buffer "
        "would save no request); its page-cache warming, which streams the file into a page cache these counts "
        "leave out, is off here. No speed is measured here: local reads from the page cache say nothing about "
        "shared storage. " + real_note
    )
    return {
        "headline": headline,
        "note": note,
        "samples": samples,
        "file_mib": file_mib,
        "dataloader_storage_mib": base_mib,
        "dataloader_requests": base_requests,
        "solar_hit_rate": solar["default"]["hit_rate"],
        "solar_storage_mib": solar["default"]["mib"],
        "solar_requests": solar["default"]["requests"],
        "solar_exact_hit_rate": solar["exact"]["hit_rate"],
        "solar_exact_storage_mib": solar["exact"]["mib"],
        "solar_exact_requests": solar["exact"]["requests"],
        "hit_rate_bound": float(bound),
        "solar_hit_rate_bound": float(bounds["default"]),
        "real_device": real,
        "file": str(path),
        "png": str(png),
    }
