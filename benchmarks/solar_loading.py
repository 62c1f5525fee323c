"""SOLAR loading benchmark: PyTorch DataLoader + h5py baseline vs LRU, consumed-first FIFO and our default.

An HDF5 file of PtychoNN-like samples (64x64 float32 input, two 64x64 targets: 48 KiB per sample) at least four
times larger than the buffer (C/N = 0.25). Before every epoch of every rank the file is evicted from the page
cache (``posix_fadvise(DONTNEED)``). Two storage modes: the plain local disk, and a throttled mode that emulates
shared storage (every read request costs latency + bytes / bandwidth, through
:class:`benchmarks.tools.storage.ThrottledFile`). P ranks are simulated with the real SOLAR schedule and
real readers: each rank's loader runs its epoch alone on this machine (its own worker processes), and the
distributed epoch time is the slowest rank's. Only loading is timed (no model).

Modes (same ``--workers`` reader processes per rank everywhere):
    baseline        torch DataLoader + DistributedSampler(shuffle) + per-sample h5py reads (``dset[i]`` per key).
    lru             per-rank LRU cache of C/P samples over the same shuffled order (no re-routing/balancing).
    consumed_first  eviction "solar" (FIFO, consumed samples first), re-routing on: an early reading of the SOLAR
                    artifact's rule that the artifact does not follow (its own rule is eviction "artifact_fifo").
    solar_serial    our default schedule (Belady + re-routing + balancing), hyperslab reads one after another.
    solar           our default (as solar_serial, plus ``io_threads`` concurrent positional reads per step).
    solar_auto      ``SolarDataModule``'s own plan for the probed device (window, gaps, page-cache warming, the
                    memory split between buffer and read-ahead; its read-ahead thread, no reader processes).

``--storage device`` (root) measures on a real throttled loop device (``--bps``, ``--iops``, ``--readahead-kb``), each
rank's epoch inside the device's cgroup, and reports beside each rate the device's bound (:func:`device_bound`): the
cheaper of streaming the file at the bandwidth and reading only the misses at one request per sample per dataset,
priced with the bandwidth and request rate probed on the device and with the configured limits, and what the device
served (bytes and requests from its cgroup's counters) with how busy that kept it. Mode ``solar_auto`` runs on
``plain`` and ``device`` storage.

Run: ``.venv/bin/python -m benchmarks.solar_loading`` (about 10 minutes on 2 busy cores), ``--quick`` for a smoke run;
on the device: ``sudo .venv/bin/python -m benchmarks.solar_loading --storage device --modes baseline solar solar_auto``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks._common import markdown_table, write_results
from benchmarks.tools.storage import PerSampleHDF5Dataset, StorageThrottle, ThrottledReader, drop_page_cache
from lightning_sdp.datamodules.solar import SolarDataModule, SolarReadOptions, SolarSchedule
from lightning_sdp.datamodules.solar.loader import SolarLoader
from lightning_sdp.datamodules.solar.ptycho import INPUT_KEY, TARGET_KEYS, make_ptycho_h5
from lightning_sdp.datamodules.solar.reader import HDF5Reader
from lightning_sdp.datamodules.solar.readplan import StorageProfile, probe_storage, read_costs

KEYS = [INPUT_KEY, *TARGET_KEYS]
PLANS: dict[str, str] = {}
"""The read plans ``solar_auto`` chose, by rank count and rank."""
MODE_NOTES = {
    "solar_auto": "SolarDataModule's own plan for the probed device (window, gaps, warming, memory split; its "
    "read-ahead thread instead of reader processes)",
    "baseline": "DataLoader + DistributedSampler + per-sample h5py reads",
    "lru": "per-rank LRU cache, no re-routing or balancing",
    "consumed_first": 'eviction="solar" (FIFO, consumed samples first), re-routing and balancing',
    "solar_serial": "Belady + re-routing + balancing, reads one after another",
    "solar": "Belady + re-routing + balancing, 4 concurrent reads per step",
}
MODES = {
    "lru": dict(eviction="lru", reroute=False, balance=False, io_threads=4),
    "consumed_first": dict(eviction="solar", reroute=True, balance=True, io_threads=4),
    "solar_serial": dict(eviction="belady", reroute=True, balance=True, io_threads=1),
    "solar": dict(eviction="belady", reroute=True, balance=True, io_threads=4),
}


class _DeviceReads:
    """What the throttled device served this process's cgroup during one rank's epoch (zeros outside one)."""

    def __init__(self) -> None:
        from benchmarks.tools.device import ThrottleGroup

        self.group = ThrottleGroup.from_env()
        self.bytes, self.requests = 0, 0

    def __enter__(self) -> _DeviceReads:
        if self.group is not None:
            self._b0, self._r0 = self.group.device_read_bytes(), self.group.device_read_requests()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.group is not None:
            self.bytes += self.group.device_read_bytes() - self._b0
            self.requests += self.group.device_read_requests() - self._r0


def run_baseline(path, n, ranks, batch, epochs, workers, throttle, seed, sample_bytes):
    dataset = PerSampleHDF5Dataset(path, INPUT_KEY, TARGET_KEYS, throttle=throttle)
    loaders = []
    for r in range(ranks):
        sampler = DistributedSampler(dataset, num_replicas=ranks, rank=r, shuffle=True, seed=seed)
        extra = {"persistent_workers": True, "prefetch_factor": 2} if workers else {}
        loaders.append((sampler, DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers, **extra)))
    rows = []
    for e in range(epochs):
        times, count, device = [], 0, _DeviceReads()
        for sampler, loader in loaders:
            sampler.set_epoch(e)
            drop_page_cache(path)
            t0 = time.perf_counter()
            with device:
                for x, _ in loader:
                    count += len(x)
            times.append(time.perf_counter() - t0)
        rows.append(
            {
                "epoch": e,
                "rank_s": times,
                "hits": 0,
                "samples": count,
                "bytes": count * sample_bytes,
                "device_bytes": device.bytes,
                "device_requests": device.requests,
            }
        )
    return rows


def _auto_loaders(path, ranks, batch, epochs, seed, buffer):
    """One loader per rank with the plan ``SolarDataModule`` chooses (probe, window, gap, warming, memory split)."""
    loaders = []
    for r in range(ranks):
        options = dict(batch_size=batch, buffer_size=buffer, max_epochs=epochs, seed=seed, log_metrics=False)
        dm = SolarDataModule(path, KEYS[0], KEYS[1:], batch_format="dict", **options)
        dm.rank, dm.world_size = r, ranks  # what a Trainer of `ranks` processes sets in setup
        dm.setup("fit")
        loader = dm.train_dataloader()
        loader.read_across_epochs = False  # epochs are measured one by one, each after a cache drop
        loaders.append(loader)
        PLANS[f"P={ranks} rank {r}"] = dm.read_plan.describe() + (
            f"; page cache warmed, cold gap {dm.cold_gap}" if dm.cold_gap is not None else ""
        )
    return loaders


def run_solar(path, n, ranks, batch, epochs, workers, throttle, seed, buffer, mode):
    if mode == "solar_auto":
        if throttle is not None:
            raise ValueError("solar_auto reads through SolarDataModule: use --storage plain or device")
        return _epochs(_auto_loaders(path, ranks, batch, epochs, seed, buffer), epochs, path)
    opts = dict(MODES[mode])
    io_threads = opts.pop("io_threads")
    schedule = SolarSchedule(n, epochs, ranks, batch, buffer_size=buffer, seed=seed, **opts)
    loaders = [
        SolarLoader(
            schedule,
            r,
            HDF5Reader(path, KEYS, io_threads=io_threads)
            if throttle is None
            else ThrottledReader(path, KEYS, throttle=throttle, io_threads=io_threads),
            INPUT_KEY,
            list(TARGET_KEYS),
            num_workers=workers,
        )
        for r in range(ranks)
    ]
    return _epochs(loaders, epochs, path)


def _epochs(loaders: list[Any], epochs: int, path: str) -> list[dict]:
    """Each rank's loader runs each epoch alone after a cache drop; per epoch the ranks' times and counters."""
    rows = []
    for e in range(epochs):
        times, hits, count, nbytes, device = [], 0, 0, 0, _DeviceReads()
        for loader in loaders:
            loader.set_epoch(e)
            drop_page_cache(path)
            t0 = time.perf_counter()
            with device:
                for b in loader:
                    count += len(b["index"])
            times.append(time.perf_counter() - t0)
            hits += loader.epoch_stats.hits
            nbytes += loader.epoch_stats.storage_bytes
        rows.append(
            {
                "epoch": e,
                "rank_s": times,
                "hits": hits,
                "samples": count,
                "bytes": nbytes,
                "device_bytes": device.bytes,
                "device_requests": device.requests,
            }
        )
    for loader in loaders:
        loader.close()
    return rows


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--buffer-fraction", type=float, default=0.25)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=32, help="local batch size per rank")
    parser.add_argument("--workers", type=int, default=2, help="reader processes per rank (all modes)")
    parser.add_argument("--latency", type=float, default=0.001, help="throttled mode: seconds per request")
    parser.add_argument("--bandwidth", type=float, default=200e6, help="throttled mode: bytes/s per request")
    parser.add_argument(
        "--storage", nargs="+", default=["throttled", "plain"], choices=["throttled", "plain", "device"]
    )
    parser.add_argument("--bps", default="40MB", help="device mode: read bandwidth limit of the loop device")
    parser.add_argument("--iops", type=int, default=400, help="device mode: read requests/s limit")
    parser.add_argument("--readahead-kb", type=int, default=None, help="device mode: the loop device's readahead")
    parser.add_argument("--device-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--modes", nargs="+", default=["baseline", *MODES], help="also: solar_auto (plain, device)")
    parser.add_argument("--data", default=None, help="HDF5 file to use/create (default: a temp file)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--name", default="solar_loading")
    args = parser.parse_args(argv)
    if "solar_auto" in args.modes and "throttled" in args.storage:
        parser.error("mode solar_auto reads through SolarDataModule's own reader: use --storage plain and/or device")
    if args.quick:
        args.samples, args.epochs, args.ranks, args.batch, args.workers = 256, 2, [1, 2], 16, 1
        args.name = args.name + "_quick"
    return args


def _measure(args: argparse.Namespace, path: str, buffer: int, sample_bytes: int) -> list[dict]:
    """One row per (storage, ranks, mode, epoch): the slowest rank's epoch time, hit rate and storage bytes."""
    results: list[dict] = []
    for storage in args.storage:
        throttle = StorageThrottle(args.latency, args.bandwidth) if storage == "throttled" else None
        for ranks in args.ranks:
            common = (path, args.samples, ranks, args.batch, args.epochs, args.workers, throttle, args.seed)
            for mode in args.modes:
                t0 = time.perf_counter()
                rows = run_baseline(*common, sample_bytes) if mode == "baseline" else run_solar(*common, buffer, mode)
                last = []
                for row in rows:
                    epoch_s = max(row["rank_s"])
                    last.append(
                        {
                            "storage": storage,
                            "ranks": ranks,
                            "mode": mode,
                            "epoch": row["epoch"],
                            "epoch_s": epoch_s,
                            "samples_per_s": row["samples"] / epoch_s,
                            "hit_rate": row["hits"] / row["samples"],
                            "storage_mib": row["bytes"] / 2**20,
                            "device_mib": row["device_bytes"] / 2**20,
                            "device_requests": row["device_requests"],
                            "rank_s": [round(t, 3) for t in row["rank_s"]],
                        }
                    )
                results += last
                print(
                    f"{storage:9s} P={ranks} {mode:12s} "
                    + " ".join(f"e{r['epoch']}:{r['samples_per_s']:.0f}/s,h={r['hit_rate']:.3f}" for r in last)
                    + f"  ({time.perf_counter() - t0:.0f}s)",
                    flush=True,
                )
    return results


