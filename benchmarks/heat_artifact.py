"""HEAT's own code against the fused kernel: positives/s at the artifact's configuration, interleaved, and Recall@20.

HEAT's artifact (``hipdac-lab/ICS23-HEAT``, built at run time by :mod:`benchmarks.tools.heat_artifact_build`; the
benchmark is skipped, with the reason, when it cannot be built) trains what its C++ hard-codes, whatever its YAML says:
the SimpleX mean aggregator at gate 0.4, the softmax loss over ``cos / 0.07``, each row's gradient buffer clipped at
0.1; with its Gowalla configuration: d=128, 64 negatives, lr 0.01, history 100. Ours trains the same model with HEAT's
own rules (``grad_clip_mode="row_buffer"``, ``aggregator_lr_scale=1/32``: its mean step of ``W``,
``history_grad=False``: its history rows are only read; ``--clip-mode sample`` for ours), both from N(0, 0.01) tables,
both on ``--threads`` threads.

Every epoch runs three things one after the other, so that a machine that drifts shifts none against the others:

1. one epoch of the artifact, in a worker process that never imports torch (``import torch`` with
   ``MKL_NUM_THREADS=1`` sets the OpenMP thread count of the whole process to 1; the worker reports the threads the
   artifact's OpenMP region ran with, and the run says so if they differ from ``--threads``);
2. one epoch of the fused kernel alone (``SimpleXModule.fused_step`` over the shuffled positives, no Trainer);
3. one epoch of the fused kernel through ``Trainer.fit`` (``accelerator=HEATAccelerator``), timed from the epoch's
   start hook to its end hook.

After the last epoch the three models are scored on Gowalla's test split (full ranking, training items masked,
cosine scores for all: the artifact's loss trains cosines) at equal epochs. Run from the repo root:
``.venv/bin/python -m benchmarks.heat_artifact --source DIR`` (``--quick``: tiny synthetic data, 2 epochs). Writes
``benchmarks/results/<--name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer

from benchmarks._common import SHARED_DATA, machine_info, markdown_table, write_results
from benchmarks.tools.heat_artifact_build import ArtifactUnavailable, build
from lightning_sdp.datamodules.interactions import InteractionsDataModule
from lightning_sdp.metrics import evaluate_ranking
from lightning_sdp.models.simplex import SimpleXModule
from lightning_sdp.plugins.heat import HEATAccelerator, set_cpu_threads

NAME = "heat_artifact"
#: The artifact's real configuration (its Gowalla YAML where the C++ reads it, the C++'s constants elsewhere).
ARTIFACT = {"dim": 128, "negatives": 64, "lr": 0.01, "clip": 0.1, "gate": 0.4, "temperature": 0.07, "history": 100}
#: ``--quick``: the same rules on tiny shapes
QUICK = {**ARTIFACT, "dim": 16, "negatives": 8, "history": 20}
_WORKER = r"""
import json, sys, time
import numpy as np
import cf_c  # the artifact's module (its folder is on PYTHONPATH); torch is never imported here
data = np.load(sys.argv[1])
users, items, dim = int(data["num_users"]), int(data["num_items"]), int(data["dim"])
pairs, his, masks = data["pairs"], data["history"], data["masks"]
cfg = cf_c.modules.CFConfig(emb_dim=dim, num_negs=int(data["negatives"]), num_users=users, num_items=items,
    train_size=len(pairs), neg_sampler=0, tile_size=512, refresh_interval=8192, l2=1e-7,
    clip_val=float(data["clip"]), milestones=[10**9], l_r=float(data["lr"]))
