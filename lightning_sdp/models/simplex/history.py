"""The training interactions a SimpleX model keeps: the items to mask when ranking and the capped histories."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor

from lightning_sdp.kernels import cf_reference as ref


@dataclass(frozen=True)
class UserHistories:
    """Training interactions (CSR) and each user's history, capped at ``max_history`` items (a seeded subset).

    Attributes:
        train_indptr: ``(num_users + 1,)`` offsets of all training items.
        train_indices: item ids of all training items.
        indptr: offsets of the capped histories.
        indices: item ids of the capped histories.
        padded: ``(num_users, max_len)`` capped histories padded with ``-1`` (the reference backend's form), or
            ``None`` when the model does not aggregate histories (``g = 1``).
    """

    train_indptr: np.ndarray
    train_indices: np.ndarray
    indptr: np.ndarray
    indices: np.ndarray
    padded: Tensor | None

    @classmethod
    def from_csr(
        cls,
        indptr: np.ndarray,
        indices: np.ndarray,
        num_users: int,
        num_items: int,
        max_history: int,
        seed: int,
        padded: bool,
    ) -> UserHistories:
        """Check the CSR against the table sizes and cap the histories.

        Args:
            indptr: ``(num_users + 1,)`` offsets.
            indices: item ids of each user's training items.
            num_users: rows of the user table.
            num_items: rows of the item table.
            max_history: cap on the history length.
            seed: seed of the capped subsets.
            padded: also build the padded ``(num_users, max_len)`` form.
        """
        indptr = np.ascontiguousarray(indptr, dtype=np.int64)
        indices = np.ascontiguousarray(indices, dtype=np.int64)
        if len(indptr) != num_users + 1:
            raise ValueError(
                f"SimpleXModule: the interactions have {len(indptr) - 1} users but the user table has {num_users} rows."
            )
        if len(indices) and (indices.min() < 0 or indices.max() >= num_items):
            raise ValueError(
                f"SimpleXModule: item ids must be in [0, {num_items}), got [{indices.min()}, {indices.max()}]."
            )
        hist_indptr, hist_indices = ref.cap_history(indptr, indices, max_history, seed)
        pad = ref.padded_history(hist_indptr, hist_indices) if padded else None
        return cls(indptr, indices, hist_indptr, hist_indices, pad)
