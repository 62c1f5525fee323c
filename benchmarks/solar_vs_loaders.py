"""SOLAR against the loaders users pick, training PtychoNN through ``Trainer`` with real DDP ranks on slow storage.

One HDF5 file (and its litdata / webdataset conversions) lies on a throttled loop device
(:mod:`benchmarks.tools.device`: cgroup ``read_bps`` + ``read_iops`` limits, page cache dropped before every
epoch). Every run is capped in memory, page cache included, at its processes' pinned baseline plus the loaders'
budget (:mod:`benchmarks.tools.arena`; ``--no-memory-cap`` lifts the cap); conversions run in the same cgroup. For every rank count P and loader, one child process inside the cgroups runs
``Trainer(accelerator="cpu", devices=P, strategy="ddp")`` (P real processes) fitting the PtychoNN-like surrogate
for a few epochs. Rank 0 records per epoch: wall time from the previous epoch's end (including the same validation
pass for all), samples/s, bytes and requests the
device served (cgroup counters, all ranks), peak RSS (rank 0); and the final validation loss (the same held-out
file, read unthrottled by a plain DataLoader for every loader).

Every loader gets the same memory (``--buffer-fraction`` of the samples, over all ranks): SOLAR's ``buffer_size``
(its buffer and read-ahead together), the DataLoaders' prefetched batches (``prefetch_factor`` = the budget's
samples per rank / (workers x batch), at least 2), litdata's ``max_cache_size``, webdataset's shuffle buffer. Loaders
(``--loaders``):

- ``dl0``, ``dl2``, ``dl4``: ``torch.utils.data.DataLoader`` + h5py per-sample reads, ``DistributedSampler``
  (exact per-epoch permutation), 0/2/4 workers.
- ``torchdata``: ``torchdata.stateful_dataloader.StatefulDataLoader``, same dataset and sampler, 2 workers.
- ``litdata``: ``litdata.StreamingDataset(shuffle=True)`` over chunks written by ``litdata.optimize`` (conversion
  time reported separately); chunk-level shuffle, not an exact per-sample permutation. 2 workers.
- ``webdataset``: tar shards (written once, time reported) read with ``shardshuffle`` + a shuffle buffer of the
  budget's samples (not an exact permutation), 2 workers.
- ``solar``: ``SolarDataModule`` defaults: the read plan chosen for the probed device, read by a background thread
  that goes on into the next epoch. ``solar_workers``: the same, read by one worker process per rank, one epoch at a
  time (what the thread buys). ``solar_nowarm``: the defaults with ``warm_page_cache=False`` (what streaming the file
  into a cold page cache buys). ``solar_exact``: ``read_window=1, max_gap=0`` (reads exactly the planned misses: the
  fewest bytes, more requests).
- ``memory``: the ceiling, not a loader: the whole file read into memory before ``fit`` (not timed), then a
  ``DataLoader`` over tensors with the same ``DistributedSampler``. No loader can beat its epoch time, which is the
  training and validation compute alone.

Run as root::

    .venv/bin/python -m benchmarks.solar_vs_loaders --quick   # smoke run
    .venv/bin/python -m benchmarks.solar_vs_loaders           # full run
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer

from benchmarks.tools.loaders import LOADERS, SHUFFLES, WORKERS, Peers, libraries_of, solar_datamodule

CONVERSIONS = {"litdata": ("litdata", "4MB"), "litdata_tuned": ("litdata", "256KB"), "webdataset": ("webdataset", "16")}
"""Loaders that read a converted copy of the file: the conversion's kind and its chunk bytes or shard count."""


def _child_cmd(cfg: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "benchmarks.solar_vs_loaders", "--child", json.dumps(cfg)]


# ----------------------------------------------------------------------------------------------------- child side
def _peak_rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return 0.0


def _solar_wait(trainer: Trainer) -> dict[str, float]:
    """Rank 0's seconds waiting for SOLAR batches and reading in this epoch (empty for other loaders)."""
    stats = getattr(trainer.train_dataloader, "epoch_stats", None)
    return {"wait_s_rank0": stats.wait_s, "read_s_rank0": stats.read_s} if stats is not None else {}


