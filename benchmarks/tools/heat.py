"""What the HEAT benchmarks share: the data splits, thread settings, throughput loops and a validation recorder."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback

from benchmarks.tools.catalogues import CATALOGUES, REAL
from benchmarks.tools.step_timer import StepTimer
from lightning_sdp.datamodules.interactions import InteractionsDataModule, split_validation
from lightning_sdp.models.simplex import SimpleXModule
from lightning_sdp.plugins.heat import set_cpu_threads

#: every data set ``load_split`` knows: the real ones, the generated checks and the catalogues of the suite
DATASETS = (*REAL, "synthetic", "synthetic_fresh", "synthetic_holdout", "synthetic_holdout2", *CATALOGUES)


def shuffled_pairs(dm: InteractionsDataModule, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The training (user, item) pairs of ``dm`` in a seeded random order."""
    indptr, indices = dm.train_csr
    users = np.repeat(np.arange(dm.num_users), np.diff(indptr))
    order = np.random.default_rng(seed).permutation(len(users))
    return torch.from_numpy(users[order].astype(np.int64)), torch.from_numpy(indices[order].astype(np.int64))


def measure_fused(
    m: SimpleXModule, users: torch.Tensor, items: torch.Tensor, seconds: float, batch: int = 16384
) -> float:
    """Positives per second of :meth:`SimpleXModule.fused_step` over ``seconds`` after one warm-up batch."""
    m.fused_step(users[:batch], items[:batch], 0.05)  # warm-up (and compile on first use)
    done, start, pos = 0, time.perf_counter(), batch
    while time.perf_counter() - start < seconds:
        if pos + batch > len(users):
            pos = 0
        m.fused_step(users[pos : pos + batch], items[pos : pos + batch], 0.05)
        pos += batch
        done += batch
    return done / (time.perf_counter() - start)


