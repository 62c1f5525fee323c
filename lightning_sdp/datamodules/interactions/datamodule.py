"""``InteractionsDataModule``: implicit-feedback interactions with train / validation / test splits (SimpleX, HEAT)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_sdp.datamodules.interactions.csr import CSR, gather_rows, merge_csr, to_csr
from lightning_sdp.datamodules.interactions.eval_memory import auto_eval_batch_size, check_eval_batch_size
from lightning_sdp.datamodules.interactions.readers import (
    Pairs,
    read_id_table,
    read_lightgcn,
    synthetic_interactions,
)
from lightning_sdp.datamodules.interactions.split import split_per_user, split_validation
from lightning_sdp.datamodules.sampling import DistributedEpochSeededBatchSampler, EpochSeededBatchSampler

_log = logging.getLogger(__name__)

# LightGCN ids index the embedding tables directly; a table this much larger than the ids it holds means the ids
# were not re-mapped to 0..n-1 (an id of 10**12 would allocate terabytes), so it is refused unless sizes are given
_SPARSE_ROWS_FACTOR = 2
_SPARSE_ROWS_SLACK = 1024


class PositivePairs(Dataset):
    """``dataset[index_array]`` -> ``(users, items)`` LongTensors of the positives at those indices, and their
    float32 ``weights`` when the pairs have weights.

    Indexed by whole index arrays (one batch each, from :class:`EpochSeededBatchSampler` with ``batch_size=None``),
    so no per-sample collation happens.

    Args:
        users: ``(n,)`` int64 user of each positive.
        items: ``(n,)`` int64 item of each positive.
        weights: ``(n,)`` weight of each positive (see ``InteractionsDataModule(weight_column=...)``), or ``None``.
    """

    def __init__(self, users: np.ndarray, items: np.ndarray, weights: np.ndarray | None = None) -> None:
        self.users = torch.from_numpy(np.ascontiguousarray(users, dtype=np.int64))
        self.items = torch.from_numpy(np.ascontiguousarray(items, dtype=np.int64))
        self.weights = None if weights is None else np.ascontiguousarray(weights, dtype=np.float32)

    @classmethod
    def from_csr(cls, indptr: np.ndarray, indices: np.ndarray) -> PositivePairs:
        """The positives of a CSR ``(indptr, indices)``, user by user."""
        users = np.repeat(np.arange(len(indptr) - 1, dtype=np.int64), np.diff(indptr))
        return cls(users, indices)

    def __len__(self) -> int:
        return len(self.users)

    def __getitem__(self, index: np.ndarray) -> tuple[torch.Tensor, ...]:
        # numpy's single-threaded gather: torch's competes with the kernel's still-spinning OpenMP threads for the
        # cores (benchmarks/heat_trainer_overhead.py times both)
        idx = np.asarray(index, dtype=np.int64)
        users, items = torch.from_numpy(self.users.numpy().take(idx)), torch.from_numpy(self.items.numpy().take(idx))
        if self.weights is None:
            return users, items
        return users, items, torch.from_numpy(self.weights.take(idx))


class _TrainLoader(DataLoader):
    """The training ``DataLoader``. Its position travels in :meth:`InteractionsDataModule.state_dict`; the empty
    ``state_dict`` / ``load_state_dict`` here tell Lightning that the loader resumes mid-epoch (it warns about
    loaders without them)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class _EvalBatches(Dataset):
    """``dataset[index_array]`` -> one evaluation batch of those users (see :class:`InteractionsDataModule`).

    Args:
        users: the users to rank for (those with at least one target item).
        target: CSR of the items to find (``test_items`` / ``test_indptr`` in the batch).
        known: CSR of the items never to rank (``known_items`` / ``known_indptr`` in the batch).
    """

    def __init__(self, users: np.ndarray, target: CSR, known: CSR) -> None:
        self.users = users
        self.target = target
        self.known = known

    def __len__(self) -> int:
        return len(self.users)

    def __getitem__(self, index: np.ndarray) -> dict[str, torch.Tensor]:
        users = self.users[np.asarray(index, dtype=np.int64)]
        test_indptr, test_items = gather_rows(self.target, users)
        known_indptr, known_items = gather_rows(self.known, users)
        return {
            "users": torch.from_numpy(users),
            "test_indptr": torch.from_numpy(test_indptr),
            "test_items": torch.from_numpy(test_items),
            "known_indptr": torch.from_numpy(known_indptr),
            "known_items": torch.from_numpy(known_items),
        }