dataset = cf_c.modules.datasets.ClickDataset(click_dataset=pairs, historical_items=his, masks=masks)
dataset.max_his = his.shape[1]
weights0 = np.ascontiguousarray(data["W"])
aggregator = cf_c.modules.behavior_aggregators.AggregatorWeights(aggregator_weights0=weights0)
user_rows, item_rows = np.ascontiguousarray(data["user"]), np.ascontiguousarray(data["item"])
model = cf_c.modules.models.MatrixFactorization(cf_config=cfg, user_weights=user_rows, item_weights=item_rows)
engine = cf_c.modules.train.Engine(dataset=dataset, aggregator_weights=aggregator, model=model, cf_config=cfg)
print("READY", flush=True)
for line in sys.stdin:
    command = line.split()
    if command[0] == "epoch":
        start = time.perf_counter()
        loss = engine.train_one_epoch()
        print("RESULT " + json.dumps({"seconds": time.perf_counter() - start, "loss": loss}), flush=True)
    elif command[0] == "save":
        np.savez(command[1], user=user_rows, item=item_rows)
        print("RESULT {}", flush=True)
    else:
        break
"""


class Artifact:
    """The artifact training in a worker process: one epoch per :meth:`epoch`, its rows by :meth:`rows`."""

    def __init__(self, module_dir: Path, data: Path, threads: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(module_dir)}
        env.pop("MKL_NUM_THREADS", None)
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(data)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.threads_seen: set[int] = set()
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("READY"):
                return {}
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
            if "max_threads" in line:  # the artifact prints its OpenMP region's thread count every epoch
                self.threads_seen.add(int(line.split("max_threads")[1].split()[0]))
        raise RuntimeError(f"the artifact's worker ended (exit code {self.process.wait()})")

    def _send(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._read()

    def epoch(self) -> dict[str, Any]:
        return self._send("epoch")

    def rows(self, path: Path) -> tuple[np.ndarray, np.ndarray]:
        self._send(f"save {path}")
        saved = np.load(path)
        return saved["user"], saved["item"]

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
            self.process.wait(timeout=60)


def artifact_inputs(dm: InteractionsDataModule, path: Path, seed: int, config: dict[str, Any]) -> None:
    """The artifact's inputs (its ``ClickDataset`` arrays and N(0, 0.01) tables, as its Python front end builds them)."""
    indptr, indices = dm.train_csr
    assert dm.num_users is not None and dm.num_items is not None
    rng = np.random.default_rng(seed)
    counts = np.diff(indptr)
    users = np.repeat(np.arange(dm.num_users), counts)
    history = np.zeros((dm.num_users, config["history"]), np.uint64)
    masks = np.zeros((dm.num_users, 1), np.uint64)
    for u in range(dm.num_users):  # datasets.py: a random sample of max_his items, else all, padded with the last
        own = indices[indptr[u] : indptr[u + 1]]
        if len(own) >= history.shape[1]:
            own = rng.choice(own, history.shape[1], replace=False)
        if len(own):
            history[u, : len(own)], history[u, len(own) :], masks[u] = own, own[-1], len(own)
    d = config["dim"]
    np.savez(
        path,
        pairs=np.stack([users, indices], axis=1).astype(np.uint64),
        history=history,
        masks=masks,
        user=(0.01 * rng.normal(size=(dm.num_users, d))).astype(np.float32),
        item=(0.01 * rng.normal(size=(dm.num_items, d))).astype(np.float32),
        W=(0.01 * rng.normal(size=(d, d))).astype(np.float32),
        num_users=dm.num_users,
        num_items=dm.num_items,
        dim=d,
        negatives=config["negatives"],
        lr=config["lr"],
        clip=config["clip"],
    )


def our_model(
    dm: InteractionsDataModule, config: dict[str, Any], clip_mode: str, seed: int, standalone: bool = False
) -> SimpleXModule:
    """The fused model at the artifact's configuration (see the module docstring); ``standalone``: built with its
    tables and training interactions, to be stepped without a Trainer."""
    sizes = (dm.num_users, dm.num_items) if standalone else (None, None)
    model = SimpleXModule(
        *sizes,
        dim=config["dim"],
        g=config["gate"],
        aggregator="mean",
        loss="softmax",
        temperature=config["temperature"],
        grad_clip=config["clip"],
        grad_clip_mode=clip_mode,
        num_negatives=config["negatives"],
        max_history=config["history"],
        optimizer="sgd",
        lr=config["lr"],
        aggregator_lr_scale=1 / 32 if clip_mode == "row_buffer" else 1.0,
        history_grad=clip_mode != "row_buffer",
        init_std=0.01,
        sampler="uniform",
        seed=seed,
    )
    if standalone:
        model.set_interactions(*dm.train_csr)
    return model


