"""User-item interaction data for collaborative filtering (SimpleX / HEAT).

Three sources, one shape: a LightGCN folder (``train.txt`` / ``test.txt``, one line ``user item item ...``), a
user-item TSV/CSV file split per user with a seed, or a seeded synthetic power-law catalogue for demos and tests.
Training batches are ``(users, items)`` LongTensors of positive pairs; evaluation batches are dicts with the users
to rank and their test items (CSR form). The training interactions (CSR) are exposed for the model, which needs
them for histories and for masking training items when ranking.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, Sampler
from typing_extensions import override


class _EpochShuffledBatches(Sampler[np.ndarray]):
    """Yields index arrays of one batch each; the order is a permutation seeded by ``(seed, epoch)``.

    Lightning calls :meth:`set_epoch` at the start of each epoch, so a resumed run sees the same order as an
    uninterrupted one.
    """

    def __init__(self, size: int, batch_size: int, shuffle: bool, seed: int) -> None:
        self.size = size
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return (self.size + self.batch_size - 1) // self.batch_size

    def __iter__(self) -> Iterator[np.ndarray]:
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.size)
        else:
            order = np.arange(self.size)
        for start in range(0, self.size, self.batch_size):
            yield order[start : start + self.batch_size]


class _PairBatches(Dataset):
    """``dataset[index_array]`` -> ``(users, items)`` LongTensors of the positives at those indices."""

    def __init__(self, users: np.ndarray, items: np.ndarray) -> None:
        self.users = torch.from_numpy(users)
        self.items = torch.from_numpy(items)

    def __len__(self) -> int:
        return len(self.users)

    def __getitem__(self, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(np.asarray(index, dtype=np.int64))
        return self.users[idx], self.items[idx]


class _EvalBatches(Dataset):
    """``dataset[index_array]`` -> ``{"users", "test_indptr", "test_items"}`` for those evaluation users."""

    def __init__(self, users: np.ndarray, indptr: np.ndarray, indices: np.ndarray) -> None:
        self.users = users
        self.indptr = indptr
        self.indices = indices

    def __len__(self) -> int:
        return len(self.users)

    def __getitem__(self, index: np.ndarray) -> dict[str, torch.Tensor]:
        users = self.users[np.asarray(index, dtype=np.int64)]
        starts, stops = self.indptr[users], self.indptr[users + 1]
        counts = stops - starts
        offsets = np.zeros(len(users) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        items = np.concatenate([self.indices[a:b] for a, b in zip(starts, stops, strict=False)]) if len(users) else np.zeros(0)
        return {
            "users": torch.from_numpy(users.astype(np.int64)),
            "test_indptr": torch.from_numpy(offsets),
            "test_items": torch.from_numpy(items.astype(np.int64)),
        }


def _to_csr(users: np.ndarray, items: np.ndarray, num_users: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR ``(indptr, indices)`` of pairs, items sorted within each user, duplicates removed."""
    order = np.lexsort((items, users))
    users, items = users[order], items[order]
    if len(users):
        keep = np.ones(len(users), dtype=bool)
        keep[1:] = (users[1:] != users[:-1]) | (items[1:] != items[:-1])
        users, items = users[keep], items[keep]
    indptr = np.zeros(num_users + 1, dtype=np.int64)
    np.cumsum(np.bincount(users, minlength=num_users), out=indptr[1:])
    return indptr, np.ascontiguousarray(items, dtype=np.int64)


def _read_lightgcn(path: Path) -> tuple[np.ndarray, np.ndarray]:
    users: list[np.ndarray] = []
    items: list[np.ndarray] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                ids = np.array([int(x) for x in parts], dtype=np.int64)
            except ValueError as err:
                raise ValueError(f"{path}:{lineno}: expected integer ids `user item item ...`, got {line!r}") from err
            if (ids < 0).any():
                raise ValueError(f"{path}:{lineno}: negative id in {line.strip()!r}; ids must be >= 0.")
            users.append(np.full(len(ids) - 1, ids[0], dtype=np.int64))
            items.append(ids[1:])
    if not users:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(users), np.concatenate(items)


