"""Tables warm-started from a truncated SVD of the training matrix (``SimpleXModule(init="svd")``).

The training interactions as a users x items matrix ``R`` (ones), normalised as LightGCN's propagation matrix,
``D_u^{-1/2} R D_i^{-1/2}`` (``D`` the users' and items' interaction counts), so that popular items do not take the
leading directions; its rank-``d`` randomized SVD ``U S V^T`` (:func:`torch.svd_lowrank`, seeded) gives the rows
``U S^{1/2}`` and ``V S^{1/2}``, each rescaled to the norm a normal initialisation of ``init_std`` has on average
(``init_std sqrt(d)``), so that the learning rate keeps its meaning. A user or item without interactions keeps its
normal initialisation. Cosine scores of the warm start are those of the truncated SVD, a strong popularity-corrected
baseline, and training starts from there instead of from noise.

The decomposition is cached per training matrix, dimension and seed, so the trials of a search share it.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import Tensor

_CACHE: dict[tuple[str, int, int], tuple[Tensor, Tensor]] = {}
_CACHE_SIZE = 4


def _key(indptr: np.ndarray, indices: np.ndarray, num_items: int, dim: int, seed: int) -> tuple[str, int, int]:
    digest = hashlib.blake2b(digest_size=16)
    for array in (np.array([num_items], np.int64), indptr, indices):
        digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
    return digest.hexdigest(), dim, seed


def svd_factors(indptr: np.ndarray, indices: np.ndarray, num_items: int, dim: int, seed: int) -> tuple[Tensor, Tensor]:
    """``(user_rows, item_rows)`` of the normalised training matrix's rank-``dim`` SVD, ``U S^{1/2}`` and
    ``V S^{1/2}`` (float32; zero rows for users and items without interactions).

    Args:
        indptr: ``(num_users + 1,)`` CSR offsets of the training interactions.
        indices: their item ids.
        num_items: columns of the matrix.
        dim: rank kept (the embedding dimension); at most ``min(num_users, num_items)`` directions are non-zero.
        seed: seed of the randomized SVD.
    """
    key = _key(indptr, indices, num_items, dim, seed)
    if key in _CACHE:
        return _CACHE[key]
    num_users = len(indptr) - 1
    counts = np.diff(indptr)
    rows = np.repeat(np.arange(num_users), counts)
    item_counts = np.bincount(indices, minlength=num_items)
    values = 1.0 / np.sqrt(counts[rows] * item_counts[indices])
    matrix = torch.sparse_coo_tensor(
        torch.from_numpy(np.stack([rows, indices])),
        torch.from_numpy(values),
        (num_users, num_items),
        check_invariants=True,
    ).coalesce()
    rank = min(dim, num_users, num_items)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # oversampled by 10 directions (Halko et al.'s advice), then truncated: near the best rank-d approximation
        u, s, v = torch.svd_lowrank(matrix, q=min(rank + 10, num_users, num_items), niter=4)
    u, s, v = u[:, :rank], s[:rank], v[:, :rank]
    root = s.clamp_min(0).sqrt()
    users, items = torch.zeros(num_users, dim), torch.zeros(num_items, dim)
    users[:, :rank] = (u * root).float()
    items[:, :rank] = (v * root).float()
    users[torch.from_numpy(counts == 0)] = 0.0  # rounding leaves ~1e-17 where nothing was observed
    items[torch.from_numpy(item_counts == 0)] = 0.0
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (users, items)
    return users, items


def warm_start(table: Tensor, factors: Tensor, init_std: float) -> None:
    """Overwrite the rows of ``table`` that have a non-zero factor with it, rescaled to norm ``init_std sqrt(d)``."""
    norms = factors.norm(dim=1, keepdim=True)
    has = norms.squeeze(1) > 1e-12
    target = init_std * table.shape[1] ** 0.5
    with torch.no_grad():
        table[has] = (factors[has] / norms[has] * target).to(table.dtype)


__all__ = ["svd_factors", "warm_start"]
