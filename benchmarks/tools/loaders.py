"""The loaders the SOLAR benchmarks compare, built in a training child process from one JSON-able configuration.

``cfg`` keys: ``loader`` (one of :data:`LOADERS` or ``"null"``), ``h5`` (training file), ``val`` (held-out file),
``batch`` (local batch), ``buffer`` (the memory budget in samples, all ranks), ``budget_per_rank`` and
``budget_bytes_per_rank``, ``litdata`` / ``litdata_tuned`` / ``litdata_cache`` (folders), ``wds`` (shard paths),
``train_samples``, ``solar_workers``. Every loader gets the same memory budget: SOLAR's ``buffer_size`` (buffer and
read-ahead), the DataLoaders' prefetched batches, litdata's ``max_cache_size``, webdataset's shuffle buffer.

- ``memory``: the whole file read into memory before ``fit``, then a ``DataLoader`` (the full-shuffle reference).
- ``dl0`` / ``dl2`` / ``dl4``: ``DataLoader`` + h5py per-sample reads, ``DistributedSampler``, 0/2/4 workers;
  ``torchdata``: ``StatefulDataLoader``, the same, 2 workers.
- ``litdata``: ``StreamingDataset(shuffle=True)`` over 4 MB chunks written by ``litdata.optimize`` (its default
  chunk shuffle); ``litdata_tuned``: chunks of 256 KB (about five samples: closer to a sample shuffle, more requests).
- ``webdataset``: tar shards, ``shardshuffle`` + shuffle buffers of the budget's samples (split between workers).
- ``solar`` (defaults), ``solar_nowarm``, ``solar_workers``, ``solar_exact``: ``SolarDataModule``.
- ``null``: zeros of the samples' shapes, no reads (calibrates a process's memory without data); ``null_workers``
  as many worker processes as a loader (``cfg["workers"]``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule

KEYS = ["diffraction", "amplitude", "phase"]
LOADERS = ["memory", "dl0", "dl2", "dl4", "torchdata", "litdata", "webdataset"]
LOADERS += ["solar", "solar_nowarm", "solar_workers", "solar_exact", "litdata_tuned"]
WORKERS = {"dl0": 0, "dl2": 2, "dl4": 4, "torchdata": 2, "litdata": 2, "litdata_tuned": 2, "webdataset": 2}
WORKERS.update(memory=0, solar=0, solar_nowarm=0, solar_exact=0, solar_workers=1)
"""Worker processes per rank of each loader (SOLAR's default reads in a thread of the rank's process)."""


LIBRARIES = {"solar": ("h5py", "lightning_sdp.datamodules.solar"), "dl": ("h5py",), "litdata": ("litdata",)}
LIBRARIES.update(webdataset=("webdataset",), torchdata=("h5py", "torchdata"))
"""Modules each family of loaders imports (its code, not its data): a memory baseline imports them too, so that the
budget pays for data and buffers only."""


def libraries_of(loader: str) -> tuple[str, ...]:
    """The modules ``loader`` imports (:data:`LIBRARIES`, by the loader's family: ``solar_exact`` is ``solar``)."""
    family = next((f for f in sorted(LIBRARIES, key=len, reverse=True) if loader.startswith(f)), None)
    return LIBRARIES[family] if family is not None else ()


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
    "litdata_tuned": "chunks (256 KB)",
}
"""How each loader shuffles: an exact per-epoch permutation of the samples, or an approximation of one."""


# ----------------------------------------------------------------------------------------------------- child side
def val_loader(cfg: dict[str, Any]) -> Any:
    """The held-out file, read unthrottled by a plain DataLoader: the same validation pass for every loader."""
    from torch.utils.data import DataLoader

    from benchmarks.tools.storage import PerSampleHDF5Dataset

    return DataLoader(PerSampleHDF5Dataset(cfg["val"], KEYS[0], KEYS[1:]), batch_size=64, num_workers=0)


def memory_loader(cfg: dict[str, Any], rank: int, world: int) -> Any:
    """The ceiling: the whole file read into memory first, then a DataLoader over tensors."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from benchmarks.tools.storage import PerSampleHDF5Dataset

    ds = PerSampleHDF5Dataset(cfg["h5"], KEYS[0], KEYS[1:])
    tensors = [torch.stack(t) for t in zip(*(ds[i] for i in range(len(ds))), strict=True)]
    ram = TensorDataset(*tensors)
    sampler = DistributedSampler(ram, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    return DataLoader(ram, batch_size=cfg["batch"], sampler=sampler, num_workers=0)


def h5py_loader(cfg: dict[str, Any], rank: int, world: int) -> Any:
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


def litdata_loader(cfg: dict[str, Any]) -> Any:
    """litdata's chunk shuffle over ``cfg["litdata"]`` (``litdata_tuned``: over ``cfg["litdata_tuned"]``)."""
    from litdata import StreamingDataLoader, StreamingDataset

    # litdata copies chunks into cache_dir; keep that on the throttled device too, or later epochs would read the
    # copies from the unthrottled disk
    # equal memory: litdata keeps at most the budget's bytes of chunks in its cache
    budget = f"{max(1, cfg['budget_bytes_per_rank'] // 10**6)}MB"
    ds = StreamingDataset(
        cfg[cfg["loader"]], cache_dir=cfg["litdata_cache"], shuffle=True, drop_last=True, seed=0, max_cache_size=budget
    )
    return StreamingDataLoader(ds, batch_size=cfg["batch"], num_workers=2, collate_fn=_lit_collate)