def measure_reference(m: SimpleXModule, users: torch.Tensor, items: torch.Tensor, seconds: float, batch: int) -> float:
    """Positives per second of the plain-PyTorch SimpleX step (autograd + dense Adam) over ``seconds``."""
    opt = torch.optim.Adam(m.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)

    def step(lo: int) -> None:
        u, i = users[lo : lo + batch], items[lo : lo + batch]
        neg = torch.randint(0, m.num_items, (len(u), m.hparams.num_negatives), generator=gen)
        loss, _ = m.reference_loss(u, i, neg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step(0)
    step(batch)
    done, start, pos = 0, time.perf_counter(), 2 * batch
    while time.perf_counter() - start < seconds:
        if pos + batch > len(users):
            pos = 0
        step(pos)
        pos += batch
        done += batch
    return done / (time.perf_counter() - start)


class Split:
    """Train minus validation, validation, the full training set (masked at test) and test, as CSR arrays."""

    def __init__(self, name: str, full_train: tuple, test: tuple, num_items: int, val_fraction: float) -> None:
        self.name, self.num_items = name, num_items
        self.full_train = (np.asarray(full_train[0]), np.asarray(full_train[1]))
        self.test = (np.asarray(test[0]), np.asarray(test[1]))
        tr, va = split_validation(self.full_train[0], self.full_train[1], val_fraction, 0)
        self.train, self.val = (tr[0], tr[1]), (va[0], va[1])
        self.num_users = len(self.train[0]) - 1
        counts = np.diff(self.train[0])
        self.train_users = np.repeat(np.arange(self.num_users), counts)

    def refit(self) -> Split:
        """This split with validation folded back into train: what the final, test-scored models train on."""
        other = copy.copy(self)
        other.train = self.full_train
        other.train_users = np.repeat(np.arange(self.num_users), np.diff(self.full_train[0]))
        return other

    def matrix(self) -> Any:
        """``scipy.sparse.csr_matrix`` of train minus validation (users x items, ones)."""
        import scipy.sparse as sp

        data = np.ones(len(self.train[1]), dtype=np.float32)
        return sp.csr_matrix((data, self.train[1], self.train[0]), shape=(self.num_users, self.num_items))

    def describe(self) -> dict[str, Any]:
        n_train, n_val, n_test = len(self.train[1]), len(self.val[1]), len(self.test[1])
        density = (n_train + n_val) / (self.num_users * self.num_items)
        return {
            "dataset": self.name,
            "users": self.num_users,
            "items": self.num_items,
            "train": n_train,
            "val": n_val,
            "test": n_test,
            "density": density,
        }


def real_folder(dataset: str, data: str) -> Path:
    """The LightGCN folder of a real data set of the suite: ``data`` for Gowalla (``--data``), else its folder beside
    Gowalla's (``../shared/data/<name>``)."""
    return Path(data) if dataset == "gowalla" else Path(data).parent / REAL[dataset].folder


def load_split(dataset: str, data: str, val_fraction: float, quick: bool) -> Split | None:
    """A real LightGCN split of the suite (``None`` when absent) or a seeded synthetic catalogue."""
    if dataset in REAL:
        folder = real_folder(dataset, data)
        if not folder.is_dir():
            print(f"SKIP {dataset}: {folder} not found (see ../shared/data/README.md); pass --data or another set.")
            return None
        # Last.fm's LightGCN split has 2 test users with no training item: no method can rank for them
        dm = InteractionsDataModule(str(folder), val_fraction=0.0, drop_cold_test_users=True)
        dm.setup("fit")
        return Split(dataset, tuple(dm.train_csr), tuple(dm.test_csr), dm.num_items or 0, val_fraction)
    if dataset in CATALOGUES:
        dm = InteractionsDataModule(val_fraction=0.0, **CATALOGUES[dataset].datamodule_kwargs())
        dm.setup("fit")
        return Split(dataset, tuple(dm.train_csr), tuple(dm.test_csr), dm.num_items or 0, val_fraction)
    if dataset == "synthetic_fresh":
        # a catalogue nothing was tuned on: other size, density, popularity skew, clusters and seed
        users, items, per_user, extra = 6000, 4000, 25, {"alpha": 1.0, "num_clusters": 50, "seed": 1}
    elif dataset == "synthetic_holdout":
        # defined before any run on it, to score the recipe once after changes that synthetic_fresh's
        # results motivated: sparser, flatter popularity, more and smaller clusters, another seed
        users, items, per_user, extra = 12000, 8000, 12, {"alpha": 0.8, "num_clusters": 200, "seed": 2}
    elif dataset == "synthetic_holdout2":
        # defined before any run on it, to score the recipe once after the clock-driven final fit and
        # the faster steps and scoring: larger and sparser (nearer Gowalla), 100 clusters, another seed
        users, items, per_user, extra = 20000, 15000, 18, {"alpha": 0.9, "num_clusters": 100, "seed": 3}
    else:
        # dense synthetic catalogue: ~60 items per user over 1,500 (Gowalla: ~27 per user over 41k items)
        users, items, per_user, extra = (300, 200, 20, {}) if quick else (3000, 1500, 60, {})
    dm = InteractionsDataModule(
        num_users=users, num_items=items, interactions_per_user=per_user, val_fraction=0.0, **extra
    )
    dm.setup("fit")
    name = "synthetic_quick" if quick else dataset
    return Split(name, tuple(dm.train_csr), tuple(dm.test_csr), items, val_fraction)


def set_threads(n: int) -> Any:
    """``n`` threads for numba, torch and BLAS; returns the threadpoolctl limiter (keep it alive)."""
    set_cpu_threads(n)
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=n)


def heat_batch_size(split: Split) -> int:
    """The fused kernel's batch for ``split``: a 64th of the training positives, within 1,024-16,384."""
    return int(np.clip(len(split.train[1]) // 64, 1024, 16384))


class ValidationHistory(Callback):
    """Records (epoch, seconds since fit start, Recall@20, NDCG@20, load) after every validation.

    Args:
        timer: adds ``train_s``, the training time so far (batch starts to ends), when given.
        extra: adds the entries it returns for the module (diagnostics), when given.
    """

    def __init__(self, timer: StepTimer | None = None, extra: Callable[[Any], dict] | None = None) -> None:
        self.rows: list[dict] = []
        self.start = time.perf_counter()
        self.timer, self.extra = timer, extra

    def on_fit_start(self, trainer, pl_module) -> None:
        self.start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        m = trainer.callback_metrics
        row = {
            "epochs": trainer.current_epoch + (1 if trainer.state.fn == "fit" else 0),
            "seconds": time.perf_counter() - self.start,
            "recall@20": float(m["val/recall@20"]),
            "ndcg@20": float(m["val/ndcg@20"]),
            "load_avg_1m": round(os.getloadavg()[0], 2),
        }
        if self.timer is not None:
            row["train_s"] = round(sum(self.timer.durations()), 1)
        if self.extra is not None:
            row.update(self.extra(pl_module))
        self.rows.append(row)
        print(row, flush=True)