def synthetic_interactions(
    num_users: int, num_items: int, interactions_per_user: int, alpha: float, num_clusters: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """A seeded synthetic catalogue: power-law item popularity and user taste clusters.

    Each user belongs to one of ``num_clusters`` taste clusters; 80% of their items come from their cluster's items
    and 20% from the whole catalogue, both with Zipf-like popularity ``rank^-alpha``. The number of items per user
    is geometric-like around ``interactions_per_user`` (at least 2).

    Returns:
        ``(users, items)`` int64 arrays of unique pairs.
    """
    rng = np.random.default_rng(seed)
    pop = np.arange(1, num_items + 1, dtype=np.float64) ** (-alpha)
    pop = pop[rng.permutation(num_items)]
    item_cluster = rng.integers(0, num_clusters, num_items)
    user_cluster = rng.integers(0, num_clusters, num_users)
    cluster_items = [np.flatnonzero(item_cluster == c) for c in range(num_clusters)]
    cluster_p = [pop[ci] / pop[ci].sum() if len(ci) else None for ci in cluster_items]
    all_p = pop / pop.sum()
    counts = np.maximum(2, rng.geometric(1.0 / max(interactions_per_user, 1), num_users))
    counts = np.minimum(counts, max(2, num_items // 2))
    users, items = [], []
    for u in range(num_users):
        c = user_cluster[u]
        k = int(counts[u])
        n_in = rng.binomial(k, 0.8) if cluster_p[c] is not None else 0
        chosen = []
        if n_in:
            chosen.append(rng.choice(cluster_items[c], size=n_in, p=cluster_p[c]))
        chosen.append(rng.choice(num_items, size=k - n_in, p=all_p))
        its = np.unique(np.concatenate(chosen))
        users.append(np.full(len(its), u, dtype=np.int64))
        items.append(its.astype(np.int64))
    return np.concatenate(users), np.concatenate(items)


def _split_per_user(
    users: np.ndarray, items: np.ndarray, test_fraction: float, seed: int
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Seeded per-user split: ``floor(n * test_fraction)`` items of each user go to test, at least one stays."""
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.random(len(users)), users))
    users, items = users[order], items[order]
    counts = np.bincount(users)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(len(users)) - np.repeat(starts, counts)
    n_test = np.minimum(np.floor(counts * test_fraction).astype(np.int64), np.maximum(counts - 1, 0))
    is_test = rank < np.repeat(n_test, counts)
    return (users[~is_test], items[~is_test]), (users[is_test], items[is_test])


class InteractionsDataModule(LightningDataModule):
    """Implicit-feedback interactions for SimpleX / MF-CCL training (HEAT, Zhang et al., ICS 2023).

    Sources (chosen by ``path``):

    * a folder with LightGCN files ``train.txt`` and ``test.txt`` (``user item item ...`` per line, 0-based);
    * a ``.csv`` / ``.tsv`` / ``.txt`` file of ``user,item`` rows (extra columns ignored, an optional non-numeric
      header skipped); raw ids are mapped to ``0..n-1`` in sorted order, then each user's items are split with a
      seed, ``test_fraction`` of them to the test set;
    * ``None``: a seeded synthetic power-law catalogue (``num_users`` x ``num_items``).

    The test split serves as validation set too (the LightGCN protocol has no separate validation split).

    Args:
        path: LightGCN folder, CSV/TSV file, or ``None`` for synthetic data. Default ``None``.
        num_users: table size; ``None`` infers ``max id + 1`` (synthetic default 2000). An explicit value smaller
            than an id raises an error.
        num_items: same for items (synthetic default 1000).
        batch_size: positives per training batch. The fused backend does one kernel call per batch, so large batches
            (4096-16384) amortise Lightning's per-step cost; the reference backend follows the paper's 256-1024.
        eval_batch_size: users per evaluation batch (full ranking over all items). Default 1024.
        test_fraction: share of each user's items held out when splitting a CSV or synthetic data. Default 0.2.
        interactions_per_user: mean items per synthetic user. Default 20.
        alpha: Zipf exponent of synthetic item popularity. Default 0.8.
        num_clusters: synthetic taste clusters. Default 20.
        shuffle: shuffle training positives every epoch (seeded by ``seed`` and the epoch). Default ``True``.
        seed: seed of the synthetic data, the CSV split and the shuffling. Default 0.
        num_workers: DataLoader workers (batches are cheap index slices; 0 is usually best). Default 0.
    """

    def __init__(
        self,
        path: str | None = None,
        num_users: int | None = None,
        num_items: int | None = None,
        batch_size: int = 8192,
        eval_batch_size: int = 1024,
        test_fraction: float = 0.2,
        interactions_per_user: int = 20,
        alpha: float = 0.8,
        num_clusters: int = 20,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if batch_size <= 0 or eval_batch_size <= 0:
            raise ValueError(f"batch_size and eval_batch_size must be positive, got {batch_size}, {eval_batch_size}.")
        if not 0.0 <= test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}.")
        # num_users / num_items / seed are also SimpleXModule arguments; Lightning refuses to log two different values
        # under one key, so the datamodule keeps them as attributes only.
        self.save_hyperparameters(ignore=["num_users", "num_items", "seed"])
        self.seed = seed
        self.path = path
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self._num_users_arg = num_users
        self._num_items_arg = num_items
        self.num_users: int | None = None
        self.num_items: int | None = None
        self.train_indptr: np.ndarray | None = None
        self.train_indices: np.ndarray | None = None
        self.test_indptr: np.ndarray | None = None
        self.test_indices: np.ndarray | None = None
        self._pairs: tuple[np.ndarray, np.ndarray] | None = None

    # ---------------------------------------------------------------------------------------------- loading
    def _load(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        hp = self.hparams
        if self.path is None:
            n_users = self._num_users_arg or 2000
            n_items = self._num_items_arg or 1000
            users, items = synthetic_interactions(
                n_users, n_items, hp.interactions_per_user, hp.alpha, hp.num_clusters, self.seed
            )
            self._num_users_arg, self._num_items_arg = n_users, n_items
            return _split_per_user(users, items, hp.test_fraction, self.seed)
        path = Path(self.path).expanduser()
        if path.is_dir():
            train, test = path / "train.txt", path / "test.txt"
            for f in (train, test):
                if not f.is_file():
                    raise FileNotFoundError(
                        f"InteractionsDataModule: {f} not found; a LightGCN folder needs train.txt and test.txt."
                    )
            return _read_lightgcn(train), _read_lightgcn(test)
        if path.is_file():
            users, items = self._read_table(path)
            return _split_per_user(users, items, hp.test_fraction, self.seed)
        raise FileNotFoundError(
            f"InteractionsDataModule: {path} does not exist; pass a LightGCN folder, a CSV/TSV file or None."
        )

    def _read_table(self, path: Path) -> tuple[np.ndarray, np.ndarray]:
        delimiter = "," if path.suffix.lower() == ".csv" else "\t"
        raw_u, raw_i = [], []
        with open(path, newline="") as f:
            for lineno, row in enumerate(csv.reader(f, delimiter=delimiter), 1):
                if not row or not "".join(row).strip():
                    continue
                if len(row) < 2:
                    raise ValueError(f"{path}:{lineno}: expected `user{delimiter}item`, got {row!r}")
                if lineno == 1 and not (row[0].strip().lstrip("-").isdigit() and row[1].strip().lstrip("-").isdigit()):
                    continue  # header
                raw_u.append(row[0].strip())
                raw_i.append(row[1].strip())
        if not raw_u:
            raise ValueError(f"{path}: no interactions found.")
        ids_u, ids_i = np.array(raw_u), np.array(raw_i)
        if all(s.lstrip("-").isdigit() for s in raw_u[:1000]) and all(s.lstrip("-").isdigit() for s in raw_i[:1000]):
            ids_u, ids_i = ids_u.astype(np.int64), ids_i.astype(np.int64)
        _, users = np.unique(ids_u, return_inverse=True)
        _, items = np.unique(ids_i, return_inverse=True)
        return users.astype(np.int64), items.astype(np.int64)

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_indptr is not None:
            return
        (tr_u, tr_i), (te_u, te_i) = self._load()
        max_user = int(max(tr_u.max(initial=-1), te_u.max(initial=-1)))
        max_item = int(max(tr_i.max(initial=-1), te_i.max(initial=-1)))
        n_users = self._num_users_arg if self._num_users_arg is not None else max_user + 1
        n_items = self._num_items_arg if self._num_items_arg is not None else max_item + 1
        if max_user >= n_users:
            raise ValueError(f"InteractionsDataModule: user id {max_user} is out of range for num_users={n_users}.")
        if max_item >= n_items:
            raise ValueError(f"InteractionsDataModule: item id {max_item} is out of range for num_items={n_items}.")
        if len(tr_u) == 0:
            raise ValueError("InteractionsDataModule: the training set is empty.")
        if len(te_u) == 0:
            raise ValueError(
                "InteractionsDataModule: the test set is empty; nothing to evaluate Recall/NDCG on "
                "(check test.txt, or raise test_fraction)."
            )
        self.num_users, self.num_items = n_users, n_items
        self.train_indptr, self.train_indices = _to_csr(tr_u, tr_i, n_users)
        self.test_indptr, self.test_indices = _to_csr(te_u, te_i, n_users)
        test_users = np.flatnonzero(np.diff(self.test_indptr) > 0)
        no_train = test_users[np.diff(self.train_indptr)[test_users] == 0]
        if len(no_train):
            raise ValueError(
                f"InteractionsDataModule: {len(no_train)} test user(s) have no training items (e.g. user "
                f"{int(no_train[0])}); a collaborative-filtering model cannot rank for them. Remove them from the "
                "test set."
            )
        self._eval_users = test_users.astype(np.int64)
        counts = np.diff(self.train_indptr)
        self._pairs = (np.repeat(np.arange(n_users, dtype=np.int64), counts), self.train_indices)

    # ---------------------------------------------------------------------------------------------- accessors
    @property
    def num_train_interactions(self) -> int:
        self._check_setup()
        return len(self.train_indices)  # type: ignore[arg-type]

    def train_csr(self) -> tuple[np.ndarray, np.ndarray]:
        """``(indptr, indices)`` of the training items of every user (int64, items sorted)."""
        self._check_setup()
        return self.train_indptr, self.train_indices  # type: ignore[return-value]

    def test_csr(self) -> tuple[np.ndarray, np.ndarray]:
        """``(indptr, indices)`` of the test items of every user (int64, items sorted)."""
        self._check_setup()
        return self.test_indptr, self.test_indices  # type: ignore[return-value]

    def _check_setup(self) -> None:
        if self.train_indptr is None:
            raise RuntimeError("InteractionsDataModule: call setup() first (the Trainer does this for you).")

    # ---------------------------------------------------------------------------------------------- loaders
    @override
    def train_dataloader(self) -> DataLoader:
        self._check_setup()
        users, items = self._pairs  # type: ignore[misc]
        sampler = _EpochShuffledBatches(len(users), self.batch_size, self.hparams.shuffle, self.seed)
        return DataLoader(_PairBatches(users, items), batch_size=None, sampler=sampler, num_workers=self.num_workers)

    def _eval_loader(self) -> DataLoader:
        self._check_setup()
        sampler = _EpochShuffledBatches(len(self._eval_users), self.eval_batch_size, False, 0)
        ds = _EvalBatches(self._eval_users, self.test_indptr, self.test_indices)  # type: ignore[arg-type]
        return DataLoader(ds, batch_size=None, sampler=sampler, num_workers=self.num_workers)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._eval_loader()

    @override
    def test_dataloader(self) -> DataLoader:
        return self._eval_loader()
