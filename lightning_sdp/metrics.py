"""Full-ranking top-K recommendation metrics that torchmetrics lacks: ``RecallAtK`` and ``NDCGAtK``.

Both follow the LightGCN / SimpleX protocol: every item is ranked for each user, the user's training items are
masked out, and the metric is averaged over users with at least one test item. torchmetrics' retrieval metrics
keep every score in memory and ignore hits whose score is ``<= 0`` (wrong for cosine scores), so these classes
reduce each batch of users to two sums right away. States are sums, so the values are exact under DDP.

As in torchmetrics, a functional core does the arithmetic and the classes accumulate it: :func:`topk_hits` ranks a
batch, :func:`recall_at_k` / :func:`ndcg_at_k` score each user from the hits, and :func:`evaluate_ranking` runs the
whole protocol for any scorer over CSR splits (the package's one ranking evaluator: SimpleX's budgeted search and
the benchmarks' peers are scored with it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchmetrics import Metric
from typing_extensions import override


def csr_rows_mask(indptr: np.ndarray, indices: np.ndarray, rows: np.ndarray | Tensor, num_items: int) -> Tensor:
    """Dense ``(len(rows), num_items)`` bool mask of the items that CSR rows ``rows`` hold.

    Args:
        indptr: ``(num_users + 1,)`` CSR offsets.
        indices: CSR item ids.
        rows: the users whose rows to take.
        num_items: width of the mask.

    Returns:
        ``mask[i, j]`` is ``True`` where user ``rows[i]`` has item ``j``.
    """
    row_ids, cols = csr_rows_coo(indptr, indices, rows)
    mask = torch.zeros(len(rows), int(num_items), dtype=torch.bool)
    mask[row_ids, cols] = True
    return mask


def csr_rows_coo(indptr: np.ndarray, indices: np.ndarray, rows: np.ndarray | Tensor) -> tuple[Tensor, Tensor]:
    """The entries of CSR rows ``rows`` as ``(row, item)`` pairs, ``row`` numbering ``rows`` from 0.

    Args:
        indptr: ``(num_users + 1,)`` CSR offsets.
        indices: CSR item ids.
        rows: the users whose rows to take.

    Returns:
        ``(row_ids, cols)``: int64 tensors of equal length, in the order of ``rows``.
    """
    rows = np.asarray(rows.cpu() if isinstance(rows, Tensor) else rows, dtype=np.int64)
    starts, stops = indptr[rows], indptr[rows + 1]
    counts = (stops - starts).astype(np.int64)
    row_ids = np.repeat(np.arange(len(rows)), counts)
    cols = indices[np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())]
    return torch.from_numpy(row_ids), torch.from_numpy(cols.astype(np.int64))


def topk_hits(
    preds: Tensor, target: Tensor, k: int, exclude: Tensor | None = None, num_relevant: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Top-K hit matrix and number of relevant items per user, from dense scores.

    Args:
        preds: ``(B, num_items)`` scores.
        target: ``(B, num_items)`` bool, the relevant (test) items.
        k: cut-off.
        exclude: ``(B, num_items)`` bool, items never ranked (the training items), or ``None``.
        num_relevant: ``(B,)`` relevant items per user that ``exclude`` leaves, when the caller has them (from
            sparse rows: counting them in the dense ``target`` is a third of a full-ranking batch's time), or
            ``None`` to count them here.

    Returns:
        ``(hits, num_relevant)``: ``(B, min(k, num_items))`` bool, whether the item at each rank is relevant, and
        ``(B,)`` the number of relevant items that were not excluded.
    """
    if preds.ndim != 2 or preds.shape != target.shape:
        raise ValueError(
            f"preds and target must both be (num_users, num_items); got {tuple(preds.shape)} and {tuple(target.shape)}."
        )
    target = target.bool()
    if exclude is not None:
        if exclude.shape != preds.shape:
            raise ValueError(f"exclude must have the shape of preds {tuple(preds.shape)}, got {tuple(exclude.shape)}.")
        exclude = exclude.bool()
        preds = preds.masked_fill(exclude, float("-inf"))
        if num_relevant is None:  # excluded items score -inf, so only the count needs them out of the target
            target = target & ~exclude
    k = min(k, preds.shape[1])
    values, top = preds.float().topk(k, dim=1)
    hits = target.gather(1, top) & (values > float("-inf"))
    if num_relevant is None:
        num_relevant = torch.count_nonzero(target, dim=1)
    elif num_relevant.shape != (preds.shape[0],):
        raise ValueError(f"num_relevant must have shape ({preds.shape[0]},), got {tuple(num_relevant.shape)}.")
    return hits, num_relevant