class _Probe(Callback):
    """Rank 0 records, per epoch: wall time, samples trained by all ranks, device bytes and requests, peak RSS.

    Args:
        group: the throttled device's cgroups (``None`` outside one: nothing is recorded).
        out: JSON file the epochs and the final validation loss are written to at the end of ``fit``.
    """

    def __init__(self, group: Any, out: str) -> None:
        self.group, self.out = group, out
        self.t0 = 0.0
        self.b0 = self.r0 = 0
        self.samples = 0  # trained this epoch by this rank: counted, since a loader may yield fewer than planned
        self.rows: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.samples += len(batch["input"] if isinstance(batch, dict) else batch[0])

    def _drop_and_start(self, trainer: Trainer) -> None:
        """Drop the page cache, then start the clock and the device counters (all ranks wait for it)."""
        trainer.strategy.barrier()
        if trainer.global_rank == 0 and self.group is not None:
            self.group.drop_caches()
            self.b0, self.r0 = self.group.device_read_bytes(), self.group.device_read_requests()
        trainer.strategy.barrier()
        self.t0 = time.perf_counter()
        self.samples = 0

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self._dump(trainer)  # the read plan, before anything can be killed
        self._drop_and_start(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        # Loader workers start reading when the epoch's iterator is made, before on_train_epoch_start, so an epoch
        # is measured from the previous epoch's end (after its cache drop) to this one's end; it includes the
        # validation pass, which is the same unthrottled file for every loader.
        import torch

        trainer.strategy.barrier()
        dt = time.perf_counter() - self.t0
        samples = int(trainer.strategy.reduce(torch.tensor(float(self.samples)), reduce_op="sum"))
        if trainer.global_rank == 0 and self.group is not None:
            self.rows.append(
                {
                    "epoch": trainer.current_epoch,
                    "seconds": dt,
                    "samples": samples,
                    "samples_per_s": samples / dt,
                    "device_mib": (self.group.device_read_bytes() - self.b0) / 2**20,
                    "device_requests": self.group.device_read_requests() - self.r0,
                    "peak_rss_mib_rank0": _peak_rss_mib(),
                    **_solar_wait(trainer),
                }
            )
        self._dump(trainer)
        self._drop_and_start(trainer)

    def on_fit_end(self, trainer: Trainer, pl_module: Any) -> None:
        self._dump(trainer, finished=True)

    def _dump(self, trainer: Trainer, finished: bool = False) -> None:
        """Write what was measured so far (rank 0): a run killed for time or memory leaves its finished epochs."""
        if trainer.global_rank != 0:
            return
        val = trainer.callback_metrics.get("val/loss")
        plan = getattr(trainer.datamodule, "read_plan", None)
        # a plain write: a run killed in the middle of it leaves a file that reads as nothing (see _partial)
        Path(self.out).write_text(
            json.dumps(
                {
                    "epochs": self.rows,
                    "val_loss": float(val) if val is not None else None,
                    "read_plan": plan.describe() if plan is not None else None,
                    "finished": finished,
                }
            )
        )


def _train(cfg: dict[str, Any]) -> None:
    """Child process: fit PtychoNN with one loader on ``cfg["ranks"]`` DDP ranks, recording through :class:`_Probe`."""
    import torch

    from benchmarks.tools.device import ThrottleGroup
    from lightning_sdp.models.ptychonn import PtychoNN

    torch.set_num_threads(1)
    for module in cfg.get("imports", ()):  # a baseline run imports the libraries of the loader it calibrates
        importlib.import_module(module)
    dm = solar_datamodule(cfg) if cfg["loader"].startswith("solar") else Peers(cfg)
    torch.manual_seed(0)
    model = PtychoNN(image_size=cfg["size"], base_channels=cfg["channels"], depth=2)
    ranks = cfg["ranks"]
    trainer = Trainer(
        accelerator="cpu",
        devices=ranks,
        strategy="ddp" if ranks > 1 else "auto",
        max_epochs=cfg["epochs"],
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_Probe(ThrottleGroup.from_env(), cfg["out"])],
        num_sanity_val_steps=0,
    )
    trainer.fit(model, dm)


