"""Plain-PyTorch SimpleX: the ground truth for HEAT's fused kernel and the baseline it is measured against.

Mao et al., "SimpleX: A Simple and Strong Baseline for Collaborative Filtering" (CIKM 2021). Everything here is
batched tensors + autograd: gather the rows, aggregate the history (mean or attention, as the official RecZoo
``BehaviorAggregator``), normalise, ``bmm`` against the negatives, then the cosine contrastive loss (SimpleX) or the
softmax over temperature-scaled cosines (HEAT's code), optionally clipping every row's per-sample gradient.
The fused numba kernel (:mod:`lightning_sdp.kernels.cf_numba`) computes the same function sample by sample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import overload

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.optim.optimizer import ParamsT

_EPS = 1e-12


def cap_history(
    indptr: np.ndarray, indices: np.ndarray, max_history: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Keep at most ``max_history`` items per user, a seeded random subset in a fixed order.

    Args:
        indptr: ``(num_users + 1,)`` CSR offsets of the training items.
        indices: CSR item ids.
        max_history: the cap (``<= 0`` keeps no history).
        seed: seed of the subset choice.

    Returns:
        ``(indptr, indices)`` of the capped histories, int64.
    """
    indptr = np.asarray(indptr, dtype=np.int64)
    indices = np.asarray(indices, dtype=np.int64)
    counts = np.diff(indptr)
    users = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    key = np.random.default_rng(seed).random(len(indices))
    order = np.lexsort((key, users))
    rank = np.arange(len(indices), dtype=np.int64) - np.repeat(indptr[:-1], counts)
    keep = order[rank < max(max_history, 0)]  # rank is position within the user's (sorted-by-user) block
    new_counts = np.minimum(counts, max(max_history, 0))
    new_indptr = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(new_counts, out=new_indptr[1:])
    return new_indptr, np.ascontiguousarray(indices[keep])


def padded_history(indptr: np.ndarray, indices: np.ndarray) -> Tensor:
    """``(num_users, max_len)`` LongTensor of each user's history, padded with ``-1``."""
    counts = np.diff(indptr)
    width = max(int(counts.max(initial=0)), 1)
    out = np.full((len(counts), width), -1, dtype=np.int64)
    users = np.repeat(np.arange(len(counts)), counts)
    cols = np.arange(len(indices)) - np.repeat(indptr[:-1], counts)
    out[users, cols] = indices
    return torch.from_numpy(out)


def aggregate_history(
    item_emb: Tensor,
    hist: Tensor,
    mask: Tensor,
    aggregator: str = "mean",
    user_rows: Tensor | None = None,
    att_w: Tensor | None = None,
    att_b: Tensor | None = None,
    att_q: Tensor | None = None,
) -> Tensor:
    """SimpleX's behaviour aggregator ``h`` over padded histories (the official ``BehaviorAggregator``, before ``V``).

    ``"mean"``: ``h = mean_k e_k``. ``"user_attention"``: ``a_k = softmax_k(e_u . tanh(W_k e_k + b_k))``,
    ``h = sum_k a_k e_k``. ``"self_attention"``: the same with a learned query ``q`` instead of ``e_u``. Padding and
    excluded entries get no weight; a user with no history gets ``h = 0``.

    Args:
        item_emb: ``(num_items, d)`` item table.
        hist: ``(B, H)`` history item ids (any valid id where ``mask`` is ``False``).
        mask: ``(B, H)`` bool, the entries that belong to the history.
        aggregator: ``"mean"``, ``"user_attention"`` or ``"self_attention"``.
        user_rows: ``(B, d)`` user rows (the query of ``"user_attention"``).
        att_w: ``(d, d)`` key weights ``W_k`` (attention aggregators).
        att_b: ``(d,)`` key bias ``b_k`` (attention aggregators).
        att_q: ``(d,)`` query ``q`` (``"self_attention"``).

    Returns:
        ``(B, d)`` aggregated histories.
    """
    rows = item_emb[hist] * mask.unsqueeze(-1).to(item_emb.dtype)
    if aggregator == "mean":
        count = mask.sum(1, keepdim=True).clamp_min(1).to(item_emb.dtype)
        return rows.sum(1) / count
    if aggregator not in ("user_attention", "self_attention"):
        raise ValueError(
            f"aggregate_history: unknown aggregator {aggregator!r}; use 'mean', 'user_attention' or 'self_attention'."
        )
    query = user_rows if aggregator == "user_attention" else att_q
    if att_w is None or att_b is None or query is None:
        raise ValueError(f"aggregate_history: the {aggregator!r} aggregator needs att_w, att_b and its query.")
    keys = torch.tanh(rows @ att_w.t() + att_b)
    scores = (keys * (query.unsqueeze(1) if query.dim() == 2 else query)).sum(-1)
    # a large negative instead of -inf keeps users without history finite (their weights are zeroed below)
    weights = torch.softmax(scores.masked_fill(~mask, -1e30), dim=1) * mask.to(scores.dtype)
    return (weights.unsqueeze(-1) * rows).sum(1)


