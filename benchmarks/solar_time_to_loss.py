"""Time to a target validation loss on data in acquisition order: SOLAR against the loaders users pick, in a fair arena.

The training file is a PtychoNN surrogate of ``--gib`` GiB written in acquisition order (:mod:`benchmarks.tools.
ptycho_scan`: neighbouring rows are overlapping scan positions, and the object changes along the scan). It lies on a
throttled loop device (``--bps``, ``--iops``); every training run is a child process in the device's cgroup with its
memory, page cache included, capped at its measured baseline plus the same budget for every loader
(:mod:`benchmarks.tools.arena`); the page cache is dropped before every run. PtychoNN trains through ``Trainer`` on
1, 2 and 4 DDP processes and is validated ``--val-per-epoch`` times per epoch on a held-out scan of another object
(read unthrottled, the same for all).

The target is the validation loss that full-shuffle training from memory (``memory``: the file read into memory,
then a ``DataLoader`` over tensors) reaches after ``--epochs`` epochs at the same number of processes, times
``1 + --tolerance``. For every loader the table gives the training time (validation passes excluded) until its
validation loss first reaches the target, plus the conversion it needed (``litdata.optimize``, WebDataset shards,
run in the same cgroup reading the source from the device); "never" where it does not within ``--max-epochs``.
A run stops at its first validation at or below the target: later epochs cannot change the time to it.
Loaders: see :mod:`benchmarks.tools.loaders` (``memory`` runs uncapped: it is the reference, not a contestant).

Run as root (about a minute with ``--quick``)::

    python -m benchmarks.solar_time_to_loss --quick
    python -m benchmarks.solar_time_to_loss --ranks 1      # one rank count per run; then 2, then 4
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer

from benchmarks.tools.loaders import SHUFFLES, WORKERS, Peers, libraries_of, solar_datamodule

LOADERS = ["memory", "dl2", "litdata", "litdata_tuned", "webdataset", "solar"]
CONVERSIONS = {"litdata": ("litdata", "4MB"), "litdata_tuned": ("litdata", "256KB"), "webdataset": ("webdataset", "")}


# ----------------------------------------------------------------------------------------------------- child side
class _Curve(Callback):
    """Rank 0 records every validation: training seconds (validation passes excluded), wall seconds, loss.

    Args:
        out: JSON file written at the end of ``fit``.
        start: ``time.perf_counter()`` when ``fit`` was called.
        stop_loss: stop training at the first validation at or below this loss (``None``: run every epoch). The
            loss is synchronised across ranks, so every rank stops at the same step.
    """

    def __init__(self, out: str, start: float, stop_loss: float | None = None) -> None:
        self.out, self.start, self.stop_loss = out, start, stop_loss
        self.val_s = 0.0
        self.v0 = 0.0
        self.points: list[dict[str, Any]] = []

    def on_validation_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.v0 = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        now = time.perf_counter()
        self.val_s += now - self.v0
        loss = trainer.callback_metrics.get("val/loss")
        if trainer.sanity_checking or loss is None:
            return
        self.points.append(
            {
                "epoch": trainer.current_epoch,
                "step": trainer.global_step,
                "train_s": now - self.start - self.val_s,
                "wall_s": now - self.start,
                "val_loss": float(loss),
            }
        )
        if self.stop_loss is not None and float(loss) <= self.stop_loss:
            trainer.should_stop = True  # the target is reached: later epochs cannot change the time to it

    def on_fit_end(self, trainer: Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            plan = getattr(trainer.datamodule, "read_plan", None)  # SOLAR's: what it chose to read, and why
            described = None if plan is None else plan.describe()
            loader = getattr(trainer.datamodule, "train_loader", None)
            if described is not None and loader is not None:
                described += f"; rank 0's read-ahead waited for memory {loader.memory_waits} time(s)"
            Path(self.out).write_text(json.dumps({"points": self.points, "plan": described}))


def _train(cfg: dict[str, Any]) -> None:
    """Child process: fit PtychoNN with one loader (``null``: zeros, for the memory baseline) on ``cfg["ranks"]``."""
    import torch

    from lightning_sdp.models.ptychonn import PtychoNN

    torch.set_num_threads(1)
    for module in cfg.get("imports", ()):  # a baseline run imports the libraries of the loader it calibrates
        importlib.import_module(module)
    start = time.perf_counter()
    dm = solar_datamodule(cfg) if cfg["loader"].startswith("solar") else Peers(cfg)
    torch.manual_seed(0)
    model = PtychoNN(image_size=cfg["size"], base_channels=cfg["channels"], depth=2, learning_rate=cfg["lr"])
    ranks = cfg["ranks"]
    trainer = Trainer(
        accelerator="cpu",
        devices=ranks,
        strategy="ddp" if ranks > 1 else "auto",
        max_epochs=cfg["epochs"],
        val_check_interval=1.0 / cfg["val_per_epoch"],
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_Curve(cfg["out"], start, cfg.get("stop_loss"))],
        num_sanity_val_steps=0,
    )
    trainer.fit(model, dm)


# ------------------------------------------------------------------------------------------------------- analysis
def time_to_target(points: list[dict[str, Any]], target: float) -> float | None:
    """Training seconds at the first validation with a loss at or below ``target`` (``None``: never)."""
    return next((p["train_s"] for p in points if p["val_loss"] <= target), None)


def target_loss(reference: list[dict[str, Any]], epochs: int, tolerance: float) -> float | None:
    """The in-memory reference's last validation loss of epoch ``epochs`` x ``(1 + tolerance)`` (``None``: it did not
    get there)."""
    at_epochs = [p for p in reference if p["epoch"] == epochs - 1]
    return at_epochs[-1]["val_loss"] * (1 + tolerance) if at_epochs else None


def summarise(runs: list[dict[str, Any]], epochs: int, tolerance: float) -> list[dict[str, Any]]:
    """One row per (ranks, loader): the target of its rank count, time to it with the conversion, the costs."""
    rows = []
    for ranks in sorted({r["ranks"] for r in runs}):
        here = [r for r in runs if r["ranks"] == ranks]
        reference = next((r for r in here if r["loader"] == "memory" and r.get("points")), None)
        target = target_loss((reference or {}).get("points", []), epochs, tolerance)
        times: dict[str, float | None] = {}
        for r in here:
            reach = time_to_target(r.get("points") or [], target) if target is not None else None
            times[r["loader"]] = None if reach is None else reach + r.get("conversion_s", 0.0)
        for r in here:
            total = times[r["loader"]]
            peers = [t for name, t in times.items() if name not in ("memory", r["loader"])]
            rows.append(
                {
                    "P": ranks,
                    "loader": r["loader"],
                    "status": r["status"],
                    "target loss": None if target is None else round(target, 5),
                    "seconds to target": "never" if total is None else round(total, 1),
                    "conversion s": round(r.get("conversion_s", 0.0), 1),
                    "vs slowest peer": _ratio(total, peers, max),
                    "vs fastest peer": _ratio(total, peers, min),
                    "final val loss": round(r["points"][-1]["val_loss"], 5) if r.get("points") else None,
                    "device MiB": round(r["device_mib"], 1),
                    "device requests": r["device_requests"],
                    "memory cap MiB": None if r["memory_cap_mib"] is None else round(r["memory_cap_mib"]),
                    "memory peak MiB": round(r["memory_peak_mib"]),
                    "pinned peak MiB": round(r["pinned_peak_mib"]),
                    "shuffle": SHUFFLES.get(r["loader"], "?"),
                }
            )
    return rows


def _ratio(mine: float | None, peers: list[float | None], pick: Any) -> str | float:
    """``pick(peer times) / mine`` (> 1: this loader is sooner); peers that never reach the target count as
    infinitely slow."""
    reached = [t for t in peers if t is not None]
    if mine is None or not peers:
        return "-"
    if pick is max and len(reached) < len(peers):
        return "inf"
    return round(pick(reached) / mine, 2) if reached else "inf"


def _figure(runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rank_counts = sorted({r["ranks"] for r in runs})
        fig, axes = plt.subplots(1, len(rank_counts), figsize=(5.5 * len(rank_counts), 4), squeeze=False)
        for ax, ranks in zip(axes[0], rank_counts, strict=True):
            for r in runs:
                if r["ranks"] == ranks and r.get("points"):
                    pts = r["points"]
                    start = r.get("conversion_s", 0.0)
                    ax.plot([start + p["train_s"] for p in pts], [p["val_loss"] for p in pts], ".-", label=r["loader"])
            target = next((row["target loss"] for row in rows if row["P"] == ranks), None)
            if target is not None:
                ax.axhline(target, color="k", ls="--", lw=0.8, label="target")
            ax.set_title(f"{ranks} process{'es' if ranks > 1 else ''}")
            ax.set_xlabel("training seconds (conversion included)")
            ax.set_ylabel("validation loss")
            ax.set_yscale("log")
            ax.legend(fontsize=7)
        fig.tight_layout()
    except Exception as err:
        print(f"no figure: {err}")
        return None
    return fig


# ------------------------------------------------------------------------------------------------------ controller
def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="training file size in GiB (at least 1 for the target)")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--channels", type=int, default=8, help="PtychoNN base channels")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the in-memory reference that set the target")
    parser.add_argument("--max-epochs", type=int, default=6, help="epochs the other loaders get to reach it")
    parser.add_argument("--val-per-epoch", type=int, default=4)
    parser.add_argument("--val-samples", type=int, default=512)
    parser.add_argument("--tolerance", type=float, default=0.01, help="target = reference loss x (1 + tolerance)")
    parser.add_argument("--batch", type=int, default=32, help="local batch size")
    parser.add_argument("--buffer-fraction", type=float, default=0.1, help="memory budget, fraction of the file")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--loaders", nargs="+", default=LOADERS)
    parser.add_argument("--bps", default="40MB")
    parser.add_argument("--iops", type=int, default=400)
    parser.add_argument("--timeout", type=int, default=7200, help="seconds per training run")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--name", default="solar_time_to_loss")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # the reference runs first: it sets the target the others stop at
    args.loaders = sorted(args.loaders, key=lambda loader: loader != "memory")
    if args.quick:
        args.gib, args.epochs, args.max_epochs, args.ranks, args.val_per_epoch = 0.01, 1, 2, [1], 2
        args.val_samples, args.channels, args.timeout, args.buffer_fraction = 64, 4, 600, 1.0
        args.loaders = ["memory", "litdata", "solar"]  # the reference, a converting peer, SOLAR
        args.name += "_quick"
    return args


def _not_installed(loaders: list[str]) -> dict[str, str]:
    """The peers among ``loaders`` whose package (the ``bench`` extra) is missing, with the package's name."""
    import importlib.util

    packages = {loader: CONVERSIONS[loader][0] for loader in loaders if loader in CONVERSIONS}
    return {loader: package for loader, package in packages.items() if importlib.util.find_spec(package) is None}