def _summarize(args: argparse.Namespace, results: list[dict], buffer: int, bounds: DeviceBounds | None) -> list[dict]:
    """Per (storage, ranks, mode): the first epoch, the mean of the later ones, the speed-up over the baseline, and
    on the device its bound and the fraction of it reached."""
    n = args.samples
    summary = []
    for storage in args.storage:
        for ranks in args.ranks:
            base = [r for r in results if (r["storage"], r["ranks"], r["mode"]) == (storage, ranks, "baseline")]
            base_sps = np.mean([r["samples_per_s"] for r in base if r["epoch"] > 0]) if base else float("nan")
            for mode in args.modes:
                rs = [r for r in results if (r["storage"], r["ranks"], r["mode"]) == (storage, ranks, mode)]
                later = [r for r in rs if r["epoch"] > 0]
                sps = float(np.mean([r["samples_per_s"] for r in later]))
                summary.append(
                    {
                        "storage": storage,
                        "P": ranks,
                        "mode": mode,
                        "epoch0 samples/s": rs[0]["samples_per_s"],
                        "later samples/s": sps,
                        "speedup vs baseline": sps / base_sps,
                        "hit rate (later)": float(np.mean([r["hit_rate"] for r in later])),
                        "bound C/N": buffer / n,
                        "storage MiB/epoch (later)": float(np.mean([r["storage_mib"] for r in later])),
                        **_bound_columns(bounds, storage, ranks, sps),
                        **_device_columns(bounds, storage, later),
                    }
                )
    return summary