def _partial(out: Path) -> dict[str, Any]:
    """What a run that did not finish wrote before it ended (its finished epochs, its read plan); ``{}``: nothing."""
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads(out.read_text()))
    return {}


def _last_line(text: str) -> str:
    """The last non-empty line of a run's error output that is not a warning (the exception, or the last log line
    before a kill)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    telling = [line for line in lines if "Warning" not in line and "deprecated" not in line]
    return (telling or lines or [""])[-1][-300:]


def _failure(row: dict[str, Any] | None) -> str:
    """``"timed out after 300 s, 2 epochs done (41.3 samples/s)"``: a run's status where its speed would be."""
    if row is None:
        return "failed"
    status = {"failed (timeout)": f"timed out after {row.get('after_s', 0):.0f} s"}.get(row["failed"], row["failed"])
    done = [e for e in row.get("epochs_done", []) if e.get("epoch", 0) > 0]
    if not done:
        return f"{status}, no epoch after the first done" if row.get("epochs_done") else status
    sps = sum(e["samples_per_s"] for e in done) / len(done)
    return f"{status}, {len(row['epochs_done'])} epochs done ({sps:.1f} samples/s after the first)"


def _summarise(rows: list[dict[str, Any]], rank_counts: list[int], loaders: list[str]) -> list[dict[str, Any]]:
    """One row per (ranks, loader): means over the epochs after the first, relative to the best DataLoader and to
    the in-memory ceiling of the same rank count."""
    summary = []
    for ranks in rank_counts:

        def later_epochs(*loaders: str, ranks: int = ranks) -> list[dict[str, Any]]:
            return [r for r in rows if r["ranks"] == ranks and r["loader"] in loaders and r.get("epoch", 0) > 0]

        best_dl = max((r["samples_per_s"] for r in later_epochs("dl0", "dl2", "dl4")), default=float("nan"))
        ceiling = [r["samples_per_s"] for r in later_epochs("memory")]
        memory = sum(ceiling) / len(ceiling) if ceiling else float("nan")
        for loader in loaders:
            later = later_epochs(loader)
            if not later:
                failed = [r for r in rows if r["ranks"] == ranks and r["loader"] == loader and "failed" in r]
                summary.append({"P": ranks, "loader": loader, "samples/s": _failure(failed[0] if failed else None)})
                continue
            sps = sum(r["samples_per_s"] for r in later) / len(later)
            summary.append(
                {
                    "P": ranks,
                    "loader": loader,
                    "samples/s": round(sps, 1),
                    "vs best DataLoader": round(sps / best_dl, 2),
                    "of in-memory ceiling": round(sps / memory, 2),
                    "epoch s": round(sum(r["seconds"] for r in later) / len(later), 2),
                    "samples/epoch": round(sum(r["samples"] for r in later) / len(later)),
                    "device MiB/epoch": round(sum(r["device_mib"] for r in later) / len(later), 1),
                    "device requests/epoch": round(sum(r["device_requests"] for r in later) / len(later)),
                    "peak RSS MiB (rank 0)": round(max(r["peak_rss_mib_rank0"] for r in later)),
                    "memory cap MiB": None if later[0]["memory_cap_mib"] is None else round(later[0]["memory_cap_mib"]),
                    "pinned peak MiB": round(later[0]["pinned_peak_mib"]),
                    "final val loss": round(later[-1]["val_loss"], 4) if later[-1]["val_loss"] is not None else None,
                    "shuffle": SHUFFLES.get(loader, "?"),
                }
            )
    return summary