def user_vectors(
    user_emb: Tensor,
    item_emb: Tensor,
    V: Tensor,
    users: Tensor,
    g: float,
    history: Tensor | None = None,
    exclude: Tensor | None = None,
    aggregator: str = "mean",
    att_w: Tensor | None = None,
    att_b: Tensor | None = None,
    att_q: Tensor | None = None,
) -> Tensor:
    """SimpleX user vectors ``p_u = g e_u + (1 - g) V h_u`` with ``h_u`` from :func:`aggregate_history`.

    Args:
        user_emb: ``(num_users, d)`` user table.
        item_emb: ``(num_items, d)`` item table.
        V: ``(d, d)`` aggregator matrix.
        users: ``(B,)`` user ids.
        g: gate; ``g >= 1`` returns the user rows (MF-CCL).
        history: ``(num_users, H)`` padded histories (``-1`` = padding); needed when ``g < 1``.
        exclude: ``(B,)`` item to leave out of each user's history (the positive being trained), or ``None``.
        aggregator: ``"mean"``, ``"user_attention"`` or ``"self_attention"``.
        att_w: ``(d, d)`` attention key weights (attention aggregators).
        att_b: ``(d,)`` attention key bias (attention aggregators).
        att_q: ``(d,)`` attention query (``"self_attention"``).

    Returns:
        ``(B, d)`` user vectors.
    """
    e_u = user_emb[users]
    if g >= 1.0:
        return e_u
    if history is None:
        raise ValueError("user_vectors: `history` is required when g < 1 (SimpleX aggregates the user's items).")
    hist = history[users]
    mask = hist >= 0
    if exclude is not None:
        mask = mask & (hist != exclude[:, None])
    h = aggregate_history(item_emb, hist.clamp_min(0), mask, aggregator, e_u, att_w, att_b, att_q)
    return g * e_u + (1.0 - g) * (h @ V.t())


def ccl_loss(
    p: Tensor,
    e_pos: Tensor,
    e_neg: Tensor,
    margin: float,
    negative_weight: float,
    reduction: str = "mean",
    dropout_mask: Tensor | None = None,
) -> Tensor:
    """Cosine contrastive loss ``relu(1 - cos(p, e_i)) + (w / n) sum_j relu(cos(p, e_j) - m)``.

    With ``dropout_mask``, the normalised user vector is multiplied by it before the dot products, as SimpleX's
    official code applies ``net_dropout`` to the (cosine-normalised) user vector.

    Args:
        p: ``(B, d)`` user vectors.
        e_pos: ``(B, d)`` positive item rows.
        e_neg: ``(B, n, d)`` negative item rows.
        margin: ``m``.
        negative_weight: ``w``.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` over the batch.
        dropout_mask: ``(B, d)`` inverted-dropout mask (entries ``0`` or ``1 / (1 - rate)``), or ``None``.

    Returns:
        The loss, reduced as asked.
    """
    pos, neg = _cosines(p, e_pos, e_neg, dropout_mask)
    loss = torch.relu(1.0 - pos) + negative_weight * torch.relu(neg - margin).mean(-1)
    return _reduce(loss, reduction, "ccl_loss")