def recall_at_k(hits: Tensor, num_relevant: Tensor) -> Tensor:
    """Recall@K of each user: relevant items in the top K over relevant items.

    Args:
        hits: ``(B, K)`` bool, whether the item at each rank is relevant (:func:`topk_hits`).
        num_relevant: ``(B,)`` relevant items per user.

    Returns:
        ``(B,)`` float64; 0 for a user without relevant items (the classes leave such users out of the mean).
    """
    return hits.sum(1).double() / num_relevant.clamp(min=1).double()


def ndcg_at_k(hits: Tensor, num_relevant: Tensor) -> Tensor:
    """NDCG@K of each user: binary relevance, ``log2(rank + 1)`` discounts, ideal DCG over ``min(K, relevant)``.

    Args:
        hits: ``(B, K)`` bool, whether the item at each rank is relevant (:func:`topk_hits`).
        num_relevant: ``(B,)`` relevant items per user.

    Returns:
        ``(B,)`` float64; 0 for a user without relevant items (the classes leave such users out of the mean).
    """
    k = hits.shape[1]
    discount = 1.0 / torch.log2(torch.arange(2, k + 2, device=hits.device, dtype=torch.float64))
    dcg = (hits.double() * discount).sum(1)
    ideal = torch.cumsum(discount, 0)[(num_relevant.clamp(1, k) - 1)]
    return dcg / ideal


def _resolve(
    preds: Tensor | None,
    target: Tensor | None,
    exclude: Tensor | None,
    hits: Tensor | None,
    num_relevant: Tensor | None,
    k: int,
) -> tuple[Tensor, Tensor]:
    if hits is None:
        if preds is None or target is None:
            raise ValueError("update() needs preds and target, or topk_hits and num_relevant.")
        return topk_hits(preds, target, k, exclude)
    if num_relevant is None or hits.ndim != 2 or num_relevant.shape != (hits.shape[0],):
        raise ValueError(
            "update(topk_hits=..., num_relevant=...) needs (B, K) hits and (B,) counts; got "
            f"{tuple(hits.shape)} and {None if num_relevant is None else tuple(num_relevant.shape)}."
        )
    return hits[:, :k].bool(), num_relevant