def device_bound(storage: StorageProfile, samples: int, ranks: int, buffer: int, row_nbytes: list[int]) -> float:
    """Samples/s of an epoch at the device's bound, its ranks one after another (each with the device to itself).

    A rank must read its misses (``(samples - buffer) / ranks``): either by streaming the file (its rows lie all
    over it) or by one request per missed sample per dataset; the cheaper of the two
    (:func:`~lightning_sdp.datamodules.solar.readplan.read_costs`, the costs ``SolarDataModule``'s plan chooses
    between) is the bound. The epoch lasts as long as the slowest rank.

    Args:
        storage: the device's bandwidth and request rate.
        samples: samples per epoch.
        ranks: ranks.
        buffer: buffer samples over all ranks.
        row_nbytes: bytes of a row of each dataset read.
    """
    costs = read_costs(
        num_samples=samples,
        world_size=ranks,
        ranks_per_device=1,
        buffer_samples=buffer,
        row_nbytes=row_nbytes,
        storage=storage,
    )
    return samples / costs.seconds


@dataclass(frozen=True)
class DeviceBounds:
    """The device's bound for one file and buffer, per device profile.

    Args:
        profiles: ``{"probed": probed on the device in its cgroup, "limits": the configured --bps and --iops}``.
        samples: samples per epoch.
        buffer: buffer samples over all ranks.
        row_nbytes: bytes of a row of each dataset read.
    """

    profiles: dict[str, StorageProfile]
    samples: int
    buffer: int
    row_nbytes: list[int]

    def columns(self, ranks: int, sps: float) -> dict[str, Any]:
        """``bound samples/s (<profile>)`` and ``of bound (<profile>)`` per profile."""
        out: dict[str, Any] = {}
        for name, profile in self.profiles.items():
            bound = device_bound(profile, self.samples, ranks, self.buffer, self.row_nbytes)
            out[f"bound samples/s ({name})"] = round(bound, 1)
            out[f"of bound ({name})"] = round(sps / bound, 3)
        return out