class Interleave(Callback):
    """Before each epoch of the Trainer: an epoch of the artifact and one of the kernel alone; then times the epoch."""

    def __init__(self, artifact: Artifact, alone: SimpleXModule, pairs: tuple[torch.Tensor, torch.Tensor], batch: int):
        self.artifact, self.alone, self.pairs, self.batch = artifact, alone, pairs, batch
        self.lr = alone.config.learning_rate
        self.rows: list[dict[str, Any]] = []
        self._start = 0.0

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        epoch = trainer.current_epoch
        art = self.artifact.epoch()
        for buffer in self.alone.clip_buffers():  # cleared once per epoch, as the Trainer's model does
            buffer.zero_()
        order = torch.randperm(len(self.pairs[0]), generator=torch.Generator().manual_seed(epoch))
        start = time.perf_counter()
        for lo in range(0, len(order), self.batch):
            chosen = order[lo : lo + self.batch]
            self.alone.fused_step(self.pairs[0][chosen], self.pairs[1][chosen], self.lr)
        alone = time.perf_counter() - start
        self.rows.append({"epoch": epoch, "artifact_s": art["seconds"], "alone_s": alone, "artifact_loss": art["loss"]})
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.rows[-1]["trainer_s"] = time.perf_counter() - self._start


def _cosine_scores(user_rows: np.ndarray, item_rows: np.ndarray) -> Any:
    users, items = F.normalize(torch.from_numpy(user_rows), dim=1), F.normalize(torch.from_numpy(item_rows), dim=1)
    return lambda batch: users[batch] @ items.T


def run(args: argparse.Namespace, module_dir: Path) -> dict[str, Any]:
    config = QUICK if args.quick else ARTIFACT
    if args.quick:
        dm = InteractionsDataModule(num_users=300, num_items=200, val_fraction=0.0, batch_size=1024, seed=0)
    else:
        dm = InteractionsDataModule(args.data, val_fraction=0.0, batch_size=args.batch_size)
    dm.setup("fit")
    assert dm.num_items is not None
    train, test = dm.train_csr, dm.test_csr
    pairs_np = (np.repeat(np.arange(len(train.indptr) - 1), np.diff(train.indptr)), train.indices)
    pairs = (torch.from_numpy(pairs_np[0]), torch.from_numpy(pairs_np[1]))
    set_cpu_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="heat_artifact_run_") as tmp:
        inputs = Path(tmp) / "inputs.npz"
        artifact_inputs(dm, inputs, args.seed, config)
        artifact = Artifact(module_dir, inputs, args.threads)
        try:
            alone = our_model(dm, config, args.clip_mode, args.seed, standalone=True)
            ours = our_model(dm, config, args.clip_mode, args.seed)
            interleave = Interleave(artifact, alone, pairs, dm.batch_size)
            trainer = Trainer(
                accelerator=HEATAccelerator(num_threads=args.threads),
                devices=1,
                max_epochs=args.epochs,
                limit_val_batches=0,
                num_sanity_val_steps=0,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[interleave],
            )
            trainer.fit(ours, dm)
            art_user, art_item = artifact.rows(Path(tmp) / "rows.npz")
        finally:
            artifact.close()
    quality = {
        "artifact": evaluate_ranking(_cosine_scores(art_user, art_item), train, test, dm.num_items, 20),
        "fused_alone": evaluate_ranking(alone.score, train, test, dm.num_items, 20),
        "fused_trainer": evaluate_ranking(ours.score, train, test, dm.num_items, 20),
    }
    results = summarize(interleave.rows, len(pairs_np[0]), quality, artifact.threads_seen)
    results.update(args=vars(args), config=dict(config))
    return results