def _locate(pairs: list[Pairs], column: str, value: int) -> str:
    """``file:line`` of the first pair whose ``column`` id is ``value``."""
    for p in pairs:
        hits = np.flatnonzero(getattr(p, column) == value)
        if len(hits):
            return p.where(int(hits[0]))
    return "?"


def _check_table(pairs: list[Pairs], column: str, size: int | None, name: str) -> int:
    """Table size for the ids in ``column`` of ``pairs``: ``size``, else ``max id + 1`` when the ids are dense."""
    ids = [getattr(p, column) for p in pairs]
    max_id = max((int(a.max()) for a in ids if len(a)), default=-1)
    if size is not None:
        if max_id >= size:
            raise ValueError(
                f"InteractionsDataModule: {_locate(pairs, column, max_id)}: {column[:-1]} id {max_id} is out of range "
                f"for {name}={size}; raise {name} or leave it None."
            )
        return size
    distinct = len(np.unique(np.concatenate(ids))) if ids else 0
    if max_id + 1 > _SPARSE_ROWS_FACTOR * distinct + _SPARSE_ROWS_SLACK:
        raise ValueError(
            f"InteractionsDataModule: {_locate(pairs, column, max_id)}: {column[:-1]} id {max_id} would make a table "
            f"of {max_id + 1} rows for {distinct} distinct ids. LightGCN ids index the tables directly and must be "
            "0-based and about contiguous: re-map them to 0..n-1 (or use a CSV/TSV file, whose ids are re-mapped), "
            f"or pass {name}= explicitly if the sparse table is intended."
        )
    return max_id + 1


def _repeats(users: np.ndarray, items: np.ndarray) -> np.ndarray:
    """Mask of the pairs that repeat an earlier ``(user, item)`` pair; the first occurrence of each is not marked."""
    n = len(users)
    if n == 0:
        return np.zeros(0, dtype=bool)
    width = int(items.max()) + 1
    if int(users.max()) < np.iinfo(np.int64).max // width:
        # one int64 key per pair (a stable sort of it is several times faster than a three-key lexsort)
        order = np.argsort(users * width + items, kind="stable")
    else:  # raw ids of a CSV can be up to 10**18
        order = np.lexsort((np.arange(n), items, users))
    # grouped by pair, earliest position first within a group
    u, i = users[order], items[order]
    mask = np.zeros(n, dtype=bool)
    mask[order[1:][(u[1:] == u[:-1]) & (i[1:] == i[:-1])]] = True
    return mask


def _first_at(pairs: Pairs, user: int, item: int) -> int:
    """Position of the first ``(user, item)`` pair in ``pairs``."""
    return int(np.flatnonzero((pairs.users == user) & (pairs.items == item))[0])


def _drop_duplicates(pairs: Pairs, why: str) -> Pairs:
    """``pairs`` without the rows that repeat an earlier pair (the first of each is kept), with a logged warning.

    Args:
        pairs: pairs read from one file.
        why: what keeping the duplicates would do, for the warning.
    """
    mask = _repeats(pairs.users, pairs.items)
    count = int(mask.sum())
    if count == 0:
        return pairs
    p = int(np.flatnonzero(mask)[0])
    user, item = int(pairs.users[p]), int(pairs.items[p])
    _log.warning(
        "InteractionsDataModule: %s lists %d (user, item) pair(s) more than once (e.g. user %d, item %d at %s, first "
        "at %s); dropped the %d repeated row(s) and kept the first of each, %s.",
        pairs.path,
        count,
        user,
        item,
        pairs.where(p),
        pairs.where(_first_at(pairs, user, item)),
        count,
        why,
    )
    return pairs.keep(~mask)


def _check_disjoint(train: Pairs, test: Pairs) -> None:
    """Refuse test pairs that are also training pairs (both without duplicates)."""
    both = _repeats(np.concatenate([train.users, test.users]), np.concatenate([train.items, test.items]))
    in_train = both[len(train.users) :]  # a test pair that repeats an earlier row repeats a training pair
    count = int(in_train.sum())
    if count == 0:
        return
    p = int(np.flatnonzero(in_train)[0])
    user, item = int(test.users[p]), int(test.items[p])
    raise ValueError(
        f"InteractionsDataModule: {count} (user, item) pair(s) of {test.path} are also in {train.path} (e.g. user "
        f"{user}, item {item} at {test.where(p)}, also at {train.where(_first_at(train, user, item))}). A training "
        "item is never ranked at evaluation, so such a test pair always counts as a miss and Recall/NDCG come out "
        f"wrong. Remove those pairs from {test.path}, or give a CSV/TSV file of all interactions and let the "
        "datamodule split it."
    )