def _bound_columns(bounds: DeviceBounds | None, storage: str, ranks: int, sps: float) -> dict[str, Any]:
    """The device's bound and the fraction reached on the device; ``None`` elsewhere (the emulated throttle costs
    each request alone, the plain disk is shared: neither has a device-wide limit to state)."""
    if bounds is None:
        return {}
    columns = bounds.columns(ranks, sps)
    return columns if storage == "device" else dict.fromkeys(columns)


def _device_columns(bounds: DeviceBounds | None, storage: str, later: list[dict]) -> dict[str, Any]:
    """What the device served per epoch (its cgroup's counters, all ranks) and how busy that kept it: the probed
    profile's seconds for those bytes and requests over the ranks' summed epoch times (ranks run one after another,
    so the device serves one rank at a time). ``None`` off the device."""
    if bounds is None:
        return {}
    names = ["device MiB/epoch (later)", "device requests/epoch (later)", "device busy (probed)"]
    if storage != "device":
        return dict.fromkeys(names)
    probed = bounds.profiles["probed"]
    busy = [probed.seconds(r["device_mib"] * 2**20, r["device_requests"]) / sum(r["rank_s"]) for r in later]
    values = [np.mean([r["device_mib"] for r in later]), np.mean([r["device_requests"] for r in later]), np.mean(busy)]
    return {name: round(float(v), 3) for name, v in zip(names, values, strict=True)}


