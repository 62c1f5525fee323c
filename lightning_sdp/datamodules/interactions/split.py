"""Seeded per-user splits: the held-out test set of CSV / synthetic data, and the validation set of any data."""

from __future__ import annotations

import numpy as np

from lightning_sdp.datamodules.interactions.csr import CSR, check_csr

# the validation split draws from its own stream of the user's seed (a spawn key no other seeded draw here uses), so
# it is independent of the test split (default_rng(seed)) and of the epoch shuffles (default_rng([seed, epoch]))
_VALIDATION_STREAM = 0x76616C  # "val"


def split_per_user(
    users: np.ndarray, items: np.ndarray, test_fraction: float, seed: int
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Seeded per-user test split: ``floor(n * test_fraction)`` of each user's ``n`` items go to test, one stays.

    Args:
        users: user id of each pair.
        items: item id of each pair.
        test_fraction: share of each user's items held out, in ``[0, 1)``.
        seed: seed of the draw (``numpy.random.default_rng(seed)``).

    Returns:
        ``((train_users, train_items), (test_users, test_items))``.
    """
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.random(len(users)), users))
    users, items = users[order], items[order]
    counts = np.bincount(users)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(len(users)) - np.repeat(starts, counts)
    n_test = np.minimum(np.floor(counts * test_fraction).astype(np.int64), np.maximum(counts - 1, 0))
    is_test = rank < np.repeat(n_test, counts)
    return (users[~is_test], items[~is_test]), (users[is_test], items[is_test])


def validation_counts(counts: np.ndarray, fraction: float) -> np.ndarray:
    """Validation items per user: ``round(n * fraction)`` clipped to ``[1, n - 1]`` for ``n >= 2``, else 0.

    ``fraction == 0`` gives 0 for everyone.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if fraction == 0:
        return np.zeros_like(counts)
    wanted = np.rint(counts * fraction).astype(np.int64)
    return np.where(counts >= 2, np.clip(wanted, 1, np.maximum(counts - 1, 1)), 0)


def split_validation(indptr: np.ndarray, indices: np.ndarray, fraction: float, seed: int) -> tuple[CSR, CSR]:
    """Carve a validation set out of training interactions, per user and seeded.

    Each user with ``n >= 2`` training items gives ``round(n * fraction)`` of them, at least 1 and at most ``n - 1``
    (so every user keeps a training item); users with fewer than 2 items give none. Which items go is drawn from
    a stream of ``seed`` of its own (independent of the test split and of the epoch shuffles), so the same
    ``(indptr, indices, fraction, seed)`` always give the same split. Benchmarks that score peers call this with the
    datamodule's arguments to use the very same split.

    Args:
        indptr: ``(num_users + 1,)`` CSR offsets of the training interactions.
        indices: their item ids.
        fraction: share of each user's items for validation, in ``[0, 1)``; ``0`` gives an empty validation set.
        seed: the datamodule's ``seed``.

    Returns:
        ``(train_csr, val_csr)``: disjoint, same number of rows, their union is the input; items stay in input order.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"split_validation: fraction must be in [0, 1), got {fraction}.")
    csr = check_csr(indptr, indices, "split_validation")
    counts = csr.counts()
    n_val = validation_counts(counts, fraction)
    nnz = len(csr.indices)
    rows = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    rng = np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(_VALIDATION_STREAM,)))
    order = np.lexsort((rng.random(nnz), rows))  # rows stay grouped; random order within each row
    rank_in_row = np.arange(nnz, dtype=np.int64) - np.repeat(csr.indptr[:-1], counts)
    is_val = np.zeros(nnz, dtype=bool)
    is_val[order] = rank_in_row < np.repeat(n_val, counts)
    val_indptr = np.zeros_like(csr.indptr)
    np.cumsum(n_val, out=val_indptr[1:])
    train_indptr = csr.indptr - val_indptr
    return (
        CSR(train_indptr, np.ascontiguousarray(csr.indices[~is_val])),
        CSR(val_indptr, np.ascontiguousarray(csr.indices[is_val])),
    )


__all__ = ["split_per_user", "split_validation", "validation_counts"]