def _cosines(p: Tensor, e_pos: Tensor, e_neg: Tensor, dropout_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(B,)`` cosines with the positives and ``(B, n)`` with the negatives (the user side after dropout)."""
    p_hat = F.normalize(p, dim=-1, eps=_EPS)
    if dropout_mask is not None:
        p_hat = p_hat * dropout_mask
    pos = (p_hat * F.normalize(e_pos, dim=-1, eps=_EPS)).sum(-1)
    neg = torch.bmm(F.normalize(e_neg, dim=-1, eps=_EPS), p_hat.unsqueeze(-1)).squeeze(-1)
    return pos, neg


def _reduce(loss: Tensor, reduction: str, name: str) -> Tensor:
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"{name}: unknown reduction {reduction!r}; use 'mean', 'sum' or 'none'.")


def softmax_cosine_loss(
    p: Tensor,
    e_pos: Tensor,
    e_neg: Tensor,
    temperature: float = 0.07,
    reduction: str = "mean",
    dropout_mask: Tensor | None = None,
) -> Tensor:
    """Softmax cross-entropy of the positive among itself and its negatives, over cosines divided by ``temperature``.

    ``L = -log(exp(c_i / t) / (exp(c_i / t) + sum_j exp(c_j / t)))`` with ``c = cos(p, e)``, which equals
    ``log(1 + sum_j exp((c_j - c_i) / t))``: the loss HEAT's C++ code trains (hipdac-lab/ICS23-HEAT,
    ``cf_cpu/src/modules/models/matrix_factorization.cpp``, ``t = 0.07``) in place of the CCL of its paper. Every
    negative contributes (no margin, no weight); duplicates among the negatives count once each.

    Args:
        p: ``(B, d)`` user vectors.
        e_pos: ``(B, d)`` positive item rows.
        e_neg: ``(B, n, d)`` negative item rows.
        temperature: ``t > 0``. Default 0.07.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` over the batch.
        dropout_mask: ``(B, d)`` inverted-dropout mask on the normalised user vector, see :func:`ccl_loss`.

    Returns:
        The loss, reduced as asked.
    """
    if not temperature > 0:
        raise ValueError(f"softmax_cosine_loss: temperature must be positive, got {temperature}.")
    pos, neg = _cosines(p, e_pos, e_neg, dropout_mask)
    logits = torch.cat([pos.unsqueeze(-1), neg], dim=-1) / temperature
    loss = torch.logsumexp(logits, dim=-1) - logits[:, 0]
    return _reduce(loss, reduction, "softmax_cosine_loss")


class _ClipGradient(torch.autograd.Function):
    """Identity forward; backward clamps every coordinate of the incoming gradient to ``[-bound, bound]``."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, rows: Tensor, bound: float) -> Tensor:
        ctx.bound = bound  # type: ignore[attr-defined]
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        bound = ctx.bound  # type: ignore[attr-defined]
        return grad.clamp(-bound, bound), None


def clip_gradient(rows: Tensor, bound: float) -> Tensor:
    """``rows`` unchanged, but each coordinate of the gradient flowing back through it is clipped to ``[-bound, bound]``.

    Applied to rows gathered per sample (one copy per occurrence), it clips per-sample gradients, which a clip of the
    batch gradient (Lightning's ``gradient_clip_val``) cannot do.
    """
    return _ClipGradient.apply(rows, bound)


def _clipped_user_vectors(
    user_emb: Tensor,
    item_emb: Tensor,
    V: Tensor,
    users: Tensor,
    items: Tensor,
    g: float,
    history: Tensor | None,
    bound: float,
) -> tuple[Tensor, Tensor]:
    """``(p, e_u)`` as :func:`user_vectors` (mean aggregator) computes them, from gathered rows whose per-sample
    gradients are clipped: the user row and each history row of each sample."""
    e_u = clip_gradient(user_emb[users], bound)
    if g >= 1.0:
        return e_u, e_u
    if history is None:
        raise ValueError("simplex_loss: `history` is required when g < 1 (SimpleX aggregates the user's items).")
    hist = history[users]
    mask = (hist >= 0) & (hist != items[:, None])
    rows = clip_gradient(item_emb[hist.clamp_min(0)], bound)  # (B, H, d): one copy per sample and history entry
    local = torch.arange(hist.numel(), device=hist.device).view_as(hist)
    h = aggregate_history(rows.reshape(-1, rows.shape[-1]), local, mask, "mean")
    return g * e_u + (1.0 - g) * (h @ V.t()), e_u


def simplex_loss(
    user_emb: Tensor,
    item_emb: Tensor,
    V: Tensor,
    users: Tensor,
    items: Tensor,
    negatives: Tensor,
    g: float,
    margin: float,
    negative_weight: float,
    history: Tensor | None = None,
    weight_decay: float = 0.0,
    reduction: str = "mean",
    aggregator_weight_decay: float = 0.0,
    aggregator: str = "mean",
    att_w: Tensor | None = None,
    att_b: Tensor | None = None,
    att_q: Tensor | None = None,
    dropout_mask: Tensor | None = None,
    loss: str = "ccl",
    temperature: float = 0.07,
    grad_clip: float | None = None,
    sample_weight: Tensor | None = None,
    history_grad: bool = True,
) -> tuple[Tensor, Tensor]:
    """Batched SimpleX forward: the optimised objective and the per-sample loss.

    The objective adds ``weight_decay / 2`` times the squared norms of the touched user, positive and negative rows
    (once per occurrence), which is what the fused kernel's in-place decay does, and, for ``g < 1``,
    ``aggregator_weight_decay / 2`` times ``|V|^2`` per sample.

    With ``grad_clip``, each sample's gradient with respect to each embedding row it touches (user, positive, each
    negative and, for ``g < 1``, each history row; loss and weight decay together; once per occurrence) is clipped
    per coordinate to ``[-grad_clip, grad_clip]`` before the rows' gradients are summed over the batch (``"mean"``
    divides the sum by ``B``), which is what the fused kernel's per-sample clipped steps do on disjoint rows. This
    per-sample clipping is ours; HEAT's code clips a running buffer per row instead (:class:`RowBufferSGD`, called
    with ``grad_clip=None`` here). ``V`` is not clipped.

    Args:
        user_emb: ``(num_users, d)`` user table.
        item_emb: ``(num_items, d)`` item table.
        V: ``(d, d)`` aggregator matrix.
        users: ``(B,)`` user ids.
        items: ``(B,)`` positive item ids.
        negatives: ``(B, n)`` negative item ids.
        g: gate (``1`` = MF-CCL).
        margin: ``m``.
        negative_weight: ``w``.
        history: padded histories, see :func:`user_vectors`.
        weight_decay: L2 coefficient on touched rows.
        reduction: ``"mean"`` or ``"sum"`` over the batch.
        aggregator_weight_decay: L2 coefficient on ``V`` per sample (ignored for ``g = 1``).
        aggregator: behaviour aggregator, see :func:`aggregate_history`.
        att_w: attention key weights (attention aggregators).
        att_b: attention key bias (attention aggregators).
        att_q: attention query (``"self_attention"``).
        dropout_mask: ``(B, d)`` dropout mask on the normalised user vector, see :func:`ccl_loss`.
        loss: ``"ccl"`` (:func:`ccl_loss`, uses ``margin`` and ``negative_weight``) or ``"softmax"``
            (:func:`softmax_cosine_loss`, uses ``temperature``). Default ``"ccl"``.
        temperature: softmax temperature. Default 0.07.
        grad_clip: per-sample, per-coordinate bound on the embedding rows' gradients, or ``None`` (off). Needs the
            mean aggregator when ``g < 1``. Default ``None``.
        sample_weight: ``(B,)`` weight of each positive: it multiplies that sample's loss (not the weight decay),
            so all the gradients the sample gives, or ``None`` for 1. Default ``None``.
        history_grad: whether the history rows get gradient; ``False`` (HEAT's code) aggregates a detached copy
            of the item table, so only ``V`` and the user row learn from the user vector. Default ``True``.

    Returns:
        ``(objective, per_sample_loss)``; the per-sample loss is weighted.
    """
    if loss not in ("ccl", "softmax"):
        raise ValueError(f"simplex_loss: unknown loss {loss!r}; use 'ccl' or 'softmax'.")
    history_rows = item_emb if history_grad else item_emb.detach()
    if grad_clip is None:
        p = user_vectors(user_emb, history_rows, V, users, g, history, items, aggregator, att_w, att_b, att_q)
        e_u = user_emb[users]
        e_pos = item_emb[items]
        e_neg = item_emb[negatives]
    else:
        if not grad_clip > 0:
            raise ValueError(f"simplex_loss: grad_clip must be positive or None, got {grad_clip}.")
        if g < 1.0 and aggregator != "mean":
            raise ValueError(f"simplex_loss: grad_clip needs the mean aggregator when g < 1, got {aggregator!r}.")
        # the gradient of the mean reaches each per-sample copy divided by B: clip it at grad_clip / B
        bound = grad_clip / len(users) if reduction == "mean" else grad_clip
        p, e_u = _clipped_user_vectors(user_emb, history_rows, V, users, items, g, history, bound)
        e_pos = clip_gradient(item_emb[items], bound)
        e_neg = clip_gradient(item_emb[negatives], bound)
    if loss == "softmax":
        per_sample = softmax_cosine_loss(p, e_pos, e_neg, temperature, reduction="none", dropout_mask=dropout_mask)
    else:
        per_sample = ccl_loss(p, e_pos, e_neg, margin, negative_weight, reduction="none", dropout_mask=dropout_mask)
    if sample_weight is not None:
        per_sample = per_sample * sample_weight.to(per_sample.dtype)
    objective = per_sample
    if weight_decay > 0:
        sq = e_u.pow(2).sum(-1) + e_pos.pow(2).sum(-1) + e_neg.pow(2).sum((-1, -2))
        objective = objective + 0.5 * weight_decay * sq
    if aggregator_weight_decay > 0 and g < 1:
        objective = objective + 0.5 * aggregator_weight_decay * V.pow(2).sum()
    if reduction == "mean":
        return objective.mean(), per_sample
    if reduction == "sum":
        return objective.sum(), per_sample
    raise ValueError(f"simplex_loss: unknown reduction {reduction!r}; use 'mean' or 'sum'.")


def sample_negatives(
    items: Tensor, num_negatives: int, num_items: int, generator: torch.Generator, exclude_positive: bool = True
) -> Tensor:
    """``(B, n)`` negatives drawn uniformly with replacement; with ``exclude_positive``, never the row's positive.

    Drawing from ``num_items - 1`` values and skipping over the positive gives the distribution of redrawing until
    the draw differs from it, in one draw (the fused kernel draws the same way).

    Args:
        items: ``(B,)`` the positives.
        num_negatives: ``n``.
        num_items: catalogue size (at least 2 with ``exclude_positive``).
        generator: the random stream.
        exclude_positive: leave each row's positive out. Default ``True``.
    """
    if not exclude_positive:
        return torch.randint(0, num_items, (len(items), num_negatives), generator=generator)
    if num_items < 2:
        raise ValueError("sample_negatives: leaving the positive out needs at least 2 items.")
    draws = torch.randint(0, num_items - 1, (len(items), num_negatives), generator=generator)
    return draws + (draws >= items[:, None]).long()


class RowBufferSGD(torch.optim.Optimizer):
    """SGD through HEAT's running gradient buffers: for every row a batch touches, ``buf = clip(buf + grad)``, then
    ``row -= lr buf`` (hipdac-lab/ICS23-HEAT, ``optimizers/sgd.cpp`` on the buffers of ``models/
    matrix_factorization.cpp``), applied per batch to the batch gradient (HEAT's rule exactly when a batch is one
    sample). A touched row steps even when its gradient is 0. A group with ``rowwise=False`` gets plain SGD (``V``).

    Args:
        params: parameters or parameter groups.
        buffers: the ``(rows, d)`` buffer of each table, by the table's identity (``id(param)``); kept by the module,
            which clears them each epoch.
        bound: the clipping bound of every buffer coordinate.
        lr: learning rate.
    """

    def __init__(self, params: ParamsT, buffers: dict[int, Tensor], bound: float, lr: float = 0.05) -> None:
        if lr <= 0 or not bound > 0:
            raise ValueError(f"RowBufferSGD: lr and bound must be positive, got lr={lr}, bound={bound}.")
        super().__init__(params, {"lr": lr, "rowwise": True})
        self.buffers, self.bound = buffers, bound
        self.touched: dict[int, Tensor] = {}  # rows of each table the current batch touches (set by the backend)

    def touch(self, param: Tensor, rows: Tensor) -> None:
        """Say which rows of ``param`` the current batch touches (they step even with a zero gradient)."""
        self.touched[id(param)] = rows

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None and id(p) not in self.touched:
                    continue
                grad = torch.zeros_like(p) if p.grad is None else p.grad
                if not group["rowwise"] or id(p) not in self.buffers:
                    p.add_(grad, alpha=-group["lr"])
                    continue
                rows = self.touched.get(id(p))
                if rows is None:
                    rows = grad.abs().sum(1).nonzero().squeeze(1)
                buffer = self.buffers[id(p)]
                buffer[rows] = (buffer[rows] + grad[rows]).clamp_(-self.bound, self.bound)
                p[rows] -= group["lr"] * buffer[rows]
        self.touched = {}
        return loss


@torch.no_grad()
def normalized_scores(user_vecs: Tensor, item_emb_normalized: Tensor) -> Tensor:
    """Cosine scores ``(B, num_items)`` of user vectors against pre-normalised item rows."""
    return F.normalize(user_vecs, dim=-1, eps=_EPS) @ item_emb_normalized.t()


@torch.no_grad()
def project_rows(table: Tensor, norm: float) -> None:
    """Rescale every row of ``table`` to L2 norm ``norm`` in place (all-zero rows stay zero)."""
    table.mul_(norm / table.norm(dim=1, keepdim=True).clamp_min(_EPS))


class RowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad: one accumulator per row of each 2-D parameter (embedding tables).

    For every row whose gradient is not all zero: ``acc[r] += mean(grad[r] ** 2)`` and
    ``row -= lr * grad[r] / (sqrt(acc[r]) + eps)``; untouched rows and their accumulators do not change. This is the
    optimiser the fused kernel runs per sample (its accumulators live in this optimiser's state, ``state[p]["sum"]``,
    so both backends checkpoint the same thing). One accumulator per row keeps rows independent, which is what the
    kernel's lock-free updates need. A group with ``rowwise=False`` gets plain SGD (the shared aggregator ``V``).

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        eps: added to ``sqrt(acc)``.
        initial_accumulator_value: starting value of every accumulator.
    """

    def __init__(
        self, params: ParamsT, lr: float = 0.05, eps: float = 1e-8, initial_accumulator_value: float = 0.0
    ) -> None:
        if lr <= 0 or eps <= 0 or initial_accumulator_value < 0:
            raise ValueError(
                f"RowWiseAdagrad: lr and eps must be positive and initial_accumulator_value >= 0; got lr={lr}, "
                f"eps={eps}, initial_accumulator_value={initial_accumulator_value}."
            )
        super().__init__(
            params, {"lr": lr, "eps": eps, "initial_accumulator_value": initial_accumulator_value, "rowwise": True}
        )

    def row_sums(self, param: Tensor) -> Tensor:
        """The accumulators of ``param``'s rows (created on first use), shape ``(param.shape[0],)``."""
        state = self.state[param]
        if "sum" not in state:
            group = next(g for g in self.param_groups if any(p is param for p in g["params"]))
            state["sum"] = torch.full((param.shape[0],), float(group["initial_accumulator_value"]), dtype=param.dtype)
        return state["sum"]

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if not group["rowwise"] or p.dim() != 2:
                    p.add_(grad, alpha=-group["lr"])
                    continue
                rows = grad.abs().sum(1).nonzero().squeeze(1)
                if rows.numel() == 0:
                    continue
                g_rows = grad[rows]
                acc = self.row_sums(p)
                acc[rows] += g_rows.pow(2).mean(1)
                p[rows] -= group["lr"] * g_rows / (acc[rows].sqrt() + group["eps"]).unsqueeze(1)
        return loss