def webdataset_loader(cfg: dict[str, Any], world: int) -> Any:
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
        # equal memory: every worker keeps its own shuffle buffer, so the budget's samples are split between them
        .shuffle(max(1, cfg["budget_per_rank"] // WORKERS["webdataset"]))
        .decode()
        .to_tuple("x.npy", "y.npy")
        .map(lambda s: (torch.from_numpy(s[0]), torch.from_numpy(s[1])))
        .batched(batch, partial=False)
    )
    return wds.WebLoader(pipe, batch_size=None, num_workers=2).with_epoch(steps).with_length(steps)


class _Zeros:
    """``n`` samples of zeros shaped as the training file's input and joined targets (nothing is read)."""

    def __init__(self, n: int, shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
        self.n, self.shapes = n, shapes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        import torch

        return torch.zeros(self.shapes[0]), torch.zeros(self.shapes[1])


def null_loader(cfg: dict[str, Any], rank: int, world: int) -> Any:
    """A process's memory without data: zeros through a ``DataLoader`` with ``cfg["workers"]`` workers."""
    import h5py
    from torch.utils.data import DataLoader, DistributedSampler

    with h5py.File(cfg["h5"], "r") as f:
        x, targets = f[KEYS[0]], [f[k] for k in KEYS[1:]]
        shapes = (tuple(x.shape[1:]), (sum(t.shape[1] for t in targets), *targets[0].shape[2:]))
        n = int(x.shape[0])
    ds = _Zeros(n, shapes)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    workers = int(cfg.get("workers", 0))
    extra = {"persistent_workers": True, "prefetch_factor": 2} if workers else {}
    return DataLoader(ds, batch_size=cfg["batch"], sampler=sampler, num_workers=workers, **extra)


def peer_loader(cfg: dict[str, Any], rank: int, world: int) -> Any:
    """This rank's training loader for every ``--loaders`` entry except SOLAR's."""
    loader = cfg["loader"]
    if loader == "memory":
        return memory_loader(cfg, rank, world)
    if loader.startswith("dl") or loader == "torchdata":
        return h5py_loader(cfg, rank, world)
    if loader in ("litdata", "litdata_tuned"):
        return litdata_loader(cfg)
    if loader == "null":
        return null_loader(cfg, rank, world)
    if loader == "webdataset":
        return webdataset_loader(cfg, world)
    raise ValueError(f"unknown loader {loader!r}; choose from {LOADERS}")


class Peers(LightningDataModule):
    """A peer loader (see :func:`peer_loader`) with the shared validation set."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg

    def train_dataloader(self) -> Any:
        return peer_loader(self.cfg, self.trainer.global_rank, self.trainer.world_size)

    def val_dataloader(self) -> Any:
        return val_loader(self.cfg)


def solar_datamodule(cfg: dict[str, Any]) -> Any:
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
        # the budget in bytes, as a user under a memory cap gives it: SOLAR's working memory comes out of it too
        buffer_size=f"{cfg['budget_bytes']}B" if "budget_bytes" in cfg else cfg["buffer"],
        # solar_workers: the same plan read by a worker process per rank, one epoch at a time (no read-ahead thread)
        num_workers=1 if cfg["loader"] == "solar_workers" else cfg["solar_workers"],
        seed=0,
        log_metrics=False,
        batch_format="dict",  # PtychoNN's loss_scale: the global-mean gradient with SOLAR's unequal local batches
        reads=reads,
    )
    dm.val_dataloader = lambda: val_loader(cfg)  # the same held-out set for every loader
    return dm


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


def convert_litdata(src: str, dst: str, n: int, chunk_bytes: str = "4MB") -> float:
    import functools

    from litdata import optimize

    t0 = time.perf_counter()
    optimize(
        fn=functools.partial(_lit_item, path=src),
        inputs=list(range(n)),
        output_dir=dst,
        chunk_bytes=chunk_bytes,
        num_workers=1,
        verbose=False,
    )
    return time.perf_counter() - t0


def convert_webdataset(src: str, dst_dir: Path, n: int, shards: int) -> tuple[list[str], float]:
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


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.tools.loaders {litdata,webdataset} SRC DST SAMPLES PARAM OUT``: one conversion, timed,
    written as JSON (``{"seconds", "paths"}``) to OUT. PARAM: litdata's ``chunk_bytes``, or the number of shards."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description="convert an HDF5 training file for a peer loader")
    parser.add_argument("kind", choices=["litdata", "webdataset"])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("samples", type=int)
    parser.add_argument("param")
    parser.add_argument("out")
    args = parser.parse_args(argv)
    if args.kind == "litdata":
        result = {"seconds": convert_litdata(args.src, args.dst, args.samples, args.param), "paths": [args.dst]}
    else:
        paths, seconds = convert_webdataset(args.src, Path(args.dst), args.samples, int(args.param))
        result = {"seconds": seconds, "paths": paths}
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
