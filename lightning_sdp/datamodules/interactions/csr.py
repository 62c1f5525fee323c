"""Compressed sparse rows (CSR) of user -> items, the one layout every interaction set in this package uses."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np


class CSR(NamedTuple):
    """``(indptr, indices)``: the items of user ``u`` are ``indices[indptr[u]:indptr[u + 1]]`` (int64, sorted).

    A plain tuple, so ``indptr, indices = dm.train_csr`` works. Calling it (``dm.train_csr()``, the form used before
    ``train_csr`` became a property) still returns the tuple, with a ``DeprecationWarning``.
    """

    indptr: np.ndarray
    indices: np.ndarray

    @property
    def num_rows(self) -> int:
        """Number of users (rows)."""
        return len(self.indptr) - 1

    def counts(self) -> np.ndarray:
        """Items per user."""
        return np.diff(self.indptr)

    def __call__(self) -> CSR:
        warnings.warn(
            "InteractionsDataModule.train_csr / val_csr / test_csr are properties now; drop the parentheses.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self


def to_csr(users: np.ndarray, items: np.ndarray, num_users: int) -> CSR:
    """CSR of ``(user, item)`` pairs, items sorted within each user, duplicate pairs removed.

    Args:
        users: user id of each pair, in ``[0, num_users)``.
        items: item id of each pair.
        num_users: number of rows.
    """
    users = np.asarray(users, dtype=np.int64)
    items = np.asarray(items, dtype=np.int64)
    order = np.lexsort((items, users))
    users, items = users[order], items[order]
    if len(users):
        keep = np.ones(len(users), dtype=bool)
        keep[1:] = (users[1:] != users[:-1]) | (items[1:] != items[:-1])
        users, items = users[keep], items[keep]
    indptr = np.zeros(num_users + 1, dtype=np.int64)
    np.cumsum(np.bincount(users, minlength=num_users), out=indptr[1:])
    return CSR(indptr, np.ascontiguousarray(items, dtype=np.int64))


def check_csr(indptr: np.ndarray, indices: np.ndarray, name: str = "csr") -> CSR:
    """``(indptr, indices)`` as int64 arrays, after checking that they form a CSR matrix.

    Raises:
        ValueError: when ``indptr`` is not 1-D, does not start at 0, decreases, or does not end at ``len(indices)``.
    """
    indptr = np.ascontiguousarray(indptr, dtype=np.int64)
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    valid = indptr.ndim == 1 and len(indptr) >= 1 and indptr[0] == 0 and indptr[-1] == len(indices)
    if not valid or (np.diff(indptr) < 0).any():
        raise ValueError(
            f"{name}: not a CSR matrix: indptr must be 1-D, start at 0, never decrease and end at len(indices) "
            f"= {len(indices)}; got indptr of shape {indptr.shape} ending at {indptr[-1] if indptr.size else None}."
        )
    return CSR(indptr, indices)


def merge_csr(first: tuple[np.ndarray, np.ndarray], second: tuple[np.ndarray, np.ndarray]) -> CSR:
    """Row-wise union of two CSR matrices with the same rows (e.g. train and the validation carved out of it).

    The inverse of :func:`~lightning_sdp.datamodules.interactions.split_validation`: items end up sorted within each
    row and a pair in both is kept once.

    Raises:
        ValueError: when either is not a CSR matrix or their numbers of rows differ.
    """
    a, b = check_csr(*first, "merge_csr (first)"), check_csr(*second, "merge_csr (second)")
    if a.num_rows != b.num_rows:
        raise ValueError(f"merge_csr: the two matrices must have the same rows, got {a.num_rows} and {b.num_rows}.")
    rows = np.arange(a.num_rows, dtype=np.int64)
    users = np.concatenate([np.repeat(rows, a.counts()), np.repeat(rows, b.counts())])
    return to_csr(users, np.concatenate([a.indices, b.indices]), a.num_rows)


def gather_rows(csr: CSR, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Batch-local CSR of ``rows``: ``(offsets, items)``; ``rows[i]``'s items are ``items[offsets[i]:offsets[i+1]]``."""
    rows = np.asarray(rows, dtype=np.int64)
    starts, stops = csr.indptr[rows], csr.indptr[rows + 1]
    counts = stops - starts
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    positions = np.repeat(starts - offsets[:-1], counts) + np.arange(offsets[-1], dtype=np.int64)
    return offsets, csr.indices[positions]


__all__ = ["CSR", "check_csr", "gather_rows", "merge_csr", "to_csr"]
