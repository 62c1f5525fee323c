"""Top-K recommendation from a SimpleX model: stream the item scores, mask the known items, keep the best K.

The functional core of :meth:`SimpleXModule.recommend <lightning_sdp.models.simplex.SimpleXModule.recommend>`
(torchmetrics style: the functions here, a thin method on the module). Scores are the cosine scores of
:func:`lightning_sdp.kernels.cf_reference.normalized_scores`, the function ``SimpleXModule.score`` and the
evaluation use, computed ``item_chunk`` items at a time, so memory is bounded by ``batch x item_chunk`` scores
whatever the catalogue size. Also here: the look-up from the original (raw) ids of a CSV/TSV file to table rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from lightning_sdp.datamodules.interactions.csr import check_csr
from lightning_sdp.kernels import cf_reference as ref
from lightning_sdp.models.simplex.evaluation import DEFAULT_ITEM_CHUNK

#: what :meth:`SimpleXModule.recommend` accepts as users: one id, or a list / array / tensor of ids
IdsLike = int | Sequence[int] | np.ndarray | Tensor


class Recommendations(NamedTuple):
    """The top-K items of each user, best first; a plain tuple, so ``items, scores = model.recommend(...)`` works.

    Attributes:
        items: ``(num_users, k)`` int64 item ids (table rows, or the raw ids of the data file with ``raw_ids=True``).
        scores: ``(num_users, k)`` cosine scores of those items, in descending order along each row.
    """

    items: Tensor
    scores: Tensor


def as_ids(ids: IdsLike, what: str = "user") -> Tensor:
    """``ids`` as a 1-D int64 tensor (a single int becomes one id); raises on floats, booleans or 2-D input.

    Args:
        ids: an int, or a list / NumPy array / tensor of ints.
        what: ``"user"`` or ``"item"``, quoted in the error message.
    """
    if isinstance(ids, Tensor):
        tensor = ids.detach()
    else:
        array = np.asarray(ids)
        if array.size == 0:
            array = array.astype(np.int64)
        if array.dtype.kind not in "iub":
            raise ValueError(
                f"{what} ids must be integers, got {ids!r} (dtype {array.dtype}); pass ints (e.g. ids.astype(int))."
            )
        tensor = torch.from_numpy(np.array(array, dtype=np.int64 if array.dtype.kind == "u" else None, copy=True))
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        raise ValueError(f"{what} ids must be integers, got a {tensor.dtype} input; cast them (e.g. ids.long()).")
    if tensor.ndim > 1:
        raise ValueError(f"{what} ids must be one id or a 1-D list of ids, got shape {tuple(tensor.shape)}.")
    return tensor.reshape(-1).long()


def rows_of_ids(sorted_ids: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Table row of each raw id, by binary search in the row -> raw id table.

    Args:
        sorted_ids: ``(num_rows,)`` raw id of each table row, strictly increasing (``np.unique``'s order, which is how
            :class:`~lightning_sdp.datamodules.InteractionsDataModule` numbers the rows of a CSV/TSV file).
        ids: raw ids to look up.

    Returns:
        ``(rows, found)``: the row of each id, and whether the id is in the table at all (``rows`` is meaningless
        where ``found`` is ``False``).
    """
    ids = ids.to(sorted_ids.device)
    if len(sorted_ids) == 0:
        return torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    rows = torch.searchsorted(sorted_ids, ids).clamp_(max=len(sorted_ids) - 1)
    return rows, sorted_ids[rows] == ids


def remaining_items(num_items: int, known_indptr: Tensor, known_items: Tensor) -> Tensor:
    """Items left to rank for each row of a batch once its known items are masked (duplicates counted once).

    Args:
        num_items: catalogue size.
        known_indptr: ``(B + 1,)`` offsets of each row's known items in ``known_items``.
        known_items: the known items, in ``[0, num_items)``.

    Returns:
        ``(B,)`` int64 counts.
    """
    batch = len(known_indptr) - 1
    rows = torch.repeat_interleave(torch.arange(batch, device=known_items.device), known_indptr.diff())
    distinct = torch.unique(rows * num_items + known_items) // num_items
    return num_items - torch.bincount(distinct, minlength=batch)


def user_rows(
    ids: Tensor, num_users: int, raw: tuple[Tensor | None, Tensor | None] | None, has_raw_ids: bool
) -> Tensor:
    """Table rows of user ids: ``ids`` themselves (checked against ``num_users``), or, with ``raw`` the model's
    ``(raw_user_ids, raw_item_ids)``, the rows of those original ids (all must be known).

    Args:
        ids: the user ids asked for.
        num_users: rows of the user table.
        raw: the model's original ids when the caller passed ``raw_ids=True``, else ``None``.
        has_raw_ids: whether the model has original ids at all (for the hint of an out-of-range row).
    """
    if raw is not None:
        raw_users, raw_items = raw
        if raw_users is None or raw_items is None:
            raise ValueError(
                "SimpleXModule.recommend(raw_ids=True): this model has no raw ids; they come from training on a "
                "CSV/TSV file with InteractionsDataModule (or set_raw_ids()). With a LightGCN folder or synthetic "
                "data the ids are the table rows: pass raw_ids=False."
            )
        rows, found = rows_of_ids(raw_users, ids.cpu())
        if not bool(found.all()):
            unknown = ids[~found.to(ids.device)].unique()
            raise ValueError(
                f"SimpleXModule.recommend: {len(unknown)} user id(s) are not in the training data (e.g. "
                f"{unknown[:5].tolist()}); a collaborative-filtering model can only rank for users it was trained "
                "on. Drop them (recommend popular items instead) or retrain with their interactions."
            )
        return rows
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_users):
        bad = ids[(ids < 0) | (ids >= num_users)].unique()
        hint = " (these look like ids of the data file: pass raw_ids=True)" if has_raw_ids else ""
        raise ValueError(
            f"SimpleXModule.recommend: user ids must be rows in [0, {num_users}), got {bad[:5].tolist()}{hint}."
        )
    return ids.cpu()