def summarize(
    rows: list[dict[str, Any]], positives: int, quality: dict[str, tuple[float, float]], threads: set[int]
) -> dict[str, Any]:
    """Positives/s of each system (the median of its epochs but the first), their ratios and the test scores."""
    timed = rows[1:] if len(rows) > 1 else rows  # the first epoch warms caches and allocators
    rate = {k: positives / float(np.median([r[f"{k}_s"] for r in timed])) for k in ("artifact", "alone", "trainer")}
    summary = {
        "positives": positives,
        "epochs": len(rows),
        "artifact_pos_per_s": rate["artifact"],
        "fused_alone_pos_per_s": rate["alone"],
        "fused_trainer_pos_per_s": rate["trainer"],
        "trainer_vs_artifact": rate["trainer"] / rate["artifact"],
        "alone_vs_artifact": rate["alone"] / rate["artifact"],
        "trainer_overhead": rate["alone"] / rate["trainer"] - 1.0,
        "artifact_threads_seen": sorted(threads),
        **{f"{k}_recall@20": v[0] for k, v in quality.items()},
        **{f"{k}_ndcg@20": v[1] for k, v in quality.items()},
    }
    return {"machine": machine_info(), "epochs": rows, "summary": summary}


def report(results: dict[str, Any]) -> str:
    if "skipped" in results:
        return f"Skipped: {results['skipped']}\n"
    s = results["summary"]
    threads = results["args"]["threads"]
    warning = (
        ""
        if s["artifact_threads_seen"] == [threads]
        else (f"**The artifact ran with {s['artifact_threads_seen']} OpenMP threads, not {threads}.** ")
    )
    table = [
        {
            "system": name,
            "positives/s": s[f"{key}_pos_per_s"],
            "vs artifact": s[f"{key}_pos_per_s"] / s["artifact_pos_per_s"],
            "test Recall@20": s[f"{key}_recall@20"],
            "test NDCG@20": s[f"{key}_ndcg@20"],
        }
        for name, key in (
            ("HEAT artifact", "artifact"),
            ("fused, kernel alone", "fused_alone"),
            ("fused, Trainer", "fused_trainer"),
        )
    ]
    return (
        f"{warning}The artifact's configuration {results['config']} on {threads} threads, "
        f"{s['epochs']} interleaved epochs (median of all but the first), "
        + (
            "ours with HEAT's rules (row buffers, the aggregator's mean step, history rows only read); "
            if results["args"]["clip_mode"] == "row_buffer"
            else "ours with its own rules (each sample's gradient clipped, history rows trained); "
        )
        + f"the Trainer adds {100 * s['trainer_overhead']:.1f}% over the kernel alone. Quality at equal epochs, "
        "full ranking of the test split.\n\n"
        + markdown_table(table)
        + "\n\nPer epoch (seconds):\n\n"
        + markdown_table(results["epochs"])
        + "\n"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--source", type=Path, default=None, help="checkout or git directory of hipdac-lab/ICS23-HEAT")
    parser.add_argument("--eigen", type=Path, default=None, help="Eigen 3 include folder (default: found or fetched)")
    parser.add_argument(
        "--pybind11", type=Path, default=None, help="pybind11 include folder (default: found or fetched)"
    )
    parser.add_argument("--data", default=str(SHARED_DATA / "gowalla"), help="LightGCN folder (default: Gowalla)")
    parser.add_argument("--epochs", type=int, default=8, help="epochs of each system (the artifact's YAML: 8)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16384, help="positives per step of the fused runs")
    parser.add_argument("--clip-mode", choices=("row_buffer", "sample"), default="row_buffer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny synthetic data, 2 epochs (smoke test)")
    parser.add_argument("--name", default=None, help=f"results file stem (default {NAME}, {NAME}_quick)")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs = 2
    name = args.name or (f"{NAME}_quick" if args.quick else NAME)
    try:
        module_dir = build(args.source, args.eigen, args.pybind11)
    except ArtifactUnavailable as why:
        print(f"SKIP {NAME}: {why}", flush=True)
        results: dict[str, Any] = {"args": vars(args), "skipped": str(why)}
        write_results(name, results, report(results))
        return results
    if not args.quick and not Path(args.data).is_dir():
        raise SystemExit(f"{args.data} not found; pass --data (a LightGCN folder)")
    results = run(args, module_dir)
    print(json.dumps(results["summary"], indent=1), flush=True)
    write_results(name, results, report(results))
    return results


if __name__ == "__main__":
    main()
