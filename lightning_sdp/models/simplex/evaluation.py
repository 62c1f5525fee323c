"""Full-ranking evaluation of a SimpleX model: stream the item scores, mask the known items, keep the top K.

The LightGCN / SimpleX protocol ranks every item for each user and never ranks the items the user is known to
have (the training items; for the test split, training and validation items). Memory stays bounded by the
evaluation batch: scores are computed ``item_chunk`` items at a time and only the running top K of each chunk is
kept, so no ``num_users x num_items`` (nor ``batch x num_items`` beyond one chunk) matrix is ever built.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sdp.metrics import topk_hits

DEFAULT_ITEM_CHUNK = 65_536  # items scored at once: an eval batch of 1024 users needs 256 MiB of float32 scores


def batch_csr(indptr: np.ndarray, indices: np.ndarray, rows: Tensor | np.ndarray) -> tuple[Tensor, Tensor]:
    """The CSR rows ``rows`` of ``(indptr, indices)`` as batch offsets and items (the eval batches' form).

    Args:
        indptr: ``(num_users + 1,)`` offsets of the whole CSR.
        indices: its item ids.
        rows: the users of the batch.

    Returns:
        ``(offsets, items)``: ``(len(rows) + 1,)`` offsets into ``items``.
    """
    rows = np.asarray(rows.cpu() if isinstance(rows, Tensor) else rows, dtype=np.int64)
    starts, counts = indptr[rows], indptr[rows + 1] - indptr[rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    gather = np.repeat(starts - offsets[:-1], counts) + np.arange(offsets[-1], dtype=np.int64)
    return torch.from_numpy(offsets), torch.from_numpy(np.ascontiguousarray(indices[gather], dtype=np.int64))


def rank_and_score(
    user_vectors: Tensor,
    item_normalized: Tensor,
    test_indptr: Tensor,
    test_items: Tensor,
    known_indptr: Tensor,
    known_items: Tensor,
    k: int,
    item_chunk: int = DEFAULT_ITEM_CHUNK,
) -> tuple[Tensor, Tensor]:
    """Cosine full ranking of a batch of users: top-K hit matrix and relevant counts for ``RecallAtK``/``NDCGAtK``.

    Args:
        user_vectors: ``(B, d)`` user vectors (normalised here).
        item_normalized: ``(num_items, d)`` L2-normalised item rows.
        test_indptr: ``(B + 1,)`` offsets of each user's relevant (held-out) items in ``test_items``.
        test_items: the relevant items.
        known_indptr: ``(B + 1,)`` offsets of each user's known items in ``known_items``: never ranked, and not
            counted as relevant.
        known_items: the known items.
        k: cut-off K.
        item_chunk: items scored at once (bounds the memory to ``B x item_chunk`` scores).

    Returns:
        ``(hits, num_relevant)``: ``(B, min(k, num_items))`` bool, whether the item at each rank is relevant, and
        ``(B,)`` the number of relevant items that are not known. Pass them to the metrics' ``update(topk_hits=...,
        num_relevant=...)``.
    """
    if item_chunk <= 0 or k <= 0:
        raise ValueError(f"rank_and_score: k and item_chunk must be positive, got k={k}, item_chunk={item_chunk}.")
    batch, num_items = user_vectors.shape[0], item_normalized.shape[0]
    for name, offsets in (("test_indptr", test_indptr), ("known_indptr", known_indptr)):
        if offsets.shape != (batch + 1,):
            raise ValueError(f"rank_and_score: {name} must have {batch + 1} offsets, got shape {tuple(offsets.shape)}.")
    users = F.normalize(user_vectors, dim=-1, eps=1e-12)
    known_rows = torch.repeat_interleave(torch.arange(batch), known_indptr.diff())
    test_rows = torch.repeat_interleave(torch.arange(batch), test_indptr.diff())
    values, indices = [], []
    for lo in range(0, num_items, item_chunk):
        hi = min(num_items, lo + item_chunk)
        scores = users @ item_normalized[lo:hi].t()
        inside = (known_items >= lo) & (known_items < hi)
        scores[known_rows[inside], known_items[inside] - lo] = float("-inf")
        top_values, top = scores.topk(min(k, hi - lo), dim=1)
        values.append(top_values)
        indices.append(top + lo)
    candidates, candidate_items = torch.cat(values, 1), torch.cat(indices, 1)
    # pairs (row, item) as one int64 key, so membership tests need no dense (B, num_items) mask
    test_keys = test_rows * num_items + test_items
    known_keys = known_rows * num_items + known_items
    relevant = ~torch.isin(test_keys, known_keys)  # known items that are also held out are never ranked
    target = torch.isin(torch.arange(batch).unsqueeze(1) * num_items + candidate_items, test_keys[relevant])
    hits, _ = topk_hits(candidates, target, k)
    return hits, torch.bincount(test_rows[relevant], minlength=batch)