def checked_known_csr(
    known: tuple[np.ndarray | Tensor, np.ndarray | Tensor] | None,
    num_users: int,
    num_items: int,
    training: tuple[np.ndarray, np.ndarray] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """The items never to recommend as a numpy CSR ``(indptr, indices)``: ``known`` (checked: ``num_users`` rows of
    item ids below ``num_items``), else the model's ``training`` interactions (an error when it has none)."""
    if known is None:
        if training is None:
            raise ValueError(
                "SimpleXModule.recommend: exclude_known=True but the model holds no training interactions (it was "
                "built without a datamodule, or loaded from a checkpoint written before they were saved); call "
                "model.set_interactions(*dm.train_csr), pass known=(indptr, indices), or exclude_known=False."
            )
        return training
    parts = [x.cpu().numpy() if isinstance(x, Tensor) else np.asarray(x) for x in known]
    if len(parts) != 2:
        raise ValueError(f"SimpleXModule.recommend: known must be a CSR (indptr, indices), got {len(parts)} arrays.")
    indptr, indices = check_csr(parts[0], parts[1], "SimpleXModule.recommend(known=...)")
    if len(indptr) != num_users + 1:
        raise ValueError(
            f"SimpleXModule.recommend: known must have a row for each of the {num_users} users "
            f"({num_users + 1} offsets), got {len(indptr)} offsets; pass e.g. dm.train_csr."
        )
    if len(indices) and (indices.min() < 0 or indices.max() >= num_items):
        raise ValueError(
            f"SimpleXModule.recommend: known item ids must be rows in [0, {num_items}), got "
            f"[{indices.min()}, {indices.max()}]."
        )
    return indptr, indices


def candidate_rows(ids: Tensor, num_items: int, raw_items: Tensor | None) -> Tensor:
    """The item rows a recommendation may choose from (``recommend(..., items=...)``): sorted, each once, checked.

    Args:
        ids: item rows, or the data file's item ids when ``raw_items`` (the model's row -> raw id table) is given.
        num_items: rows of the item table.
        raw_items: the model's raw item ids when the caller passed ``raw_ids=True``, else ``None``.
    """
    if raw_items is not None:
        rows, found = rows_of_ids(raw_items, ids.cpu())
        if not bool(found.all()):
            unknown = ids[~found.to(ids.device)].unique()
            raise ValueError(
                f"SimpleXModule: {len(unknown)} item id(s) are not in the training data (e.g. {unknown[:5].tolist()}); "
                "the model has no row for them."
            )
        ids = rows
    if ids.numel() == 0:
        raise ValueError("SimpleXModule: items= is empty; pass the item ids to choose from, or None for every item.")
    if int(ids.min()) < 0 or int(ids.max()) >= num_items:
        bad = ids[(ids < 0) | (ids >= num_items)].unique()
        raise ValueError(f"SimpleXModule: item ids must be rows in [0, {num_items}), got {bad[:5].tolist()}.")
    return torch.unique(ids.cpu())


def known_within(
    candidates: Tensor, num_items: int, known_indptr: Tensor, known_items: Tensor
) -> tuple[Tensor, Tensor]:
    """A batch-local CSR of known items re-expressed as positions in ``candidates`` (items outside it dropped).

    Args:
        candidates: sorted distinct item rows (:func:`candidate_rows`).
        num_items: rows of the item table.
        known_indptr: ``(B + 1,)`` offsets of each row's known items.
        known_items: the known item rows.

    Returns:
        ``(indptr, positions)``: each row's known items that are candidates, as indices into ``candidates``.
    """
    position = torch.full((num_items,), -1, dtype=torch.long)
    position[candidates] = torch.arange(len(candidates))
    mapped = position[known_items.cpu()]
    keep = mapped >= 0
    batch = len(known_indptr) - 1
    rows = torch.repeat_interleave(torch.arange(batch), known_indptr.cpu().diff())[keep]
    indptr = torch.zeros(batch + 1, dtype=torch.long)
    indptr[1:] = torch.cumsum(torch.bincount(rows, minlength=batch), 0)
    return indptr, mapped[keep]


def check_finite_rows(vectors: Tensor, what: str, names: Tensor | None = None) -> None:
    """Raise a ``ValueError`` naming the rows of ``vectors`` that hold a NaN or an infinity.

    A NaN score compares above every number in ``topk``, so one bad row would be every user's first recommendation.

    Args:
        vectors: ``(n, d)`` rows to check.
        what: what a row is, e.g. ``"item row"``, quoted in the message.
        names: the id of each row quoted in the message (default: its position).
    """
    bad = ~torch.isfinite(vectors).all(dim=1)
    if not bool(bad.any()):
        return
    at = torch.nonzero(bad).flatten()
    ids = at if names is None else names.to(at.device)[at]
    raise ValueError(
        f"SimpleXModule: {len(at)} {what}(s) hold NaN or infinite values (e.g. {ids[:5].tolist()}), so their scores "
        "cannot be ranked. The model is broken: retrain it (lower lr), or reload a checkpoint saved before it diverged."
    )


def top_k_recommendations(
    user_vectors: Tensor,
    item_normalized: Tensor,
    k: int,
    known_indptr: Tensor | None = None,
    known_items: Tensor | None = None,
    item_chunk: int = DEFAULT_ITEM_CHUNK,
) -> Recommendations:
    """The ``k`` best items of each user by cosine score, the known items excluded.

    Scores are :func:`~lightning_sdp.kernels.cf_reference.normalized_scores` of each item chunk (the same function
    as ``SimpleXModule.score`` and the evaluation); each chunk's top ``k`` is kept and the candidates are merged,
    so no ``(B, num_items)`` matrix is built beyond one chunk.

    Args:
        user_vectors: ``(B, d)`` user vectors (normalised here), e.g. ``SimpleXModule.user_vectors(users)``.
        item_normalized: ``(num_items, d)`` L2-normalised item rows.
        k: items per user; at most the number of items left after masking (checked).
        known_indptr: ``(B + 1,)`` offsets of each user's items never to recommend in ``known_items``, or ``None``
            to mask nothing. Default ``None``.
        known_items: those items, in ``[0, num_items)``. Default ``None``.
        item_chunk: items scored at once. Default 65536.

    Returns:
        :class:`Recommendations` with ``(B, k)`` items and scores, sorted by score, best first.

    Raises:
        ValueError: for ``k`` or ``item_chunk`` not positive, offsets that do not match the batch, or a user with
            fewer than ``k`` items left to rank.
    """
    if k <= 0 or item_chunk <= 0:
        raise ValueError(
            f"top_k_recommendations: k and item_chunk must be positive, got k={k}, item_chunk={item_chunk}."
        )
    batch, num_items = user_vectors.shape[0], item_normalized.shape[0]
    if (known_indptr is None) != (known_items is None):
        raise ValueError("top_k_recommendations: pass both known_indptr and known_items, or neither.")
    if known_indptr is None or known_items is None:
        left = torch.full((batch,), num_items, dtype=torch.long)
        known_indptr = torch.zeros(batch + 1, dtype=torch.long, device=user_vectors.device)
        known_items = torch.zeros(0, dtype=torch.long, device=user_vectors.device)
    else:
        if known_indptr.shape != (batch + 1,):
            raise ValueError(
                f"top_k_recommendations: known_indptr must have {batch + 1} offsets, got shape "
                f"{tuple(known_indptr.shape)}."
            )
        known_indptr = known_indptr.to(user_vectors.device, torch.long)
        known_items = known_items.to(user_vectors.device, torch.long)
        if known_items.numel() and (int(known_items.min()) < 0 or int(known_items.max()) >= num_items):
            raise ValueError(
                f"top_k_recommendations: known items must be in [0, {num_items}), got "
                f"[{int(known_items.min())}, {int(known_items.max())}]."
            )
        left = remaining_items(num_items, known_indptr, known_items)
    if batch and int(left.min()) < k:
        row = int(left.argmin())
        raise ValueError(
            f"top_k_recommendations: batch row {row} has only {int(left[row])} of the {num_items} items left to rank "
            f"once its known items are excluded, fewer than k={k}; lower k (or mask fewer items)."
        )
    known_rows = torch.repeat_interleave(torch.arange(batch, device=known_items.device), known_indptr.diff())
    values, indices = [], []
    for lo in range(0, num_items, item_chunk):
        hi = min(num_items, lo + item_chunk)
        scores = ref.normalized_scores(user_vectors, item_normalized[lo:hi])
        inside = (known_items >= lo) & (known_items < hi)
        scores[known_rows[inside], known_items[inside] - lo] = float("-inf")
        top_values, top = scores.topk(min(k, hi - lo), dim=1)
        values.append(top_values)
        indices.append(top + lo)
    if len(values) == 1:
        return Recommendations(indices[0], values[0])
    candidates, candidate_items = torch.cat(values, 1), torch.cat(indices, 1)
    best, order = candidates.topk(k, dim=1)
    return Recommendations(candidate_items.gather(1, order), best)


__all__ = [
    "IdsLike",
    "Recommendations",
    "as_ids",
    "candidate_rows",
    "check_finite_rows",
    "checked_known_csr",
    "known_within",
    "remaining_items",
    "rows_of_ids",
    "top_k_recommendations",
    "user_rows",
]