# ------------------------------------------------------------------------------------------------------ controller
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2048, help="training samples (file = 4x the buffer)")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--channels", type=int, default=4, help="PtychoNN base channels (small: loading-bound)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="local batch size")
    parser.add_argument("--buffer-fraction", type=float, default=0.25)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--loaders", nargs="+", default=LOADERS)
    parser.add_argument("--solar-workers", type=int, default=0, help="SOLAR reader processes per rank (0: a thread)")
    parser.add_argument("--bps", default="40MB")
    parser.add_argument("--iops", type=int, default=400)
    parser.add_argument("--readahead-kb", type=int, default=None)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per (loader, ranks) run")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--name", default="solar_vs_loaders")
    parser.add_argument(
        "--no-memory-cap",
        dest="memory_cap",
        action="store_false",
        help="run the loaders without the cgroup memory cap (baseline + budget); the page cache is then unbounded",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _train(json.loads(args.child))
        return 0
    from benchmarks._common import REPO_ROOT, machine_info, markdown_table, write_results
    from benchmarks.tools.arena import SMOKE_SLACK, SMOKE_SLACK_NOTE, Arena, run_json
    from benchmarks.tools.device import ThrottledStorage
    from lightning_sdp.datamodules.solar.ptycho import make_ptycho_h5

    if args.quick:
        # tiny: one rank, the plain DataLoader and SOLAR with its read window (well under a minute)
        args.samples, args.epochs, args.ranks, args.size, args.batch = 256, 2, [1], 64, 16
        args.loaders = ["dl0", "solar"]
        args.name += "_quick"
    buffer = int(round(args.buffer_fraction * args.samples))
    rows: list[dict[str, Any]] = []
    plans: dict[str, str] = {}
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        src = str(make_ptycho_h5(Path(tmp) / "train.h5", args.samples, args.size, seed=0))
        val = str(make_ptycho_h5(Path(tmp) / "val.h5", 256, args.size, seed=1))
        file_mib = os.path.getsize(src) / 2**20
        sample_nbytes = os.path.getsize(src) // args.samples
        try:
            storage = stack.enter_context(
                ThrottledStorage(f"{max(512, int(5 * file_mib) + 64)}MiB", args.bps, args.iops, args.readahead_kb)
            )
            Arena(storage, 0, 1, REPO_ROOT)  # needs a memory controller too
        except PermissionError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        h5 = str(storage.copy_in(src))
        assert storage.mount is not None
        arena = Arena(
            storage, buffer * sample_nbytes, args.timeout, REPO_ROOT, slack_bytes=SMOKE_SLACK if args.quick else 0
        )
        conversions: dict[str, Any] = {}
        wds_paths: list[str] = []
        for loader, (kind, param) in CONVERSIONS.items():
            if loader in args.loaders:  # in the cgroup, reading the source from the device: timed and counted
                out = Path(tmp) / f"convert_{loader}.json"
                cmd = [sys.executable, "-m", "benchmarks.tools.loaders", kind, h5, str(storage.mount / loader)]
                run, result = run_json(arena, [*cmd, str(args.samples), param, str(out)], out, None)
                if result is None:
                    print(f"conversion {loader} failed ({run.rc})\n{run.stderr_tail}", file=sys.stderr)
                    return 1
                conversions[loader] = {**run.to_dict(), "seconds": result["seconds"]}
                wds_paths = result["paths"] if kind == "webdataset" else wds_paths
        os.sync()
        facts = storage.facts()
        print(f"file {file_mib:.1f} MiB, buffer {buffer}; conversions {conversions}; device {facts}", flush=True)
        for ranks in args.ranks:
            for loader in args.loaders:
                out = Path(tmp) / f"{loader}_{ranks}.json"
                cfg = {
                    "loader": loader,
                    "ranks": ranks,
                    "batch": args.batch,
                    "epochs": args.epochs,
                    "h5": h5,
                    "val": val,
                    "litdata": str(storage.mount / "litdata"),
                    "litdata_tuned": str(storage.mount / "litdata_tuned"),
                    "litdata_cache": str(storage.mount / "litcache"),
                    "wds": wds_paths,
                    "buffer": buffer,
                    "budget_per_rank": buffer // ranks,
                    "budget_bytes_per_rank": buffer // ranks * sample_nbytes,
                    "size": args.size,
                    "channels": args.channels,
                    "solar_workers": args.solar_workers,
                    "out": str(out),
                    "train_samples": (args.samples // (ranks * args.batch)) * ranks * args.batch,
                }
                workers = args.solar_workers if loader == "solar" else WORKERS.get(loader, 0)
                null = {**cfg, "loader": "null", "workers": workers, "epochs": 1, "out": str(Path(tmp) / "null.json")}
                null["imports"] = libraries_of(loader)
                # every loader's processes get their pinned baseline plus the budget; memory (the ceiling) is uncapped
                capped = args.memory_cap and loader != "memory"
                cap = arena.cap((ranks, workers, *null["imports"]), _child_cmd(null)) if capped else None
                run, result = run_json(arena, _child_cmd(cfg), out, cap)
                if result is None:
                    status = "oom-killed" if run.oom_kills else f"failed ({run.rc})"
                    print(f"P={ranks} {loader}: {status}\n{run.stderr_tail}", flush=True)
                    partial = _partial(out)
                    if partial.get("read_plan"):
                        plans[f"{loader} P={ranks}"] = partial["read_plan"]
                    rows.append(
                        {
                            "ranks": ranks,
                            "loader": loader,
                            "failed": status,
                            "after_s": round(run.seconds, 1),
                            "memory_peak_mib": round(run.memory_peak_mib, 1),
                            "epochs_done": partial.get("epochs", []),
                            "error": _last_line(run.stderr_tail),
                        }
                    )
                    continue
                costs = {"memory_cap_mib": run.memory_cap_mib, "pinned_peak_mib": run.pinned_peak_mib}
                result = json.loads(out.read_text())
                for e in result["epochs"]:
                    rows.append({"ranks": ranks, "loader": loader, **e, "val_loss": result["val_loss"], **costs})
                if result.get("read_plan"):
                    plans[f"{loader} P={ranks}"] = result["read_plan"]
                print(
                    f"P={ranks} {loader}: "
                    + " ".join(
                        f"e{e['epoch']}:{e['samples_per_s']:.0f}/s,{e['device_mib']:.0f}MiB" for e in result["epochs"]
                    )
                    + f" val {result['val_loss']:.4f} ({run.seconds:.0f}s)",
                    flush=True,
                )
    summary = _summarise(rows, args.ranks, args.loaders)
    memory_note = (
        "every loader but memory in the cgroup capped at its pinned baseline (the same processes on zeros) + the "
        "budget, page cache included" + ("," + SMOKE_SLACK_NOTE if args.quick else "")
        if args.memory_cap
        else "uncapped (--no-memory-cap)"
    )
    md = (
        f"Training PtychoNN (base channels {args.channels}, depth 2, {args.size}x{args.size}) through Trainer with P "
        f"real DDP processes (gloo, CPU). File {file_mib:.1f} MiB ({args.samples} samples). Every loader gets the "
        f"same memory, {buffer} samples ({buffer * sample_nbytes / 2**20:.1f} MiB, C/N = {buffer / args.samples:.2f}) "
        "over all ranks: SOLAR's buffer_size (buffer and read-ahead together), the DataLoaders' and torchdata's "
        "prefetched batches (prefetch_factor), litdata's max_cache_size, webdataset's shuffle buffer; "
        f"local batch {args.batch}; {args.epochs} epochs; page cache dropped before every epoch. Device: {facts}. "
        f"Memory: {memory_note}. Conversions (in the cgroup, reading the source from the device): {conversions}. "
        "Columns are means over the epochs "
        "after the first; an epoch runs from the previous epoch's end (cache dropped) to this one's end and includes "
        "the same validation pass (256 samples, unthrottled) for every loader; samples/s counts the training samples "
        "the ranks actually received in the epoch (samples/epoch; a loader that yields fewer than the file's "
        f"{args.samples} is not credited for the missing ones); "
        "device bytes and requests from the blkio cgroup (all ranks). `memory` is the ceiling, not a loader: the "
        "file read into memory before fit (not timed), so its epoch is the compute alone; a loader's speed-up over "
        "the DataLoader cannot exceed memory's.\n\n"
        + markdown_table(summary)
        + "\n\nSOLAR's read plans, chosen at setup from the probed device:\n\n"
        + "".join(f"- {k}: {v}\n" for k, v in plans.items())
        + f"\nWall time {time.perf_counter() - start:.0f} s.\n"
    )
    print(md)
    write_results(
        args.name,
        {
            "args": vars(args),
            "device": facts,
            "conversions": conversions,
            "read_plans": plans,
            "summary": summary,
            "epochs": rows,
            "machine": machine_info(),
        },
        md,
        None,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