def _figure(args: argparse.Namespace, summary: list[dict], results: list[dict], bound: float) -> Any:
    """Samples/s against ranks per storage mode, and the hit rate per epoch; ``None`` if it cannot be drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(args.storage) + 1, figsize=(5 * (len(args.storage) + 1), 4))
        for ax, storage in zip(axes, args.storage, strict=False):
            for mode in args.modes:
                ys = [s["later samples/s"] for s in summary if s["storage"] == storage and s["mode"] == mode]
                ax.plot(args.ranks, ys, marker="o", label=mode)
            ax.set_title(f"{storage} storage: samples/s after epoch 0")
            ax.set_xlabel("ranks P")
            ax.set_xticks(args.ranks)
            ax.set_ylabel("samples/s (slowest rank)")
            ax.legend()
        ax = axes[-1]
        first = args.storage[0]
        for mode in args.modes:
            for ranks in args.ranks:
                rs = [r for r in results if (r["storage"], r["ranks"], r["mode"]) == (first, ranks, mode)]
                label = f"{mode} P={ranks}"
                ax.plot([r["epoch"] for r in rs], [r["hit_rate"] for r in rs], marker=".", alpha=0.7, label=label)
        ax.axhline(bound, color="k", ls="--", label="bound C/N")
        ax.set_title("buffer hit rate per epoch")
        ax.set_xlabel("epoch")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
    except Exception as err:
        print(f"no figure: {err}")
        return None
    return fig


def _measure_on_device(
    args: argparse.Namespace, path: Path, buffer: int, sample_bytes: int
) -> tuple[list[dict], dict[str, Any]] | None:
    """The ``device`` rows and the device (its facts and profiles), measured by a child inside a throttled loop
    device's cgroup; ``None``: the device could not be built (the reason is printed)."""
    from benchmarks.tools.device import ThrottledStorage, parse_bytes

    size = f"{int(2 * os.path.getsize(path) / 2**20) + 256}MiB"
    try:
        with (
            ThrottledStorage(size, args.bps, args.iops, args.readahead_kb) as storage,
            tempfile.TemporaryDirectory(prefix="solar_loading_") as tmp,
        ):
            out = Path(tmp) / "device.json"
            child = {
                "path": str(storage.copy_in(path)),
                "buffer": buffer,
                "sample_bytes": sample_bytes,
                "out": str(out),
            }
            cmd = [sys.executable, "-m", "benchmarks.solar_loading", *_argv_of(args), "--device-child"]
            rc = storage.run([*cmd, json.dumps(child)])
            if rc != 0 or not out.exists():
                raise RuntimeError(f"the device measurement failed (exit {rc})")
            result = json.loads(out.read_text())
            limits = StorageProfile(float(parse_bytes(args.bps)), float(args.iops), 0.0, "limits")
            device = {"facts": storage.facts(), "probed": result["probed"], "limits": asdict(limits)}
    except PermissionError as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    return result["rows"], {**device, "plans": result["plans"]}


def _device_child(args: argparse.Namespace) -> None:
    """Inside the device's cgroup: probe the device (the profile ``solar_auto`` plans with), then measure."""
    child = json.loads(args.device_child)
    probed = probe_storage(child["path"], SolarReadOptions().io_threads)
    print(f"device probed: {probed.describe()}", flush=True)
    rows = _measure(args, child["path"], child["buffer"], child["sample_bytes"])
    Path(child["out"]).write_text(json.dumps({"rows": rows, "plans": PLANS, "probed": asdict(probed)}))


def _argv_of(args: argparse.Namespace) -> list[str]:
    """The command-line options that the device child needs to measure as this run does."""
    out = ["--samples", str(args.samples), "--size", str(args.size), "--epochs", str(args.epochs)]
    out += ["--batch", str(args.batch), "--workers", str(args.workers), "--seed", str(args.seed)]
    return [*out, "--ranks", *map(str, args.ranks), "--modes", *args.modes, "--storage", "device"]


