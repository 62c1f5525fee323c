"""SOLAR against DataLoader + h5py on real slow storage (a throttled loop device), device bytes measured.

Every configuration runs in its own child process inside the blkio (and memory) cgroup of
:mod:`benchmarks.tools.device`; the page cache is dropped before every epoch; bytes and requests come from the
cgroup's ``blkio.throttle.io_service_bytes`` / ``io_serviced``, not from the plan. Loading only, one rank (peers,
DDP ranks and training in the loop: :mod:`benchmarks.solar_vs_loaders`).

Modes: ``dl<W>`` = DataLoader + h5py, per-sample reads, shuffled, W workers; ``solar:<window>:<gap>[:opts]`` =
SolarLoader with a read window of ``window`` steps and ``max_gap``; opts ``ra`` (kernel readahead on, the old
behaviour), ``nobuf`` (buffer 0: coalesced reads alone), ``serial`` (one read at a time, no threads);
``solar:auto`` = the plan ``SolarDataModule`` chooses (probe, window, gap, the buffer's memory shared with the
read-ahead thread). Every row gives its fraction of the device's bandwidth limit for ``1 - C/N`` of the file.

    sudo .venv/bin/python -m benchmarks.solar_slow_storage            # full run
    sudo .venv/bin/python -m benchmarks.solar_slow_storage --quick    # smoke run (under a minute)

The current result is two runs, the page cache uncapped and capped (``--headroom-mib 128``, 4096 samples: data
larger than memory), merged into ``results/solar_slow_storage.*`` with ``--merge <stored run> <stored run>``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KEYS = ["diffraction", "amplitude", "phase"]
DEFAULT_MODES = [
    "dl0",
    "dl2",
    "dl4",
    "solar:1:0:ra",
    "solar:1:0:serial:nobuf",
    "solar:1:0:serial",
    "solar:1:0",
    "solar:16:8:nobuf",
    "solar:16:8",
    "solar:auto",
]


def _auto_loader(path: str, samples: int, epochs: int, batch: int, buffer: int) -> Any:
    """A SolarLoader with the plan SolarDataModule would choose for this device and ``buffer`` samples of memory."""
    from lightning_sdp.datamodules.solar import SolarSchedule
    from lightning_sdp.datamodules.solar.loader import SolarLoader
    from lightning_sdp.datamodules.solar.reader import HDF5Reader
    from lightning_sdp.datamodules.solar.readplan import page_cache_holds, plan_reads, probe_storage

    reader = HDF5Reader(path, KEYS, io_threads=4)
    plan = plan_reads(
        num_samples=samples,
        world_size=1,
        ranks_per_device=1,
        batch_size=batch,
        memory_samples=buffer,
        row_nbytes=list(reader.info.row_nbytes.values()),
        storage=probe_storage(path, 4),
        page_cache=page_cache_holds(os.path.getsize(path)),
    )
    print(json.dumps({"mode": "solar:auto", "plan": plan.describe()}), flush=True)
    reader.max_gap = plan.max_gap
    schedule = SolarSchedule(samples, epochs, 1, batch, buffer_size=plan.buffer_samples, seed=0)
    return SolarLoader(
        schedule,
        0,
        reader,
        KEYS[0],
        KEYS[1:],
        read_window=plan.read_window,
        read_ahead_bytes=plan.read_ahead_samples * reader.info.sample_nbytes,
        read_across_epochs=False,  # epochs are measured one by one, each after a cache drop
    )


def _child(mode: str, path: str, samples: int, epochs: int, batch: int, buffer: int, headroom_mib: int) -> None:
    import torch
    from torch.utils.data import DataLoader

    from benchmarks.tools.device import ThrottleGroup
    from benchmarks.tools.storage import PerSampleHDF5Dataset
    from lightning_sdp.datamodules.solar import SolarSchedule
    from lightning_sdp.datamodules.solar.loader import SolarLoader
    from lightning_sdp.datamodules.solar.reader import HDF5Reader

    torch.set_num_threads(1)
    group = ThrottleGroup.from_env()
    assert group is not None, "run through ThrottledStorage.run"
    parts = mode.split(":")
    opts = set(parts[3:])
    loader = None
    if mode == "solar:auto":  # the plan SolarDataModule chooses: probe, window, gap and the memory split
        loader = _auto_loader(path, samples, epochs, batch, buffer)
    elif parts[0] == "solar":
        schedule = SolarSchedule(samples, epochs, 1, batch, buffer_size=0 if "nobuf" in opts else buffer, seed=0)
        reader = HDF5Reader(
            path, KEYS, max_gap=int(parts[2]), io_threads=1 if "serial" in opts else 4, readahead="ra" in opts
        )
        # epochs are measured one by one, each after a cache drop: no reading into the next epoch
        loader = SolarLoader(
            schedule, 0, reader, KEYS[0], KEYS[1:], read_window=int(parts[1]), read_across_epochs=False
        )
    else:
        schedule = SolarSchedule(samples, epochs, 1, batch, buffer_size=buffer, seed=0)
    if headroom_mib > 0:
        group.limit_memory(headroom_mib * 2**20)
    for epoch in range(epochs):
        # a fresh baseline dataset (and h5py handle) per epoch, made before the cache drop and the clock start
        dataset = PerSampleHDF5Dataset(path, KEYS[0], KEYS[1:]) if loader is None else None
        group.drop_caches()
        b0, r0, t0 = group.device_read_bytes(), group.device_read_requests(), time.perf_counter()
        n = 0
        if loader is not None:
            loader.set_epoch(epoch)
            for b in loader:
                n += len(b["input"])
        else:
            workers = int(parts[0][2:])
            order = schedule.permutation(epoch).tolist()
            dl = DataLoader(dataset, batch_size=batch, sampler=order, num_workers=workers)
            for b in dl:
                n += len(b[0])
        dt = time.perf_counter() - t0
        rss = 0
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM"):
                    rss = int(line.split()[1]) * 1024
        print(
            json.dumps(
                {
                    "mode": mode,
                    "epoch": epoch,
                    "samples": n,
                    "seconds": dt,
                    "samples_per_s": n / dt,
                    "device_mib": (group.device_read_bytes() - b0) / 2**20,
                    "device_requests": group.device_read_requests() - r0,
                    "peak_rss_mib": rss / 2**20,
                }
            ),
            flush=True,
        )


def _run_setting(args: dict) -> str:
    """The setting that tells stored runs apart: file size and page-cache cap."""
    headroom = args.get("headroom_mib") or 0
    cache = f"page cache capped at use + {headroom} MiB" if headroom else "page cache uncapped"
    return f"{args['samples']} samples of {args['size']}x{args['size']}, {cache}"


def merge_runs(runs: dict[str, tuple[dict, str]]) -> tuple[dict, str]:
    """One results set from stored runs of this benchmark; every number is kept as recorded.

    Args:
        runs: ``{run name: (its results JSON, its results markdown)}``; a run that is itself a merge contributes
            the runs it holds.

    Returns:
        ``(payload, markdown)``: ``payload["runs"]`` lists every run's JSON (with its name and markdown body);
        the markdown has one section per run (its machine line, description and table, verbatim) after a line
        naming the runs it came from.
    """
    flat: list[dict] = []
    for name, (payload, markdown) in runs.items():
        if "runs" in payload:
            flat += payload["runs"]
            continue
        body = markdown.split("\n\n", 1)[1] if markdown.startswith("# ") else markdown  # drop the "# name" title
        flat.append({"name": name, **payload, "markdown": body.strip()})
    names = [r["name"] for r in flat]
    if len(set(names)) != len(names):
        raise ValueError(f"--merge: a run is listed twice ({names}); name each stored run once")
    sections = [f"## {_run_setting(r['args'])} (run `{r['name']}`)\n\n{r['markdown']}" for r in flat]
    markdown = (
        "Merged from the stored runs "
        + ", ".join(f"`{n}`" for n in names)
        + " (numbers as recorded).\n\n"
        + "\n\n".join(sections)
    )
    return {"merged_from": names, "runs": flat}, markdown


def write_merged(name: str, run_names: list[str]) -> None:
    """Read ``results/<run>.{json,md}`` of every run, then write their merge to ``results/<name>.{json,md}``."""
    from benchmarks import _common

    runs = {}
    for run in run_names:
        stem = _common.RESULTS_DIR / run
        runs[run] = (json.loads(stem.with_suffix(".json").read_text()), stem.with_suffix(".md").read_text())
    payload, markdown = merge_runs(runs)
    out = _common.RESULTS_DIR / name
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    out.with_suffix(".md").write_text(f"# {name}\n\n{markdown.strip()}\n")
    print(f"wrote {out}.json and {out}.md from {', '.join(run_names)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--buffer-fraction", type=float, default=0.25)
    parser.add_argument("--bps", default="40MB")
    parser.add_argument("--iops", type=int, default=400)
    parser.add_argument("--readahead-kb", type=int, default=None, help="loop device readahead (default: kernel's)")
    parser.add_argument(
        "--headroom-mib",
        type=int,
        default=0,
        help="cap the group's memory at its use + this (0: no cap; the page cache may hold the file)",
    )
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--name", default="solar_slow_storage")
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="RUN",
        help="write results/<name>.* from these stored runs (results/<RUN>.json + .md), numbers unchanged; no run",
    )
    parser.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.merge:
        write_merged(args.name, args.merge)
        return 0
    if args.child:
        m, p, s, e, b, c, h = args.child
        _child(m, p, int(s), int(e), int(b), int(c), int(h))
        return 0
    from benchmarks._common import REPO_ROOT, machine_info, markdown_table, write_results
    from benchmarks.tools.device import ThrottledStorage, parse_bytes
    from lightning_sdp.datamodules.solar.ptycho import make_ptycho_h5

    if args.quick:
        # tiny: a 3 MiB file, the baseline and SOLAR with and without a read window (under a minute)
        args.samples, args.size, args.epochs, args.modes = 256, 32, 2, ["dl0", "solar:1:0", "solar:16:8", "solar:auto"]
        args.name += "_quick"
    buffer = int(round(args.buffer_fraction * args.samples))
    rows = []
    plans: dict[str, str] = {}
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        src = make_ptycho_h5(Path(tmp) / "ptycho.h5", args.samples, args.size, seed=0)
        file_mib = os.path.getsize(src) / 2**20
        try:
            storage = stack.enter_context(ThrottledStorage("512MiB", args.bps, args.iops, args.readahead_kb))
        except PermissionError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        path = str(storage.copy_in(src))
        facts = storage.facts()
        print(f"file {file_mib:.1f} MiB, buffer {buffer} samples; device {facts}", flush=True)
        for mode in args.modes:
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.solar_slow_storage",
                "--child",
                mode,
                path,
                str(args.samples),
                str(args.epochs),
                str(args.batch),
                str(buffer),
                str(args.headroom_mib),
            ]
            out = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                cwd=REPO_ROOT,
                env={**os.environ, **storage.env()},
                preexec_fn=storage.group_join,
            )
            for line in out.stdout.splitlines():
                if line.startswith("{"):
                    record = json.loads(line)
                    if "plan" in record:
                        plans[record["mode"]] = record["plan"]
                    else:
                        rows.append(record)
                    print(line, flush=True)
            if out.returncode:
                print(f"{mode}: exit {out.returncode}\n{out.stderr[-2000:]}", flush=True)
    summary = []
    sample_bytes = file_mib * 2**20 / args.samples
    bandwidth_limit = parse_bytes(args.bps) / (sample_bytes * (1 - buffer / args.samples))
    base = [r["samples_per_s"] for r in rows if r["mode"] == "dl0" and r["epoch"] > 0]
    base_sps = sum(base) / len(base) if base else float("nan")
    for mode in args.modes:
        later = [r for r in rows if r["mode"] == mode and r["epoch"] > 0]
        if not later:
            continue
        sps = sum(r["samples_per_s"] for r in later) / len(later)
        summary.append(
            {
                "mode": mode,
                "samples/s (later epochs)": round(sps, 1),
                "vs dl0": round(sps / base_sps, 2),
                "device MiB/epoch": round(sum(r["device_mib"] for r in later) / len(later), 1),
                "device requests/epoch": round(sum(r["device_requests"] for r in later) / len(later)),
                "peak RSS MiB": round(max(r["peak_rss_mib"] for r in later)),
                # the device's bandwidth limit for the bytes a buffer of C/N must leave to storage
                "of bandwidth limit for (1 - C/N)": round(sps / bandwidth_limit, 2),
            }
        )
    md = (
        f"File {file_mib:.1f} MiB ({args.samples} samples), buffer {buffer} samples "
        f"(C/N = {buffer / args.samples:.2f}, "
        f"so at most {(1 - buffer / args.samples) * file_mib:.1f} MiB/epoch for SOLAR), batch {args.batch}, "
        f"{args.epochs} epochs, one rank, page cache dropped before every epoch, memory headroom "
        f"{args.headroom_mib or 'uncapped'} MiB. Device: {facts}. 'later' = epochs after the first. Device bytes and "
        "requests from the blkio cgroup.\n\n"
        + markdown_table(summary)
        + "".join(f"\n\n{mode} chose: {plan}" for mode, plan in plans.items())
        + f"\n\nWall time {time.perf_counter() - start:.0f} s.\n"
    )
    print(md)
    write_results(
        args.name,
        {
            "args": vars(args),
            "device": facts,
            "summary": summary,
            "epochs": rows,
            "plans": plans,
            "machine": machine_info(),
        },
        md,
        None,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