def _child_cmd(cfg: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "benchmarks.solar_time_to_loss", "--child", json.dumps(cfg)]


def _convert(arena: Any, loader: str, h5: str, mount: Path, samples: int, tmp: Path) -> tuple[dict[str, Any], Any]:
    """Run ``loader``'s conversion in the arena; ``(its costs, the result JSON)``."""
    from benchmarks.tools.arena import run_json

    kind, param = CONVERSIONS[loader]
    dst = mount / loader
    out = tmp / f"convert_{loader}.json"
    shards = "16" if kind == "webdataset" else param
    cmd = [sys.executable, "-m", "benchmarks.tools.loaders", kind, h5, str(dst), str(samples), shards, str(out)]
    run, result = run_json(arena, cmd, out, None)
    if result is None:
        raise RuntimeError(f"conversion for {loader} failed ({run.rc}):\n{run.stderr_tail}")
    return run.to_dict(), result


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.child:
        _train(json.loads(args.child))
        return 0
    from benchmarks._common import REPO_ROOT, machine_info, markdown_table, write_results
    from benchmarks.tools.arena import SMOKE_SLACK, SMOKE_SLACK_NOTE, Arena, run_json
    from benchmarks.tools.device import ThrottledStorage
    from benchmarks.tools.ptycho_scan import make_scan_h5, samples_for

    not_installed = _not_installed(args.loaders)
    for loader, package in not_installed.items():
        print(f"skipping {loader}: {package} is not installed (pip install -e '.[bench]')", file=sys.stderr)
    args.loaders = [loader for loader in args.loaders if loader not in not_installed]
    samples = samples_for(args.gib, args.size)
    runs: list[dict[str, Any]] = []
    conversions: dict[str, Any] = {}
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        src = make_scan_h5(tmp / "train.h5", samples, args.size, seed=0)
        val = make_scan_h5(tmp / "val.h5", args.val_samples, args.size, seed=1)
        file_bytes = src.stat().st_size
        budget = int(args.buffer_fraction * file_bytes)
        try:
            storage = stack.enter_context(
                ThrottledStorage(f"{int(4.5 * file_bytes / 2**20) + 512}MiB", args.bps, args.iops)
            )
            arena = Arena(storage, budget, args.timeout, REPO_ROOT, slack_bytes=SMOKE_SLACK if args.quick else 0)
        except PermissionError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        assert storage.mount is not None
        h5 = str(storage.copy_in(src))
        print(f"{samples} samples ({file_bytes / 2**30:.2f} GiB) on {storage.facts()}; budget {budget / 2**20:.0f} MiB")
        for loader in args.loaders:
            if loader in CONVERSIONS:
                conversions[loader] = _convert(arena, loader, h5, storage.mount, samples, tmp)
                print(f"conversion {loader}: {conversions[loader][0]}", flush=True)
        for ranks in args.ranks:
            stop_loss = None
            for loader in args.loaders:
                cfg = {
                    "loader": loader,
                    "ranks": ranks,
                    "batch": args.batch,
                    "epochs": args.epochs if loader == "memory" else args.max_epochs,
                    "val_per_epoch": args.val_per_epoch,
                    "h5": h5,
                    "val": str(val),
                    "litdata": str(storage.mount / "litdata"),
                    "litdata_tuned": str(storage.mount / "litdata_tuned"),
                    "litdata_cache": str(storage.mount / "litcache"),
                    "wds": conversions.get("webdataset", ({}, {"paths": []}))[1]["paths"],
                    "buffer": int(args.buffer_fraction * samples),
                    "budget_per_rank": int(args.buffer_fraction * samples) // ranks,
                    "budget_bytes_per_rank": budget // ranks,
                    "budget_bytes": budget,
                    "train_samples": (samples // (ranks * args.batch)) * ranks * args.batch,
                    "size": args.size,
                    "channels": args.channels,
                    "lr": args.lr,
                    "solar_workers": 0,
                    "out": str(tmp / f"{loader}_{ranks}.json"),
                    "stop_loss": stop_loss,
                }
                workers = WORKERS.get(loader, 0)
                libraries = libraries_of(loader)
                null = {**cfg, "loader": "null", "workers": workers, "epochs": 1, "out": str(tmp / "null.json")}
                null["imports"] = libraries
                # the reference keeps the whole file in memory: uncapped; every other loader gets baseline + budget
                key = (ranks, workers, *libraries)
                cap = None if loader == "memory" else arena.cap(key, _child_cmd(null))
                run, result = run_json(arena, _child_cmd(cfg), Path(cfg["out"]), cap)
                status = "ok" if run.ok else ("oom-killed" if run.oom_kills else f"failed ({run.rc})")
                if not run.ok:
                    print(f"P={ranks} {loader}: {status}\n{run.stderr_tail}", flush=True)
                row = {"ranks": ranks, "loader": loader, "status": status, **run.to_dict()}
                row["points"] = (result or {}).get("points", [])
                row["plan"] = (result or {}).get("plan")
                row["conversion_s"] = conversions[loader][0]["seconds"] if loader in conversions else 0.0
                runs.append(row)
                if loader == "memory":  # the reference runs first and sets the target the others stop at
                    stop_loss = target_loss(row["points"], args.epochs, args.tolerance)
                last = row["points"][-1]["val_loss"] if row["points"] else float("nan")
                print(f"P={ranks} {loader}: {status}, final val {last:.5f}, {run.seconds:.0f}s", flush=True)
        facts = storage.facts()
    rows = summarise(runs, args.epochs, args.tolerance)
    md = (
        f"PtychoNN (base channels {args.channels}, {args.size}x{args.size}) trained through Trainer with P DDP "
        f"processes on a {file_bytes / 2**30:.2f} GiB surrogate in acquisition order ({samples} overlapping scan "
        f"positions of one object whose phase range grows along the scan), on {facts['filesystem']} limited to "
        f"{args.bps}/s and {args.iops} read IOPS. Every run in the device's cgroup (v{facts['cgroup_version']}) with "
        f"memory, page cache included, capped at its baseline (the same processes on zeros, the loader's libraries imported) + {budget / 2**20:.0f} "
        f"MiB ({args.buffer_fraction:.0%} of the file)"
        + (SMOKE_SLACK_NOTE if args.quick else "")
        + "; page cache dropped before each run; `memory` (the reference) "
        "uncapped; the baseline counts pinned memory only (anonymous, shared, mapped libraries, kernel; not the "
        "unmapped page cache, which the kernel drops under the cap). "
        f"Target: `memory`'s validation loss after {args.epochs} epochs x (1 + {args.tolerance}). Seconds "
        "to target: training time to the first validation at or below it (validation passes excluded) plus the "
        f"conversion; loaders other than `memory` train up to {args.max_epochs} epochs and stop at the first "
        f"validation at or below the target (final val loss: the last one), validated {args.val_per_epoch} times per "
        "epoch. 'vs peer' > 1: this loader reaches the target sooner by that factor; "
        "device MiB/requests: the cgroup's counters for the run (all ranks).\n\n"
        + markdown_table(rows)
        + "\n\nConversions (in the cgroup, reading the source from the device): "
        + json.dumps({k: v[0] for k, v in conversions.items()})
        + (f"\n\nNot installed, not run: {json.dumps(not_installed)}" if not_installed else "")
        + "".join(f"\n\nP={r['ranks']} {r['loader']}'s read plan: {r['plan']}" for r in runs if r.get("plan"))
        + f"\n\nBaselines (MiB, by (ranks, workers, libraries imported)): {json.dumps(arena.baselines())}\n\n"
        + f"Wall time {time.perf_counter() - start:.0f} s.\n"
    )
    print(md)
    payload = {
        "args": vars(args),
        "not_installed": not_installed,
        "device": facts,
        "conversions": conversions,
        "baselines_mib": arena.baselines(),
        "summary": rows,
        "runs": runs,
        "machine": machine_info(),
    }
    write_results(args.name, payload, md, _figure(runs, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