class InteractionsDataModule(LightningDataModule):
    """Implicit-feedback interactions for SimpleX / MF-CCL training (HEAT, Zhang et al., ICS 2023).

    Sources (chosen by ``path``):

    * a folder with LightGCN files ``train.txt`` and ``test.txt`` (``user item item ...`` per line); ids index the
      tables directly, so they must be 0-based and about contiguous (a table more than twice the number of distinct
      ids plus 1024 is refused unless ``num_users`` / ``num_items`` are given);
    * a ``.csv`` file (commas) or ``.tsv`` / ``.txt`` file (tabs) of ``user,item`` rows (extra columns ignored, a
      header row skipped); ids are re-mapped to ``0..n-1`` in increasing order (so an id of 10^12 costs nothing;
      ``raw_user_ids`` / ``raw_item_ids`` give the original id of each row), then each user's items are split with
      a seed, ``test_fraction`` of them to the test set;
    * ``None``: a seeded synthetic power-law catalogue (``num_users`` x ``num_items``).

    Duplicates: a ``(user, item)`` pair listed more than once in a file is kept once (the first), with a logged
    warning naming the file and the count; a CSV/TSV file is de-duplicated before the split, so no pair lands in
    both train and test. A LightGCN folder whose ``test.txt`` repeats pairs of ``train.txt`` is refused (a training
    item is never ranked, so such a test pair always counts as a miss).

    Ids follow one rule in every file: non-negative decimal integers of at most 18 digits (``007`` is ``7``);
    anything else (negative, float, text) is refused with the file and line.

    A validation set is carved out of the training interactions (:func:`split_validation`: per user, seeded by
    ``seed``); the test set is never touched, so choices made on validation do not look at test. After
    :meth:`setup`: ``train_csr`` (training minus validation, what the model trains on), ``val_csr``, ``test_csr``.
    Training batches are ``(users, items)`` LongTensors of positive pairs. Evaluation batches (validation and test)
    are dicts: ``users``, the items to find as batch-local CSR ``test_items`` / ``test_indptr``, and the items never
    to rank ``known_items`` / ``known_indptr`` (for validation the training items; for test the training and
    validation items).

    Serving: :attr:`known_csr` holds every interaction of the data (training, validation and test), which
    ``SimpleXModule`` keeps and never recommends again. Once settings are chosen on the split, ``train_on_all=True``
    trains the final model on every interaction (nothing held out, so no validation or test).

    Weights: with ``weight_column`` (a CSV/TSV column of positive values, e.g. play counts), each training batch
    carries a third tensor, the pairs' weights ``log(1 + value)``, divided by their mean over the training pairs (so
    the mean weight is 1 and ``lr`` keeps its meaning). ``SimpleXModule`` multiplies each positive's loss by its
    weight: a pair of weight 2 pulls as two copies of it would.

    Checkpoints: :meth:`state_dict` holds the position in the training order (epoch and batch) and what fixes the
    order (a hash of the training pairs, ``batch_size``, ``seed``, ``shuffle``). ``Trainer.fit(..., ckpt_path=...)``
    from a checkpoint saved mid-epoch continues that epoch at the next batch, so the resumed run sees the batches an
    uninterrupted run sees; a checkpoint of other data or another batch size or seed is refused with a
    ``ValueError``.

    Args:
        path: LightGCN folder, CSV/TSV file, or ``None`` for synthetic data. Default ``None``.
        num_users: table size; ``None`` infers ``max id + 1`` (synthetic default 2000). An explicit value smaller
            than an id raises an error.
        num_items: same for items (synthetic default 1000).
        batch_size: positives per training batch. The fused backend does one kernel call per batch, so large batches
            (4096-16384) amortise Lightning's per-step cost; the reference backend follows the paper's 256-1024.
        eval_batch_size: users per evaluation batch (full ranking over all items), or ``"auto"`` (default): the
            largest batch whose score and mask matrices (6 B x users x items) stay under ``eval_memory_mib``. An
            explicit value is checked against the available memory at setup.
        eval_memory_mib: memory cap in MiB of one evaluation batch's matrices for ``eval_batch_size="auto"``.
            Default 256.
        val_fraction: share of each user's training items held out for validation (users with >= 2 items give
            at least 1 and keep at least 1), in ``[0, 1)``; ``0`` means no validation set (``val_dataloader`` is
            empty and Lightning skips validation). Default 0.1.
        test_fraction: share of each user's items held out for test when splitting a CSV or synthetic data.
            Default 0.2.
        interactions_per_user: mean items per synthetic user. Default 20.
        alpha: Zipf exponent of synthetic item popularity. Default 0.8.
        num_clusters: synthetic taste clusters. Default 20.
        shuffle: shuffle training positives every epoch (seeded by ``seed`` and the epoch). Default ``True``.
        seed: seed of the synthetic data, the CSV test split, the validation split (a stream of its own) and the
            shuffling. Default 0.
        num_workers: DataLoader workers (batches are cheap index slices; 0 is usually best). Default 0.
        train_on_all: train on every interaction (the splits' training, validation and test pairs): the final fit
            once settings were chosen on the split. ``val_fraction`` and ``test_fraction`` are then not used, there
            is no validation, and :meth:`test_dataloader` raises. The ids and table sizes are those of the split.
            Default ``False``.
        weight_column: CSV/TSV files only: the column (0-based index, or its header name) of each pair's positive
            value (e.g. a count), turned into the pair's weight as described above; ``None``: every pair weighs 1.
            A pair listed twice keeps its first row's value. Default ``None``.
        drop_cold_test_users: leave test users without any training item out of the test set (with a logged
            warning giving the count; their items stay known interactions) instead of refusing the data: no
            collaborative-filtering model can rank for them (LightGCN's Last.fm split has two). Default ``False``.
    """

    def __init__(
        self,
        path: str | None = None,
        num_users: int | None = None,
        num_items: int | None = None,
        batch_size: int = 8192,
        eval_batch_size: int | Literal["auto"] = "auto",
        eval_memory_mib: float = 256.0,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        interactions_per_user: int = 20,
        alpha: float = 0.8,
        num_clusters: int = 20,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        train_on_all: bool = False,
        weight_column: int | str | None = None,
        drop_cold_test_users: bool = False,
    ) -> None:
        super().__init__()
        if batch_size <= 0:
            raise ValueError(f"InteractionsDataModule: batch_size must be positive, got {batch_size}.")
        if eval_batch_size != "auto" and (not isinstance(eval_batch_size, (int, np.integer)) or eval_batch_size <= 0):
            raise ValueError(
                f"InteractionsDataModule: eval_batch_size must be a positive int or 'auto', got {eval_batch_size!r}."
            )
        if eval_memory_mib <= 0:
            raise ValueError(f"InteractionsDataModule: eval_memory_mib must be positive, got {eval_memory_mib}.")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"InteractionsDataModule: val_fraction must be in [0, 1), got {val_fraction}.")
        if not 0.0 <= test_fraction < 1.0:
            raise ValueError(f"InteractionsDataModule: test_fraction must be in [0, 1), got {test_fraction}.")
        if seed < 0:
            raise ValueError(f"InteractionsDataModule: seed must be >= 0, got {seed}.")
        # num_users / num_items / seed are also SimpleXModule arguments; Lightning refuses to log two different values
        # under one key, so the datamodule keeps them as attributes only.
        self.save_hyperparameters(ignore=["num_users", "num_items", "seed"])
        self.seed = seed
        self.path = path
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.eval_memory_mib = eval_memory_mib
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.interactions_per_user = interactions_per_user
        self.alpha = alpha
        self.num_clusters = num_clusters
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.train_on_all = train_on_all
        self.weight_column = weight_column
        self.drop_cold_test_users = drop_cold_test_users
        self._num_users_arg = num_users
        self._num_items_arg = num_items
        self.num_users: int | None = None
        self.num_items: int | None = None
        self.resolved_eval_batch_size: int | None = None
        self.raw_user_ids: np.ndarray | None = None
        self.raw_item_ids: np.ndarray | None = None
        self.train_indptr: np.ndarray | None = None
        self.train_indices: np.ndarray | None = None
        self.val_indptr: np.ndarray | None = None
        self.val_indices: np.ndarray | None = None
        self.test_indptr: np.ndarray | None = None
        self.test_indices: np.ndarray | None = None
        self._known_for_test: CSR | None = None
        self._known_all: CSR | None = None
        self._pairs: tuple[np.ndarray, np.ndarray] | None = None
        # (items per user key, sorted keys user * items + item, the value of each key) of a weight column
        self._pair_values: tuple[int, np.ndarray, np.ndarray] | None = None
        self._train_weights: np.ndarray | None = None
        self._data_hash: str | None = None
        # (epoch, batches of the epoch's order to skip) of a run resumed mid-epoch; see load_state_dict
        self._resume: tuple[int, int] | None = None
        self._restored = False  # this fit's checkpoint carried the datamodule's state
        self._pending_state: dict[str, Any] | None = None

    # ---------------------------------------------------------------------------------------------- loading
    def _load(self) -> tuple[Pairs, Pairs, int, int]:
        """Train and test pairs with the table sizes."""
        is_table = self.path is not None and Path(self.path).expanduser().is_file()
        if self.weight_column is not None and not is_table:
            raise ValueError(
                f"InteractionsDataModule: weight_column={self.weight_column!r} reads a column of a CSV/TSV file, but "
                f"path={self.path!r} is not one (LightGCN folders and synthetic data have no weights)."
            )
        if self.path is None:
            n_users = self._num_users_arg or 2000
            n_items = self._num_items_arg or 1000
            users, items = synthetic_interactions(
                n_users, n_items, self.interactions_per_user, self.alpha, self.num_clusters, self.seed
            )
            (tr_u, tr_i), (te_u, te_i) = split_per_user(users, items, self.test_fraction, self.seed)
            no_lines = np.zeros(0, np.int64)
            return Pairs(tr_u, tr_i, no_lines), Pairs(te_u, te_i, no_lines), n_users, n_items
        path = Path(self.path).expanduser()
        if path.is_dir():
            files = path / "train.txt", path / "test.txt"
            for f in files:
                if not f.is_file():
                    raise FileNotFoundError(
                        f"InteractionsDataModule: {f} not found; a LightGCN folder needs train.txt and test.txt."
                    )
            train, test = read_lightgcn(files[0]), read_lightgcn(files[1])
            n_users = _check_table([train, test], "users", self._num_users_arg, "num_users")
            n_items = _check_table([train, test], "items", self._num_items_arg, "num_items")
            train = _drop_duplicates(train, "so that no positive is trained on more often than the others")
            test = _drop_duplicates(test, "so that no test item counts twice")
            _check_disjoint(train, test)
            return train, test, n_users, n_items
        if path.is_file():
            return self._load_table(path)
        raise FileNotFoundError(
            f"InteractionsDataModule: {path} does not exist; pass a LightGCN folder, a CSV/TSV file or None."
        )

    def _load_table(self, path: Path) -> tuple[Pairs, Pairs, int, int]:
        # duplicates go before the split: a pair listed twice could otherwise land in both train and test
        pairs = _drop_duplicates(
            read_id_table(path, self.weight_column), "before the train/test split, so that no pair is in both"
        )
        self.raw_user_ids, users = np.unique(pairs.users, return_inverse=True)
        self.raw_item_ids, items = np.unique(pairs.items, return_inverse=True)
        if pairs.values is not None:
            keys = users.astype(np.int64) * len(self.raw_item_ids) + items
            order = np.argsort(keys)
            self._pair_values = (len(self.raw_item_ids), keys[order], pairs.values[order])
        sizes = []
        for name, given, found in (
            ("num_users", self._num_users_arg, len(self.raw_user_ids)),
            ("num_items", self._num_items_arg, len(self.raw_item_ids)),
        ):
            if given is not None and given < found:
                raise ValueError(
                    f"InteractionsDataModule: {path} has {found} distinct {name[4:]} but {name}={given}; "
                    f"leave {name} None or raise it."
                )
            sizes.append(found if given is None else given)
        (tr_u, tr_i), (te_u, te_i) = split_per_user(
            users.astype(np.int64), items.astype(np.int64), self.test_fraction, self.seed
        )
        no_lines = np.zeros(0, np.int64)
        return Pairs(tr_u, tr_i, no_lines), Pairs(te_u, te_i, no_lines), sizes[0], sizes[1]

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_indptr is not None:
            return
        train, test, n_users, n_items = self._load()
        if len(train.users) == 0:
            raise ValueError("InteractionsDataModule: the training set is empty.")
        if len(test.users) == 0 and not self.train_on_all:
            raise ValueError(
                "InteractionsDataModule: the test set is empty; nothing to evaluate Recall/NDCG on "
                "(check test.txt, or raise test_fraction)."
            )
        full_train = to_csr(train.users, train.items, n_users)
        test_csr = to_csr(test.users, test.items, n_users)
        test_users = np.flatnonzero(np.diff(test_csr.indptr) > 0)
        no_train = test_users[np.diff(full_train.indptr)[test_users] == 0]
        every = merge_csr(full_train, test_csr)  # a cold user's test items are still known interactions
        if len(no_train) and not self.drop_cold_test_users:
            raise ValueError(
                f"InteractionsDataModule: {len(no_train)} test user(s) have no training items (e.g. user "
                f"{int(no_train[0])}); a collaborative-filtering model cannot rank for them. Remove them from the "
                "test set, or pass drop_cold_test_users=True to leave them out of the scores."
            )
        if len(no_train):
            test_csr, test_users = self._without_users(test_csr, no_train, n_users), np.setdiff1d(test_users, no_train)
        if self.train_on_all:  # nothing held out: the final fit once settings are chosen on the split
            full_train = every
            test_csr = to_csr(np.zeros(0, np.int64), np.zeros(0, np.int64), n_users)
            test_users = np.zeros(0, np.int64)
        val_share = 0.0 if self.train_on_all else self.val_fraction
        train_csr, val_csr = split_validation(full_train.indptr, full_train.indices, val_share, self.seed)
        if self.eval_batch_size == "auto":
            self.resolved_eval_batch_size = auto_eval_batch_size(n_items, self.eval_memory_mib)
        else:
            check_eval_batch_size(self.eval_batch_size, n_items)
            self.resolved_eval_batch_size = int(self.eval_batch_size)
        self.num_users, self.num_items = n_users, n_items
        self.train_indptr, self.train_indices = train_csr
        self.val_indptr, self.val_indices = val_csr
        self.test_indptr, self.test_indices = test_csr
        self._known_for_test = full_train  # training + validation items
        self._known_all = every
        self._test_users = test_users.astype(np.int64)
        self._val_users = np.flatnonzero(val_csr.counts() > 0).astype(np.int64)
        counts = train_csr.counts()
        self._pairs = (np.repeat(np.arange(n_users, dtype=np.int64), counts), train_csr.indices)
        self._train_weights = self._weights_of(*self._pairs)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)

    @staticmethod
    def _without_users(test: CSR, users: np.ndarray, n_users: int) -> CSR:
        """``test`` without the rows of ``users`` (cold users: no training items), said in a logged warning."""
        counts = test.counts()
        drop = np.zeros(n_users, dtype=bool)
        drop[users] = True
        _log.warning(
            "InteractionsDataModule: left %d test user(s) with no training items out of the test set (e.g. user %d, "
            "%d test interaction(s) in all): no collaborative-filtering model can rank for them.",
            len(users),
            int(users[0]),
            int(counts[users].sum()),
        )
        rows = np.repeat(np.arange(n_users), counts)
        keep = ~drop[rows]
        return to_csr(rows[keep], test.indices[keep], n_users)

    def _weights_of(self, users: np.ndarray, items: np.ndarray) -> np.ndarray | None:
        """The training weights of these pairs: ``log(1 + value)`` over its mean on them; ``None`` without weights."""
        if self._pair_values is None:
            return None
        width, keys, values = self._pair_values
        at = np.searchsorted(keys, users * width + items)
        weights = np.log1p(values[at])
        return (weights / weights.mean()).astype(np.float32)

    # ---------------------------------------------------------------------------------------------- accessors
    @property
    def num_train_interactions(self) -> int:
        """Training positives (validation items excluded)."""
        self._check_setup()
        return len(self.train_indices)  # type: ignore[arg-type]

    @property
    def train_csr(self) -> CSR:
        """``(indptr, indices)`` of every user's training items, validation items excluded (int64, sorted)."""
        self._check_setup()
        return CSR(self.train_indptr, self.train_indices)  # type: ignore[arg-type]

    @property
    def val_csr(self) -> CSR:
        """``(indptr, indices)`` of every user's validation items (empty rows when ``val_fraction=0``)."""
        self._check_setup()
        return CSR(self.val_indptr, self.val_indices)  # type: ignore[arg-type]

    @property
    def known_csr(self) -> CSR:
        """``(indptr, indices)`` of every interaction of the data: training, validation and test (int64, sorted).

        What a served model must never recommend again; ``SimpleXModule`` takes it at ``setup`` and keeps it in its
        checkpoints.
        """
        self._check_setup()
        return self._known_all  # type: ignore[return-value]

    @property
    def train_weights(self) -> np.ndarray | None:
        """The weight of each training pair, in the order of :attr:`train_csr` (``None`` without ``weight_column``)."""
        self._check_setup()
        return self._train_weights

    @property
    def test_csr(self) -> CSR:
        """``(indptr, indices)`` of every user's test items (int64, sorted)."""
        self._check_setup()
        return CSR(self.test_indptr, self.test_indices)  # type: ignore[arg-type]

    def _check_setup(self) -> None:
        if self.train_indptr is None:
            raise RuntimeError("InteractionsDataModule: call setup() first (the Trainer does this for you).")

    # ---------------------------------------------------------------------------------------------- loaders
    @override
    def train_dataloader(self) -> DataLoader:
        self._check_setup()
        users, items = self._pairs  # type: ignore[misc]
        sampler = EpochSeededBatchSampler(len(users), self.batch_size, self.seed, self.shuffle)
        shard = self._shard(self.trainer)
        if shard is not None:
            # shared among processes by this datamodule, so that Lightning keeps the sampler and a process's
            # position in the epoch is a position in its own share (see DistributedEpochSeededBatchSampler)
            sampler = DistributedEpochSeededBatchSampler(len(users), self.batch_size, *shard, self.seed, self.shuffle)
        if self._resume is not None:
            # every loader made while resuming gets it (a module may build one of its own before the Trainer does);
            # the sampler drops it once it starts another epoch
            sampler.resume_at(*self._resume)
        dataset = PositivePairs(users, items, self._train_weights)
        trainer = self.trainer
        if trainer is None:
            # a loader handed to a Trainer by hand: its position is not saved, so it must not claim to resume
            return DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=self.num_workers)
        if trainer.state.fn == TrainerFn.FITTING and trainer.ckpt_path and not self._restored:
            _log.warning(
                "InteractionsDataModule: the checkpoint %s holds no position in the training order (it was saved by "
                "an older lightning-sdp or without this datamodule); if it was saved mid-epoch, this fit restarts "
                "that epoch at its first batch, so some positives are trained twice in it and others not at all.",
                trainer.ckpt_path,
            )
            self._restored = True  # said once
        return _TrainLoader(dataset, batch_size=None, sampler=sampler, num_workers=self.num_workers)

    def _eval_loader(self, users: np.ndarray, target: CSR, known: CSR) -> DataLoader:
        batch = self.resolved_eval_batch_size
        assert batch is not None  # set by setup()
        sampler = EpochSeededBatchSampler(len(users), batch, shuffle=False)
        ds = _EvalBatches(users, target, known)
        return DataLoader(ds, batch_size=None, sampler=sampler, num_workers=self.num_workers)

    @override
    def val_dataloader(self) -> DataLoader | list:
        """Validation batches (known items: the training items); an empty list when there is no validation set."""
        self._check_setup()
        if self.val_fraction == 0 or len(self._val_users) == 0:
            return []
        return self._eval_loader(self._val_users, self.val_csr, self.train_csr)

    @override
    def test_dataloader(self) -> DataLoader:
        """Test batches (known items: the training and validation items)."""
        self._check_setup()
        if self.train_on_all:
            raise RuntimeError(
                "InteractionsDataModule(train_on_all=True) holds nothing out, so there is nothing to test on; score "
                "settings on a datamodule with the split (train_on_all=False), then train the final model on all."
            )
        return self._eval_loader(self._test_users, self.test_csr, self._known_for_test)  # type: ignore[arg-type]

    @override
    def predict_dataloader(self) -> DataLoader:
        """Every user, in row order, for ``trainer.predict(model, datamodule=dm)``: recommendations that leave out
        every interaction of the data (:attr:`known_csr`: training, validation and test items)."""
        self._check_setup()
        assert self.num_users is not None  # set by setup()
        users = np.arange(self.num_users, dtype=np.int64)
        return self._eval_loader(users, self.test_csr, self.known_csr)

    # ---------------------------------------------------------------------------------------------- checkpoints
    def _train_config(self) -> dict[str, Any]:
        """What fixes the order of the training batches: the training pairs (hashed), batch size, seed, shuffling."""
        users, items = self._pairs  # type: ignore[misc]
        if self._data_hash is None:
            digest = hashlib.blake2b(digest_size=8)
            for array in (np.array([self.num_users, self.num_items], np.int64), users, items):
                digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
            self._data_hash = digest.hexdigest()
        return {
            "train_pairs": len(users),
            "train_pairs_hash": self._data_hash,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    @staticmethod
    def _shard(trainer: Trainer | None) -> tuple[int, int] | None:
        """``(num_replicas, rank)`` when the Trainer shares the training batches among processes, else ``None``.

        The rule is Lightning's for putting a ``DistributedSampler`` in a loader (``use_distributed_sampler`` and a
        distributed strategy); the shares are the strategy's ``distributed_sampler_kwargs``.
        """
        if trainer is None:
            return None
        connector = trainer._accelerator_connector
        if not (connector.use_distributed_sampler and connector.is_distributed):
            return None
        kwargs = trainer.distributed_sampler_kwargs or {}
        replicas, rank = (
            int(kwargs.get("num_replicas", trainer.world_size)),
            int(kwargs.get("rank", trainer.global_rank)),
        )
        return (replicas, rank) if replicas > 1 else None

    @classmethod
    def _shards(cls, trainer: Trainer) -> int:
        """Processes that share one epoch's training batches (1 without sharing)."""
        shard = cls._shard(trainer)
        return 1 if shard is None else shard[0]

    @override
    def state_dict(self) -> dict[str, Any]:
        """The training order's identity and the position in it: ``epoch`` and ``step`` (batches done per process).

        The position is the fit loop's: ``step`` counts the batches of the current epoch that the loop has processed
        (0 once the epoch is complete), so a checkpoint saved mid-epoch resumes at the next batch.
        """
        if self._pairs is None:
            return {}
        trainer = self.trainer
        epoch, step, shards = 0, 0, 1
        if trainer is not None:
            # both are _ProcessedTrackers, which Lightning's annotations type as their base class
            epochs: Any = trainer.fit_loop.epoch_progress.current
            batches: Any = trainer.fit_loop.epoch_loop.batch_progress.current
            epoch = int(epochs.completed)
            # the batch counts belong to an epoch in progress only between its start and the end of its batches;
            # after that (including a stop by max_steps, which Lightning counts as the end of the epoch) they are
            # the finished epoch's, and the next epoch starts at its first batch
            if epochs.started > epochs.processed:
                step = int(batches.processed)
                step = step if step < trainer.num_training_batches else 0
            shards = self._shards(trainer)
        return {"config": self._train_config(), "epoch": epoch, "step": step, "processes": shards}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check that a resumed fit trains on the same batches, then continue the epoch where the checkpoint stopped.

        Only ``Trainer.fit(..., ckpt_path=...)`` uses the position; validating or testing a checkpoint ignores it.

        Raises:
            ValueError: when the checkpoint's training pairs, batch size, seed or shuffling differ from this
                datamodule's, or when it stopped mid-epoch under another number of processes.
        """
        if not state_dict:
            return
        if self._pairs is None:  # the Trainer sets up the datamodule first; a manual call waits for setup
            self._pending_state = state_dict
            return
        trainer = self.trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        self._restored = True
        saved, current = state_dict.get("config", {}), self._train_config()
        diff = [
            f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in current if saved.get(k) != current[k]
        ]
        if diff:
            raise ValueError(
                f"InteractionsDataModule: the checkpoint was trained on other batches ({'; '.join(diff)}), so the "
                "fit cannot continue where it stopped. Resume with the same data, val_fraction, test_fraction, "
                "batch_size, seed and shuffle; or start a new fit from the weights alone "
                "(SimpleXModule.load_from_checkpoint(path), no ckpt_path=)."
            )
        epoch, step = int(state_dict["epoch"]), int(state_dict["step"])
        saved_shards, shards = int(state_dict.get("processes", 1)), self._shards(trainer)
        if step and saved_shards != shards:
            raise ValueError(
                f"InteractionsDataModule: the checkpoint stopped {step} batches into epoch {epoch} with "
                f"{saved_shards} process(es) sharing the batches, but this run has {shards}; the processes' shares "
                "of the epoch would differ. Resume with the same number of processes (devices x num_nodes), or "
                "from a checkpoint saved at the end of an epoch."
            )
        self._resume = (epoch, step) if step else None  # step counts this process's own batches
        if step:
            _log.info("InteractionsDataModule: resuming epoch %d at batch %d", epoch, step)

    @override
    def teardown(self, stage: str) -> None:
        if stage == "fit":
            # used by this fit; a later fit on this datamodule starts where its own Trainer says
            self._resume, self._restored = None, False


__all__ = ["InteractionsDataModule"]
