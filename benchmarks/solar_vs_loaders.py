"""SOLAR against the loaders users pick, training PtychoNN through ``Trainer`` with real DDP ranks on slow storage.

One HDF5 file (and its litdata / webdataset conversions) lies on a throttled loop device
(:mod:`benchmarks._throttled_storage`: blkio ``read_bps`` + ``read_iops`` limits, page cache dropped before every
epoch). For every rank count P and loader, one child process inside the cgroups runs
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
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningDataModule, Trainer

KEYS = ["diffraction", "amplitude", "phase"]
LOADERS = ["memory", "dl0", "dl2", "dl4", "torchdata", "litdata", "webdataset"]
LOADERS += ["solar", "solar_nowarm", "solar_workers", "solar_exact"]


SHUFFLES = {
    "memory": "exact",
    "dl0": "exact",
    "dl2": "exact",
    "dl4": "exact",
    "torchdata": "exact",
    "litdata": "chunks",
    "webdataset": "shards + buffer",
    "solar": "exact",
    "solar_nowarm": "exact",
    "solar_workers": "exact",
    "solar_exact": "exact",
}
"""How each loader shuffles: an exact per-epoch permutation of the samples, or an approximation of one."""


# ----------------------------------------------------------------------------------------------------- child side
def _peak_rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return 0.0


def _val_loader(cfg: dict[str, Any]) -> Any:
    """The held-out file, read unthrottled by a plain DataLoader: the same validation pass for every loader."""
    from torch.utils.data import DataLoader

    from benchmarks.tools.storage import PerSampleHDF5Dataset

    return DataLoader(PerSampleHDF5Dataset(cfg["val"], KEYS[0], KEYS[1:]), batch_size=64, num_workers=0)


def _memory_loader(cfg: dict[str, Any], rank: int, world: int) -> Any:
    """The ceiling: the whole file read into memory first, then a DataLoader over tensors."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from benchmarks.tools.storage import PerSampleHDF5Dataset

    ds = PerSampleHDF5Dataset(cfg["h5"], KEYS[0], KEYS[1:])
    tensors = [torch.stack(t) for t in zip(*(ds[i] for i in range(len(ds))), strict=True)]
    ram = TensorDataset(*tensors)
    sampler = DistributedSampler(ram, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    return DataLoader(ram, batch_size=cfg["batch"], sampler=sampler, num_workers=0)


def _h5py_loader(cfg: dict[str, Any], rank: int, world: int) -> Any:
    """``dl<W>`` (torch DataLoader with W workers) or ``torchdata`` (StatefulDataLoader, 2 workers): h5py reads."""
    from torch.utils.data import DataLoader, DistributedSampler

    from benchmarks.tools.storage import PerSampleHDF5Dataset

    loader = cfg["loader"]
    ds = PerSampleHDF5Dataset(cfg["h5"], KEYS[0], KEYS[1:])
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    workers = int(loader[2:]) if loader.startswith("dl") else 2
    # equal memory: the workers may hold as many prefetched batches as the budget's samples allow (at least 2)
    prefetch = max(2, cfg["budget_per_rank"] // max(1, workers * cfg["batch"]))
    extra = {"persistent_workers": True, "prefetch_factor": prefetch} if workers else {}
    if loader == "torchdata":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(ds, batch_size=cfg["batch"], sampler=sampler, num_workers=workers, **extra)
    return DataLoader(ds, batch_size=cfg["batch"], sampler=sampler, num_workers=workers, **extra)


def _litdata_loader(cfg: dict[str, Any]) -> Any:
    from litdata import StreamingDataLoader, StreamingDataset

    # litdata copies chunks into cache_dir; keep that on the throttled device too, or later epochs would read the
    # copies from the unthrottled disk
    # equal memory: litdata keeps at most the budget's bytes of chunks in its cache
    budget = f"{max(1, cfg['budget_bytes_per_rank'] // 10**6)}MB"
    ds = StreamingDataset(
        cfg["litdata"], cache_dir=cfg["litdata_cache"], shuffle=True, drop_last=True, seed=0, max_cache_size=budget
    )
    return StreamingDataLoader(ds, batch_size=cfg["batch"], num_workers=2, collate_fn=_lit_collate)


def _webdataset_loader(cfg: dict[str, Any], world: int) -> Any:
    import torch
    import webdataset as wds

    batch = cfg["batch"]
    steps = cfg["train_samples"] // (world * batch)
    pipe = (
        wds.WebDataset(
            cfg["wds"],
            shardshuffle=len(cfg["wds"]),
            nodesplitter=wds.split_by_node,
            workersplitter=wds.split_by_worker,
            empty_check=False,
            seed=0,
        )
        .repeat()
        .shuffle(cfg["budget_per_rank"])  # equal memory: a shuffle buffer of the budget's samples
        .decode()
        .to_tuple("x.npy", "y.npy")
        .map(lambda s: (torch.from_numpy(s[0]), torch.from_numpy(s[1])))
        .batched(batch, partial=False)
    )
    return wds.WebLoader(pipe, batch_size=None, num_workers=2).with_epoch(steps).with_length(steps)


def _peer_loader(cfg: dict[str, Any], rank: int, world: int) -> Any:
    """This rank's training loader for every ``--loaders`` entry except SOLAR's."""
    loader = cfg["loader"]
    if loader == "memory":
        return _memory_loader(cfg, rank, world)
    if loader.startswith("dl") or loader == "torchdata":
        return _h5py_loader(cfg, rank, world)
    if loader == "litdata":
        return _litdata_loader(cfg)
    if loader == "webdataset":
        return _webdataset_loader(cfg, world)
    raise ValueError(f"unknown loader {loader!r}; choose from {LOADERS}")


class _Peers(LightningDataModule):
    """A peer loader (see :func:`_peer_loader`) with the shared validation set."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg

    def train_dataloader(self) -> Any:
        return _peer_loader(self.cfg, self.trainer.global_rank, self.trainer.world_size)

    def val_dataloader(self) -> Any:
        return _val_loader(self.cfg)


def _solar_datamodule(cfg: dict[str, Any]) -> Any:
    """``SolarDataModule`` with its defaults (``solar``) or the exact plan (``solar_exact``), shared validation set."""
    from lightning_sdp.datamodules.solar import SolarDataModule, SolarReadOptions

    reads = SolarReadOptions()
    if cfg["loader"] == "solar_exact":
        reads = SolarReadOptions(read_window=1, max_gap=0)
    if cfg["loader"] == "solar_nowarm":  # the same plan without the page-cache warmer: what the warmer buys
        reads = SolarReadOptions(warm_page_cache=False)
    dm = SolarDataModule(
        cfg["h5"],
        KEYS[0],
        KEYS[1:],
        batch_size=cfg["batch"],
        buffer_size=cfg["buffer"],
        # solar_workers: the same plan read by a worker process per rank, one epoch at a time (no read-ahead thread)
        num_workers=1 if cfg["loader"] == "solar_workers" else cfg["solar_workers"],
        seed=0,
        log_metrics=False,
        batch_format="dict",  # PtychoNN's loss_scale: the global-mean gradient with SOLAR's unequal local batches
        reads=reads,
    )
    dm.val_dataloader = lambda: _val_loader(cfg)  # the same held-out set for every loader
    return dm


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
        self._drop_and_start(trainer)

    def on_fit_end(self, trainer: Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            val = trainer.callback_metrics.get("val/loss")
            with open(self.out, "w") as fh:
                plan = getattr(trainer.datamodule, "read_plan", None)
                json.dump(
                    {
                        "epochs": self.rows,
                        "val_loss": float(val) if val is not None else None,
                        "read_plan": plan.describe() if plan is not None else None,
                    },
                    fh,
                )


def _train(cfg: dict[str, Any]) -> None:
    """Child process: fit PtychoNN with one loader on ``cfg["ranks"]`` DDP ranks, recording through :class:`_Probe`."""
    import torch

    from benchmarks._throttled_storage import ThrottleGroup
    from lightning_sdp.models.ptychonn import PtychoNN

    torch.set_num_threads(1)
    dm = _solar_datamodule(cfg) if cfg["loader"].startswith("solar") else _Peers(cfg)
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


def _lit_collate(items: list[dict[str, Any]]):
    import torch

    x = torch.stack([torch.as_tensor(i["x"]) for i in items])
    y = torch.stack([torch.as_tensor(i["y"]) for i in items])
    return x, y


# ---------------------------------------------------------------------------------------------------- conversions
def _lit_item(i: int, path: str = "") -> dict[str, Any]:
    import h5py

    with h5py.File(path, "r") as f:
        import numpy as np

        return {"x": f["diffraction"][i], "y": np.concatenate([f["amplitude"][i], f["phase"][i]], axis=0)}


def _convert_litdata(src: str, dst: str, n: int) -> float:
    import functools

    from litdata import optimize

    t0 = time.perf_counter()
    optimize(
        fn=functools.partial(_lit_item, path=src),
        inputs=list(range(n)),
        output_dir=dst,
        chunk_bytes="4MB",
        num_workers=1,
        verbose=False,
    )
    return time.perf_counter() - t0


def _convert_webdataset(src: str, dst_dir: Path, n: int, shards: int) -> tuple[list[str], float]:
    import h5py
    import numpy as np
    import webdataset as wds

    t0 = time.perf_counter()
    dst_dir.mkdir(parents=True, exist_ok=True)
    per = -(-n // shards)
    with h5py.File(src, "r") as f:
        x, a, p = (f[k][:n] for k in KEYS)
    paths = []
    for s in range(shards):
        path = dst_dir / f"shard-{s:04d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(s * per, min((s + 1) * per, n)):
                sink.write({"__key__": f"{i:08d}", "x.npy": x[i], "y.npy": np.concatenate([a[i], p[i]], axis=0)})
        paths.append(str(path))
    return paths, time.perf_counter() - t0


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
                summary.append({"P": ranks, "loader": loader, "samples/s": "failed"})
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
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _train(json.loads(args.child))
        return 0
    from benchmarks._common import REPO_ROOT, machine_info, markdown_table, write_results
    from benchmarks._throttled_storage import ThrottledStorage
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
                ThrottledStorage(f"{max(256, int(4 * file_mib) + 64)}MiB", args.bps, args.iops, args.readahead_kb)
            )
        except PermissionError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        h5 = str(storage.copy_in(src))
        assert storage.mount is not None
        conversions = {}
        lit_dir = str(storage.mount / "litdata")
        if "litdata" in args.loaders:
            conversions["litdata_s"] = _convert_litdata(src, lit_dir, args.samples)
        wds_paths: list[str] = []
        if "webdataset" in args.loaders:
            wds_paths, conversions["webdataset_s"] = _convert_webdataset(src, storage.mount / "wds", args.samples, 16)
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
                    "litdata": lit_dir,
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
                cmd = [sys.executable, "-m", "benchmarks.solar_vs_loaders", "--child", json.dumps(cfg)]
                t0 = time.perf_counter()
                try:
                    res = subprocess.run(
                        cmd,
                        capture_output=True,
                        text=True,
                        cwd=REPO_ROOT,
                        timeout=args.timeout,
                        env={**os.environ, **storage.env()},
                        preexec_fn=storage.group_join,
                    )
                    rc, err = res.returncode, res.stderr
                except subprocess.TimeoutExpired as exc:
                    rc, err = "timeout", str(exc.stderr or "")[-2000:]
                if rc != 0 or not out.exists():
                    print(f"P={ranks} {loader}: failed ({rc})\n{err[-3000:]}", flush=True)
                    rows.append({"ranks": ranks, "loader": loader, "failed": str(rc)})
                    continue
                result = json.loads(out.read_text())
                for e in result["epochs"]:
                    rows.append({"ranks": ranks, "loader": loader, **e, "val_loss": result["val_loss"]})
                if result.get("read_plan"):
                    plans[f"{loader} P={ranks}"] = result["read_plan"]
                print(
                    f"P={ranks} {loader}: "
                    + " ".join(
                        f"e{e['epoch']}:{e['samples_per_s']:.0f}/s,{e['device_mib']:.0f}MiB" for e in result["epochs"]
                    )
                    + f" val {result['val_loss']:.4f} ({time.perf_counter() - t0:.0f}s)",
                    flush=True,
                )
    summary = _summarise(rows, args.ranks, args.loaders)
    md = (
        f"Training PtychoNN (base channels {args.channels}, depth 2, {args.size}x{args.size}) through Trainer with P "
        f"real DDP processes (gloo, CPU). File {file_mib:.1f} MiB ({args.samples} samples). Every loader gets the "
        f"same memory, {buffer} samples ({buffer * sample_nbytes / 2**20:.1f} MiB, C/N = {buffer / args.samples:.2f}) "
        "over all ranks: SOLAR's buffer_size (buffer and read-ahead together), the DataLoaders' and torchdata's "
        "prefetched batches (prefetch_factor), litdata's max_cache_size, webdataset's shuffle buffer; "
        f"local batch {args.batch}; {args.epochs} epochs; page cache dropped before every epoch. Device: {facts}. "
        f"Conversions (unthrottled source, written to the device): {conversions}. Columns are means over the epochs "
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