class _RankingAtK(Metric):
    """Mean over users with test items of a per-user ranking score; subclasses define :meth:`_per_user`."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    # states registered by add_state in __init__; declared so type checkers know they are Tensors
    total: Tensor
    count: Tensor

    def __init__(self, k: int = 20, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if k <= 0:
            raise ValueError(f"{type(self).__name__}: k must be positive, got {k}.")
        self.k = k
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def _per_user(self, hits: Tensor, n_rel: Tensor) -> Tensor:
        """Float64 score of each user from ``(B, K)`` top-K hits and ``(B,)`` relevant counts."""
        raise NotImplementedError

    @override
    def update(
        self,
        preds: Tensor | None = None,
        target: Tensor | None = None,
        exclude: Tensor | None = None,
        topk_hits: Tensor | None = None,
        num_relevant: Tensor | None = None,
    ) -> None:
        """Add a batch of users, from dense scores or from a top-K hit matrix computed once for several metrics.

        Args:
            preds: ``(B, num_items)`` scores.
            target: ``(B, num_items)`` bool, the test items.
            exclude: ``(B, num_items)`` bool, items never ranked (the training items), or ``None``.
            topk_hits: instead of ``preds``/``target``: ``(B, >= k)`` bool from :func:`topk_hits`.
            num_relevant: with ``topk_hits``: ``(B,)`` relevant items per user.
        """
        hits, n_rel = _resolve(preds, target, exclude, topk_hits, num_relevant, self.k)
        valid = n_rel > 0
        self.total = self.total + self._per_user(hits, n_rel)[valid].sum()
        self.count = self.count + valid.sum()

    @override
    def compute(self) -> Tensor:
        if self.count == 0:
            raise ValueError(f"{type(self).__name__}: no user with a test item was seen; the test set is empty.")
        return (self.total / self.count).float()


class RecallAtK(_RankingAtK):
    """Recall@K with full ranking: ``|top-K ∩ test items| / |test items|``, averaged over users with test items.

    Args:
        k: cut-off K. Default 20.
        kwargs: passed to :class:`torchmetrics.Metric`.
    """

    @override
    def _per_user(self, hits: Tensor, n_rel: Tensor) -> Tensor:
        return recall_at_k(hits, n_rel)


class NDCGAtK(_RankingAtK):
    """NDCG@K with full ranking, binary relevance, ``log2(rank + 1)`` discounts, ideal DCG over ``min(K, |test|)``.

    Args:
        k: cut-off K. Default 20.
        kwargs: passed to :class:`torchmetrics.Metric`.
    """

    @override
    def _per_user(self, hits: Tensor, n_rel: Tensor) -> Tensor:
        return ndcg_at_k(hits, n_rel)


def evaluate_ranking(
    score: Callable[[Tensor], Tensor],
    known: tuple[np.ndarray, np.ndarray],
    target: tuple[np.ndarray, np.ndarray],
    num_items: int,
    k: int = 20,
    users: np.ndarray | None = None,
    batch_size: int | None = None,
) -> tuple[float, float]:
    """Recall@K and NDCG@K of any scorer by full ranking, the known (training) items masked.

    The protocol of :class:`RecallAtK` / :class:`NDCGAtK` (and of ``SimpleXModule``'s evaluation), for any model that
    can score users against every item, with its splits as CSR arrays: users are scored in batches, each batch is
    reduced to its top-K hits right away.

    Args:
        score: maps a ``(B,)`` LongTensor of users to ``(B, num_items)`` scores.
        known: CSR ``(indptr, indices)`` of the items never ranked (the items the model trained on).
        target: CSR of the held-out items to find (validation or test).
        num_items: number of items.
        k: cut-off. Default 20.
        users: users to score (a subset, e.g. for cheap validation); ``None`` takes every user with a target item.
        batch_size: users per scoring batch; ``None`` keeps a batch's scores near 16 MB (``2**22 // num_items``
            users, 32 to 1024): larger score matrices are fresh memory the allocator maps and faults in at every
            batch, which makes larger batches slower, not faster.

    Returns:
        ``(recall, ndcg)`` averaged over the scored users that have target items.

    Raises:
        ValueError: no user to score has a target item, or ``score`` returns the wrong shape.

    Example:
        >>> import numpy as np, torch
        >>> known = (np.array([0, 1, 2]), np.array([0, 1]))  # user 0 trained on item 0, user 1 on item 1
        >>> target = (np.array([0, 1, 2]), np.array([2, 3]))  # the items to find: 2 and 3
        >>> scores = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
        >>> evaluate_ranking(lambda users: scores[users], known, target, num_items=4, k=1)
        (1.0, 1.0)
    """
    target_counts = np.diff(target[0])
    if users is None:
        users = np.flatnonzero(target_counts > 0)
    users = np.asarray(users, dtype=np.int64)
    users = users[target_counts[users] > 0]
    if len(users) == 0:
        raise ValueError("evaluate_ranking: no user has a target item; the validation/test split is empty.")
    if batch_size is None:
        batch_size = int(np.clip(2**22 // max(1, num_items), 32, 1024))
    recall, ndcg = RecallAtK(k), NDCGAtK(k)
    for start in range(0, len(users), batch_size):
        rows = users[start : start + batch_size]
        preds = score(torch.from_numpy(rows)).float()
        if preds.shape != (len(rows), num_items):
            raise ValueError(
                f"evaluate_ranking: score() returned {tuple(preds.shape)}, expected {(len(rows), num_items)}."
            )
        known_mask = csr_rows_mask(*known, rows, num_items)
        target_rows, target_items = csr_rows_coo(*target, rows)
        target_mask = torch.zeros_like(known_mask)
        target_mask[target_rows, target_items] = True
        # counted on the sparse rows (each item once): the relevant items are the target items that are not known
        fresh = ~known_mask[target_rows, target_items]
        pairs = torch.unique(target_rows[fresh] * num_items + target_items[fresh])
        relevant = torch.bincount(pairs // num_items, minlength=len(rows))
        hits, relevant = topk_hits(preds, target_mask, k, known_mask, num_relevant=relevant)
        recall.update(topk_hits=hits, num_relevant=relevant)
        ndcg.update(topk_hits=hits, num_relevant=relevant)
    return float(recall.compute()), float(ndcg.compute())