def _device_note(args: argparse.Namespace, device: dict[str, Any]) -> str:
    """The markdown sentence that says what the device was and how its bound is computed."""
    facts, probed = device["facts"], StorageProfile(**device["probed"])
    return (
        f"Device storage: the file on ext4 on a loop device limited to {args.bps}/s and {args.iops} read requests/s "
        f"(read_ahead_kb {facts.get('read_ahead_kb')}, cgroup v{facts.get('cgroup_version')}), each rank's epoch "
        f"in its cgroup; probed there: {probed.describe()}. Its bound per rank is the cheaper of streaming the file "
        "at the bandwidth and reading only the misses at one request per sample per dataset (device_bound), from "
        "the probed profile and from the limits. 'storage MiB' counts what the loader read (page-cache hits "
        "included); 'device MiB' and 'device requests' what the device served (its cgroup's counters, all ranks); "
        "'device busy' is the probed device's time for those bytes and requests over the ranks' summed epoch times. "
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    torch.set_num_threads(1)
    if args.device_child:  # inside the throttled device's cgroup
        _device_child(args)
        return 0
    tmp = tempfile.TemporaryDirectory()
    path = Path(args.data) if args.data else Path(tmp.name) / "ptycho.h5"
    if not path.exists():
        t0 = time.perf_counter()
        make_ptycho_h5(path, args.samples, args.size, seed=args.seed)
        print(f"generated {path} in {time.perf_counter() - t0:.1f}s")
    n = args.samples
    sample_bytes = 3 * args.size * args.size * 4
    buffer = int(round(args.buffer_fraction * n))
    file_mib = os.path.getsize(path) / 2**20
    print(f"file {file_mib:.0f} MiB, {n} samples, buffer {buffer} samples ({buffer * sample_bytes / 2**20:.0f} MiB)")
    start = time.perf_counter()
    local = [st for st in args.storage if st != "device"]
    results = _measure(argparse.Namespace(**{**vars(args), "storage": local}), str(path), buffer, sample_bytes)
    plans = {f"plain, {key}": plan for key, plan in PLANS.items()}
    device, bounds = None, None
    if "device" in args.storage:
        measured = _measure_on_device(args, path, buffer, sample_bytes)
        if measured is None:
            return 2
        rows, device = measured
        results += rows
        plans.update({f"device, {key}": plan for key, plan in device.pop("plans").items()})
        profiles = {name: StorageProfile(**device[name]) for name in ("probed", "limits")}
        row_nbytes = list(HDF5Reader(str(path), KEYS).info.row_nbytes.values())
        bounds = DeviceBounds(profiles, n, buffer, row_nbytes)
    summary = _summarize(args, results, buffer, bounds)
    md = (
        f"File: {n} samples x {sample_bytes // 1024} KiB = {file_mib:.0f} MiB; buffer {buffer} samples "
        f"(C/N = {buffer / n:.2f}); {args.epochs} epochs; local batch {args.batch}; {args.workers} reader processes "
        f"per rank in every mode; page cache dropped before each rank's epoch. Throttled storage: "
        f"{args.latency * 1e3:g} ms + bytes / {args.bandwidth / 1e6:g} MB/s per request. Ranks are simulated one "
        "after another (real schedule, real readers); an epoch takes as long as its slowest rank. 'later' = mean "
        "over the epochs after the first. "
        + (_device_note(args, device) if device is not None else "")
        + "Modes: "
        + "; ".join(f"`{m}` {MODE_NOTES.get(m, '')}".strip() for m in args.modes)
        + ".\n\n"
        + markdown_table(summary)
        + f"\n\nTotal benchmark wall time: {time.perf_counter() - start:.0f} s.\n"
    )
    if plans:
        md += "\nsolar_auto's read plans:\n\n" + "".join(f"- {k}: {v}\n" for k, v in plans.items())
    print(md)
    fig = _figure(args, summary, results, buffer / n)
    payload = {"args": vars(args), "summary": summary, "epochs": results, "sample_bytes": sample_bytes}
    payload.update(plans=plans, device=device)
    write_results(args.name, payload, md, fig)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
