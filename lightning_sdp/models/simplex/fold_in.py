"""Fold a new user into a trained SimpleX model: the user row that best explains their items, the rest held fixed.

A user who was not in the training data has no row ``e_u``. :func:`fold_in_user` finds one: it minimises the
model's own training loss over the user's items as positives, with every item the user has not interacted with as
the negatives (the expectation of the loss over uniformly drawn negatives), while the item rows, ``V`` and the
attention weights stay as trained. With ``g < 1`` the history part ``(1 - g) V h`` comes from the given items
exactly as for a trained user (the same aggregator and cap), so only ``e_u`` is solved for. The objective, with
``c_j = cos(p, e_j)``, ``P`` the user's items and ``N`` the others:

* CCL: ``mean_{i in P} relu(1 - c_i) + w mean_{j in N} relu(c_j - m)``;
* softmax: ``mean_{i in P} [log(exp(c_i / t) + n mean_{j in N} exp(c_j / t)) - c_i / t]``, ``n`` the number of
  negatives a training sample draws.

It starts from the direction of the mean of the user's normalised item rows (which maximises the summed cosine with
them), at the median norm of the trained user rows, and runs L-BFGS. Deterministic; costs ``O(steps x num_items x
d)``, like scoring the user a few dozen times.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sdp.kernels import cf_reference as ref

if TYPE_CHECKING:
    from lightning_sdp.models.simplex.module import SimpleXModule

DEFAULT_STEPS = 50


def new_user_history(model: SimpleXModule, items: Tensor) -> Tensor:
    """``(1, H)`` padded history of a new user with ``items`` (capped at ``max_history`` as for trained users)."""
    indptr = np.array([0, len(items)], dtype=np.int64)
    capped = ref.cap_history(indptr, items.numpy(), model.config.max_history, model.config.seed)
    return ref.padded_history(*capped)


def user_vector(model: SimpleXModule, row: Tensor, history: Tensor | None) -> Tensor:
    """``p = g e + (1 - g) V h`` of one user with row ``row`` ``(d,)`` and padded ``history`` ``(1, H)``."""
    c = model.config
    _, item_emb = model.tables()
    if not c.uses_history or history is None:
        return row.unsqueeze(0)
    att_w, att_b, att_q = (None if p is None else p.detach() for p in model.attention_weights())
    return ref.user_vectors(
        row.unsqueeze(0),
        item_emb.weight.detach(),
        model.aggregator.detach(),
        torch.zeros(1, dtype=torch.long),
        c.g,
        history,
        None,
        c.aggregator,
        att_w,
        att_b,
        att_q,
    )


def fold_in_objective(model: SimpleXModule, p: Tensor, positives: Tensor, item_normalized: Tensor) -> Tensor:
    """The fold-in loss (module docstring) of user vector ``p`` ``(1, d)`` with items ``positives`` (distinct rows)."""
    c = model.config
    scores = (F.normalize(p, dim=-1, eps=1e-12) @ item_normalized.t()).squeeze(0)
    others = torch.ones_like(scores, dtype=torch.bool)
    others[positives] = False
    pos, neg = scores[positives], scores[others]
    if c.loss_name == "softmax":
        z_pos, z_neg = pos / c.temperature, neg / c.temperature
        spread = torch.logsumexp(z_neg, 0) - np.log(len(neg)) + np.log(c.num_negatives)  # log(n mean_j exp(z_j))
        return (torch.logaddexp(z_pos, spread) - z_pos).mean()
    return torch.relu(1.0 - pos).mean() + c.negative_weight * torch.relu(neg - c.margin).mean()


def fold_in_user(model: SimpleXModule, items: Tensor, steps: int = DEFAULT_STEPS) -> Tensor:
    """The user vector ``p`` ``(d,)`` of a new user with the given item rows (see the module docstring).

    Args:
        model: a trained model.
        items: the user's item rows (1-D int64; duplicates count once).
        steps: L-BFGS iterations. Default 50.

    Raises:
        ValueError: for no items, or items that cover the whole catalogue (nothing left to contrast them with).
    """
    user_emb, item_emb = model.tables()
    positives = torch.unique(items.cpu())
    if len(positives) == 0:
        raise ValueError("SimpleXModule: a new user needs at least one item to be folded in.")
    if len(positives) >= model.num_items:
        raise ValueError("SimpleXModule: the new user's items cover every item; nothing is left to recommend.")
    table = item_emb.weight.detach().cpu()
    item_normalized = F.normalize(table, dim=-1, eps=1e-12)
    history = new_user_history(model, positives) if model.config.uses_history else None
    scale = user_emb.weight.detach().cpu().norm(dim=1).median().clamp_min(1e-6)
    row = (F.normalize(item_normalized[positives].mean(0), dim=0, eps=1e-12) * scale).requires_grad_(True)
    optimizer = torch.optim.LBFGS([row], max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = fold_in_objective(model, user_vector(model, row, history), positives, item_normalized)
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    with torch.no_grad():
        return user_vector(model, row.detach(), history).squeeze(0)


__all__ = ["DEFAULT_STEPS", "fold_in_objective", "fold_in_user", "new_user_history", "user_vector"]
