"""HEAT's fused CPU kernel for SimpleX / MF-CCL training, written with numba.

Zhang et al., "HEAT: A Highly Efficient and Affordable Training System for Collaborative Filtering Based
Recommendation on CPUs" (ICS 2023, arXiv 2304.07334), on top of Mao et al., "SimpleX" (CIKM 2021). The plain-torch
ground truth computing the same function is :mod:`lightning_sdp.kernels.cf_reference`; tests compare the two.

What one call of :func:`fused_sgd_step` does, for every positive pair ``(u, i)`` of a batch:

1. reads the rows of ``u``, ``i``, the user's history ``H = H_u \\ {i}`` and ``n`` negatives in place (no gathered
   batch tensors), aggregates the history (SimpleX's behaviour aggregator: the mean, or attention weights
   ``softmax_k(c . tanh(W_k e_k + b_k))`` with ``c = e_u`` or a learned ``q``) into ``h`` and builds the user vector
   ``p = g e_u + (1 - g) V h``;
2. optionally drops coordinates of the normalised user vector (SimpleX's ``net_dropout``; the mask is drawn from
   the thread's random state and scaled by ``1 / (1 - rate)``);
3. computes the dot products and self-dots once (forward) and reuses them for the gradients (backward):
   ``dcos(a, b)/da = b / (|a||b|) - cos a / |a|^2``; the loss is SimpleX's cosine contrastive loss (CCL) or the
   softmax cross-entropy over temperature-scaled cosines that HEAT's own code trains (:data:`LOSS_SOFTMAX`);
4. updates the touched rows in place and without locks (Hogwild) across threads, with SGD or row-wise Adagrad
   (one accumulator per row, its squared gradient norm taken from the dot products already computed), optionally
   clipping each coordinate of every row's per-sample gradient to ``[-grad_clip, grad_clip]`` first (HEAT's code);
5. samples its negatives inside the kernel, uniformly over all items or from a per-thread tile of ``tile_size``
   items redrawn every ``tile_refresh`` samples (HEAT's tiled sampler);
6. accumulates the gradients of the shared aggregator parameters (``V``, and ``q`` of self-attention) per thread
   and applies them every ``v_sync`` samples; the attention keys ``tanh(W_k e_k + b_k)`` are computed once per
   call for every item, and what flows back through them (to ``W_k``, ``b_k`` and the history rows) is summed per
   item and applied after the pass, as the batched reference does (``O(|H| d)`` a sample instead of ``O(|H| d^2)``).

The batch is split into ``num_chunks`` contiguous chunks processed in parallel (one per thread); each chunk owns
its random state, its tile and its aggregator-gradient buffers, so the result for a fixed chunk count and a single
thread is deterministic. This module imports numba at import time: import it only when the fused backend is used.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from numba import njit, prange

from lightning_sdp._imports import require

require("numba", feature="the HEAT fused CPU kernel")

_EPS = np.float32(1e-12)
# 64-bit LCG (Knuth's MMIX constants); all arithmetic stays in int64, which wraps in numba.
_LCG_A = 6364136223846793005
_LCG_C = 1442695040888963407

# Behaviour aggregators (the ``aggregator`` argument of :func:`fused_sgd_step`), as in SimpleX's official code.
AGGREGATOR_MEAN = 0
AGGREGATOR_USER_ATTENTION = 1
AGGREGATOR_SELF_ATTENTION = 2
AGGREGATORS = {
    "mean": AGGREGATOR_MEAN,
    "user_attention": AGGREGATOR_USER_ATTENTION,
    "self_attention": AGGREGATOR_SELF_ATTENTION,
}

# Losses (the ``loss`` argument of :func:`fused_sgd_step`). CCL: ``relu(1 - c_i) + (w / n) sum_j relu(c_j - m)``.
# Softmax: ``-log softmax(c / temperature)[positive]`` over the positive and its ``n`` negatives, which is what
# HEAT's C++ code trains (hipdac-lab/ICS23-HEAT, cf_cpu/src/modules/models/matrix_factorization.cpp:
# ``log(1 + sum_j exp((c_j - c_i) / 0.07))``) in place of the CCL its paper describes.
LOSS_CCL = 0
LOSS_SOFTMAX = 1
LOSSES = {"ccl": LOSS_CCL, "softmax": LOSS_SOFTMAX}


@njit(inline="always")
def _lcg(state: int) -> int:
    return state * _LCG_A + _LCG_C


@njit(inline="always")
def _draw(state: int, n: int) -> int:
    """A uniform integer in ``[0, n)`` from the top 31 bits of the LCG state (n < 2**31)."""
    return (((state >> 33) & 0x7FFFFFFF) * n) >> 31


@njit(cache=True)
def draw_dropout_mask(state: int, rate: float, out: np.ndarray) -> int:
    """Fill ``out`` with an inverted-dropout mask drawn from the LCG ``state``; return the advanced state.

    Each entry is ``1 / (1 - rate)`` with probability ``1 - rate`` and ``0`` otherwise (one LCG step per entry), the
    mask the fused kernel draws for every sample when ``dropout > 0``.

    Args:
        state: the LCG state (int64).
        rate: dropout rate in ``[0, 1)``.
        out: ``(d,)`` float32 output.
    """
    threshold = np.int64(rate * 2147483648.0)
    scale = np.float32(1.0 / (1.0 - rate))
    for t in range(out.shape[0]):
        state = _lcg(state)
        out[t] = scale if ((state >> 33) & 0x7FFFFFFF) >= threshold else np.float32(0.0)
    return state


@njit(inline="always")
def _row_lr(acc: np.ndarray, row: int, grad_sq_mean: float, lr: float, eps: float, adaptive: bool) -> float:
    """The step size of one row: ``lr`` (SGD) or row-wise Adagrad's ``lr / (sqrt(acc[row]) + eps)``.

    Row-wise Adagrad keeps one accumulator per row (the running sum of the mean squared gradient of that row), so
    rows stay independent and the lock-free per-sample updates remain valid.
    """
    if adaptive:
        a = acc[row] + max(grad_sq_mean, np.float32(0.0))
        acc[row] = a
        return lr / (np.float32(np.sqrt(a)) + eps)
    return lr


@njit(inline="always")
def _clip(x: float, bound: float) -> float:
    return min(max(x, -bound), bound)


@njit(inline="always")
def _clipped_row_step(
    table: np.ndarray,
    row: int,
    q: np.ndarray,
    a: float,
    bb: float,
    bound: float,
    acc: np.ndarray,
    lr: float,
    eps: float,
    adaptive: bool,
    inv_d: float,
    dp: np.ndarray,
) -> None:
    """Step ``table[row]`` along its clipped per-sample gradient ``clip(a q + bb e)``; add ``a e`` to ``dp``.

    ``e`` is the row before the step (what the user vector's gradient needs). Row-wise Adagrad accumulates the
    clipped gradient, as an optimiser stepping on clipped gradients would.
    """
    gsq = np.float32(0.0)
    if adaptive:
        for t in range(q.shape[0]):
            gt = _clip(a * q[t] + bb * table[row, t], bound)
            gsq += gt * gt
    step = _row_lr(acc, row, gsq * inv_d, lr, eps, adaptive)
    for t in range(q.shape[0]):
        e = table[row, t]
        dp[t] += a * e
        table[row, t] = e - step * _clip(a * q[t] + bb * e, bound)


@njit(inline="always")
def _softmax_coefficients(
    pos_cos: float, neg_dot: np.ndarray, neg_norm: np.ndarray, pn: float, inv_tau: float, neg_coef: np.ndarray
) -> tuple[float, float]:
    """The softmax loss of one sample and its gradients with respect to the cosines.

    Logits ``z = c / temperature`` over the positive and the negatives; the loss is ``logsumexp(z) - z_pos``, so
    ``dL/dc_j = softmax(z)_j / temperature`` (written to ``neg_coef``) and ``dL/dc_pos = (softmax(z)_pos - 1) /
    temperature`` (returned with the loss). Every negative gets a gradient: there is no margin.
    """
    z_pos = pos_cos * inv_tau
    zmax = z_pos
    for j in range(neg_coef.shape[0]):
        z = neg_dot[j] / (pn * neg_norm[j]) * inv_tau
        neg_coef[j] = z
        zmax = max(zmax, z)
    e_pos = np.float32(np.exp(z_pos - zmax))
    total = e_pos
    for j in range(neg_coef.shape[0]):
        e = np.float32(np.exp(neg_coef[j] - zmax))
        neg_coef[j] = e
        total += e
    scale = inv_tau / total
    for j in range(neg_coef.shape[0]):
        neg_coef[j] *= scale
    loss = zmax + np.float32(np.log(total)) - z_pos
    return loss, e_pos * scale - inv_tau


@njit(inline="always")
def _apply_dv(V: np.ndarray, dV: np.ndarray, lr: float, weight_decay: float, samples: int) -> None:
    """Apply a thread's accumulated ``dV`` of ``samples`` samples (and their weight decay) to ``V``; clear ``dV``.

    The decay uses ``V`` as read once per window, like the gradients accumulated in ``dV``.
    """
    keep = np.float32(1.0) - lr * weight_decay * samples
    d = V.shape[0]
    for t in range(d):
        for r in range(d):
            V[t, r] = keep * V[t, r] - lr * dV[t, r]
            dV[t, r] = 0.0


@njit(inline="always")
def _apply_query(att_q: np.ndarray, dq: np.ndarray, lr: float) -> None:
    """Apply a thread's accumulated gradient of the self-attention query ``q`` with SGD; clear it."""
    for t in range(att_q.shape[0]):
        att_q[t] -= lr * dq[t]
        dq[t] = 0.0


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def _fused_sgd_kernel(  # noqa: C901  (a fused numba kernel: one pass per sample, its branches are the point)
    user_emb: np.ndarray,
    item_emb: np.ndarray,
    V: np.ndarray,
    att_keys: np.ndarray,
    att_key_grad: np.ndarray,
    att_q: np.ndarray,
    aggregator: int,
    users: np.ndarray,
    items: np.ndarray,
    hist_indptr: np.ndarray,
    hist_indices: np.ndarray,
    given_negatives: np.ndarray,
    given_masks: np.ndarray,
    num_negatives: int,
    g: float,
    margin: float,
    negative_weight: float,
    dropout: float,
    lr: float,
    v_lr: float,
    weight_decay: float,
    v_weight_decay: float,
    user_acc: np.ndarray,
    item_acc: np.ndarray,
    adagrad_eps: float,
    rng_state: np.ndarray,
    tiles: np.ndarray,
    tile_left: np.ndarray,
    tile_refresh: int,
    v_sync: int,
    num_chunks: int,
    losses: np.ndarray,
    loss_options: tuple[int, float, float] | None,
) -> None:
    """The numba pass behind :func:`fused_sgd_step` (same arguments, except for the attention aggregators).

    ``att_keys`` holds the attention keys ``tanh(W_k e + b_k)`` of every item, computed once per call from the item
    rows at its start; the kernel adds the gradient of each key's pre-activation to that item's row of
    ``att_key_grad`` (Hogwild across threads), and :func:`fused_sgd_step` applies what flows through ``W_k`` after
    the pass. Both are ``(1, 1)`` placeholders for the mean aggregator and MF-CCL. ``loss_options`` is ``None`` for
    CCL without clipping, else ``(loss, temperature, grad_clip)`` (the keyword arguments of :func:`fused_sgd_step`).
    """
    batch = users.shape[0]
    d = user_emb.shape[1]
    n_items = item_emb.shape[0]
    use_given = given_negatives.shape[0] > 0
    n = given_negatives.shape[1] if use_given else num_negatives
    tile_size = tiles.shape[1]
    use_tile = tile_refresh > 0 and tile_size > 0
    use_agg = g < 1.0
    use_att = use_agg and aggregator != AGGREGATOR_MEAN
    user_att = use_att and aggregator == AGGREGATOR_USER_ATTENTION
    given_drop = given_masks.shape[0] > 0
    use_drop = given_drop or dropout > 0.0
    g32 = np.float32(g)
    omg = np.float32(1.0 - g)
    m32 = np.float32(margin)
    wn = np.float32(negative_weight / n)
    lr32 = np.float32(lr)
    vlr32 = np.float32(v_lr)
    wd32 = np.float32(weight_decay)
    vwd32 = np.float32(v_weight_decay)
    adaptive = user_acc.shape[0] > 0
    eps32 = np.float32(adagrad_eps)
    inv_d = np.float32(1.0 / d)
    # ``loss_options`` is None for CCL without clipping: numba then compiles a specialisation in which the flags
    # below are constants and the softmax and clipping code is dead, so that path compiles and runs as before
    use_softmax = False
    clip = False
    inv_tau = np.float32(1.0)
    bound = np.float32(np.inf)
    if loss_options is not None:
        use_softmax = loss_options[0] == LOSS_SOFTMAX
        if use_softmax:
            inv_tau = np.float32(1.0 / loss_options[1])
        clip = loss_options[2] > 0.0
        if clip:
            bound = np.float32(loss_options[2])
    general = use_softmax or clip  # the path that writes each row's gradient out (and clips it)
    zero = np.float32(0.0)
    hmax = 1  # the longest history: scratch rows of the attention aggregators
    if use_att:
        for uu in range(hist_indptr.shape[0] - 1):
            hmax = max(hmax, hist_indptr[uu + 1] - hist_indptr[uu])
    chunk = (batch + num_chunks - 1) // num_chunks
    for c in prange(num_chunks):
        start = c * chunk
        stop = min(batch, start + chunk)
        p = np.empty(d, np.float32)
        h = np.zeros(d, np.float32)
        dp = np.empty(d, np.float32)
        dh = np.empty(d, np.float32)
        neg_ids = np.empty(n, np.int64)
        neg_dot = np.empty(n, np.float32)
        neg_norm = np.empty(n, np.float32)
        neg_coef = np.empty(n if use_softmax else 1, np.float32)  # softmax: dL/dcos of each negative
        gh = np.empty(d if clip and use_agg else 1, np.float32)  # clipping: each history row's clipped gradient
        dV = np.zeros((d, d) if use_agg else (1, 1), np.float32)
        # dropout: q = mask * p is what the items see; p itself sets the norm
        mask = np.ones(d if use_drop else 1, np.float32)
        q = np.empty(d, np.float32) if use_drop else p
        # attention scratch: history ids, weights and their gradients
        hid = np.empty(hmax if use_att else 1, np.int64)
        alpha = np.empty(hmax if use_att else 1, np.float32)
        da = np.empty(hmax if use_att else 1, np.float32)
        de = np.empty(d if use_att else 1, np.float32)
        dcv = np.zeros(d if use_att else 1, np.float32)
        dq = np.zeros(att_q.shape[0] if use_att else 0, np.float32)
        state = rng_state[c]
        left = tile_left[c]
        pending = 0
        for b in range(start, stop):
            u = users[b]
            i = items[b]
            # ---- forward: user vector ------------------------------------------------------------------------
            cnt = 0
            if use_att:
                for k in range(hist_indptr[u], hist_indptr[u + 1]):
                    it = hist_indices[k]
                    if it != i:
                        hid[cnt] = it
                        cnt += 1
                smax = np.float32(-np.inf)
                for k in range(cnt):
                    it = hid[k]
                    s = np.float32(0.0)
                    for t in range(d):
                        s += (user_emb[u, t] if user_att else att_q[t]) * att_keys[it, t]
                    alpha[k] = s
                    smax = max(smax, s)
                total = np.float32(0.0)
                for k in range(cnt):
                    alpha[k] = np.float32(np.exp(alpha[k] - smax))
                    total += alpha[k]
                for t in range(d):
                    h[t] = 0.0
                if cnt > 0:
                    inv = np.float32(1.0) / total
                    for k in range(cnt):
                        alpha[k] *= inv
                        ak = alpha[k]
                        it = hid[k]
                        for t in range(d):
                            h[t] += ak * item_emb[it, t]
                for t in range(d):
                    acc = np.float32(0.0)
                    for r in range(d):
                        acc += V[t, r] * h[r]
                    p[t] = g32 * user_emb[u, t] + omg * acc
            elif use_agg:
                for t in range(d):
                    h[t] = 0.0
                for k in range(hist_indptr[u], hist_indptr[u + 1]):
                    it = hist_indices[k]
                    if it == i:
                        continue
                    for t in range(d):
                        h[t] += item_emb[it, t]
                    cnt += 1
                if cnt > 0:
                    inv = np.float32(1.0 / cnt)
                    for t in range(d):
                        h[t] *= inv
                for t in range(d):
                    acc = np.float32(0.0)
                    for r in range(d):
                        acc += V[t, r] * h[r]
                    p[t] = g32 * user_emb[u, t] + omg * acc
            else:
                for t in range(d):
                    p[t] = user_emb[u, t]
            pp = np.float32(0.0)
            for t in range(d):
                pp += p[t] * p[t]
            pn = max(np.float32(np.sqrt(pp)), _EPS)
            qq = pp
            if use_drop:
                if given_drop:
                    for t in range(d):
                        mask[t] = given_masks[b, t]
                else:
                    state = draw_dropout_mask(state, dropout, mask)
                qq = np.float32(0.0)
                for t in range(d):
                    q[t] = mask[t] * p[t]
                    qq += q[t] * q[t]
            # ---- forward: negatives (dot products and self-dots kept for the backward) -------------------------
            if use_tile and left <= 0:
                for t in range(tile_size):
                    state = _lcg(state)
                    tiles[c, t] = _draw(state, n_items)
                left = tile_refresh
            loss = np.float32(0.0)
            for j in range(n):
                if use_given:
                    neg = given_negatives[b, j]
                elif use_tile:
                    state = _lcg(state)
                    neg = tiles[c, _draw(state, tile_size)]
                else:
                    state = _lcg(state)
                    neg = _draw(state, n_items)
                neg_ids[j] = neg
                x = np.float32(0.0)
                ss = np.float32(0.0)
                for t in range(d):
                    e = item_emb[neg, t]
                    x += q[t] * e
                    ss += e * e
                neg_dot[j] = x
                neg_norm[j] = max(np.float32(np.sqrt(ss)), _EPS)
            left -= 1
            # ---- positive: forward, its share of dp, in-place update ------------------------------------------
            for t in range(d):
                dp[t] = 0.0
            self_coef = np.float32(0.0)  # dp = mask * sum_j G_j e_j / (|p||e_j|) - (sum_j G_j c_j / |p|^2) p
            x = np.float32(0.0)
            ss = np.float32(0.0)
            for t in range(d):
                e = item_emb[i, t]
                x += q[t] * e
                ss += e * e
            en = max(np.float32(np.sqrt(ss)), _EPS)
            cos = x / (pn * en)
            if general:
                # softmax loss or clipping: each row's gradient a q + bb e is written out coordinate by coordinate
                # (the CCL path below folds it into one scale and one axpy, and stays as it was)
                G = np.float32(-1.0)  # dL/dcos of the positive (CCL: -1 while active)
                if use_softmax:
                    loss, G = _softmax_coefficients(cos, neg_dot, neg_norm, pn, inv_tau, neg_coef)
                a, bb = zero, wd32  # an inactive row's gradient is its decay alone (a = 0 leaves dp alone)
                if use_softmax or cos < 1.0:
                    if not use_softmax:
                        loss += np.float32(1.0) - cos
                    self_coef += G * cos / (pn * pn)
                    a = G / (pn * en)
                    bb = wd32 - G * cos / (en * en)
                if a != zero or wd32 > 0.0:
                    _clipped_row_step(item_emb, i, q, a, bb, bound, item_acc, lr32, eps32, adaptive, inv_d, dp)
                for j in range(n):
                    neg = neg_ids[j]
                    en = neg_norm[j]
                    cos = neg_dot[j] / (pn * en)
                    a, bb = zero, wd32
                    if use_softmax or cos > m32:
                        Gj = neg_coef[j] if use_softmax else wn  # dL/dcos of this negative
                        if not use_softmax:
                            loss += wn * (cos - m32)
                        self_coef += Gj * cos / (pn * pn)
                        a = Gj / (pn * en)
                        bb = wd32 - Gj * cos / (en * en)
                    if a != zero or wd32 > 0.0:
                        _clipped_row_step(item_emb, neg, q, a, bb, bound, item_acc, lr32, eps32, adaptive, inv_d, dp)
            elif cos < 1.0:
                loss += np.float32(1.0) - cos
                G = np.float32(-1.0)
                self_coef += G * cos / (pn * pn)
                a = G / (pn * en)
                bb = wd32 - G * cos / (en * en)  # the row's gradient is a q + bb e
                lr_i = _row_lr(item_acc, i, (a * a * qq + 2 * a * bb * x + bb * bb * ss) * inv_d, lr32, eps32, adaptive)
                keep = np.float32(1.0) - lr_i * bb
                step = lr_i * a
                for t in range(d):
                    e = item_emb[i, t]
                    dp[t] += a * e
                    item_emb[i, t] = keep * e - step * q[t]
            elif wd32 > 0.0:
                keep = np.float32(1.0) - _row_lr(item_acc, i, wd32 * wd32 * ss * inv_d, lr32, eps32, adaptive) * wd32
                for t in range(d):
                    item_emb[i, t] *= keep
            # ---- negatives (CCL without clipping): their share of dp and in-place updates ---------------------
            for j in range(0 if general else n):
                neg = neg_ids[j]
                en = neg_norm[j]
                cos = neg_dot[j] / (pn * en)
                if cos > m32:
                    loss += wn * (cos - m32)
                    self_coef += wn * cos / (pn * pn)
                    a = wn / (pn * en)
                    bb = wd32 - wn * cos / (en * en)
                    gsq = (a * a * qq + 2 * a * bb * neg_dot[j] + bb * bb * en * en) * inv_d
                    lr_j = _row_lr(item_acc, neg, gsq, lr32, eps32, adaptive)
                    keep = np.float32(1.0) - lr_j * bb
                    step = lr_j * a
                    for t in range(d):
                        e = item_emb[neg, t]
                        dp[t] += a * e
                        item_emb[neg, t] = keep * e - step * q[t]
                elif wd32 > 0.0:
                    gsq = wd32 * wd32 * neg_norm[j] * neg_norm[j] * inv_d
                    keep = np.float32(1.0) - _row_lr(item_acc, neg, gsq, lr32, eps32, adaptive) * wd32
                    for t in range(d):
                        item_emb[neg, t] *= keep
            losses[b] = loss
            if use_drop:
                for t in range(d):
                    dp[t] *= mask[t]
            for t in range(d):
                dp[t] -= self_coef * p[t]
            # ---- backward through the aggregator and the user row ---------------------------------------------
            if use_agg:
                for r in range(d):
                    dh[r] = 0.0
                for t in range(d):
                    gt = omg * dp[t]
                    for r in range(d):
                        dh[r] += V[t, r] * gt
                        dV[t, r] += gt * h[r]
                if use_att:
                    # h = sum_k a_k e_k, a = softmax(s), s_k = c . tanh(W e_k + b): through the weights and keys
                    sbar = np.float32(0.0)
                    for k in range(cnt):
                        it = hid[k]
                        x = np.float32(0.0)
                        for t in range(d):
                            x += dh[t] * item_emb[it, t]
                        da[k] = x
                        sbar += alpha[k] * x
                    for k in range(cnt):
                        it = hid[k]
                        ds = alpha[k] * (da[k] - sbar)
                        for t in range(d):
                            zt = att_keys[it, t]
                            cv = user_emb[u, t] if user_att else att_q[t]
                            # the key's pre-activation gradient; its W_k, b_k and e_k parts are applied after the
                            # pass, which keeps the per-sample cost O(|H| d) instead of O(|H| d^2)
                            att_key_grad[it, t] += ds * cv * (np.float32(1.0) - zt * zt)
                            dcv[t] += ds * zt
                            de[t] = alpha[k] * dh[t]
                        hsq = np.float32(0.0)
                        if adaptive:
                            for t in range(d):
                                hsq += de[t] * de[t]
                            hsq *= inv_d
                        step = _row_lr(item_acc, it, hsq, lr32, eps32, adaptive)
                        for t in range(d):
                            item_emb[it, t] -= step * de[t]
                    if not user_att:
                        for t in range(d):
                            dq[t] += dcv[t]
                            dcv[t] = 0.0
                elif cnt > 0 and clip:
                    inv_cnt = np.float32(1.0 / cnt)  # each history row's gradient is dh / cnt, the same for all
                    hsq = np.float32(0.0)
                    for t in range(d):
                        gh[t] = _clip(dh[t] * inv_cnt, bound)
                        hsq += gh[t] * gh[t]
                    hsq *= inv_d
                    for k in range(hist_indptr[u], hist_indptr[u + 1]):
                        it = hist_indices[k]
                        if it == i:
                            continue
                        step = _row_lr(item_acc, it, hsq, lr32, eps32, adaptive)
                        for t in range(d):
                            item_emb[it, t] -= step * gh[t]
                elif cnt > 0:
                    inv_cnt = np.float32(1.0 / cnt)  # each history row's gradient is dh / cnt
                    hsq = np.float32(0.0)
                    if adaptive:
                        for t in range(d):
                            hsq += dh[t] * dh[t]
                        hsq *= inv_cnt * inv_cnt * inv_d
                    for k in range(hist_indptr[u], hist_indptr[u + 1]):
                        it = hist_indices[k]
                        if it == i:
                            continue
                        step = _row_lr(item_acc, it, hsq, lr32, eps32, adaptive) * inv_cnt
                        for t in range(d):
                            item_emb[it, t] -= step * dh[t]
                pending += 1
                if pending >= v_sync:
                    _apply_dv(V, dV, vlr32, vwd32, pending)
                    if use_att:
                        _apply_query(att_q, dq, vlr32)
                    pending = 0
            if user_att:  # the user row is also the attention query: its gradient adds dc
                usq = np.float32(0.0)
                if adaptive:
                    for t in range(d):
                        gu = g32 * dp[t] + dcv[t] + wd32 * user_emb[u, t]
                        usq += gu * gu
                lr_u = _row_lr(user_acc, u, usq * inv_d, lr32, eps32, adaptive)
                keep = np.float32(1.0) - lr_u * wd32
                for t in range(d):
                    user_emb[u, t] = keep * user_emb[u, t] - lr_u * (g32 * dp[t] + dcv[t])
                    dcv[t] = 0.0
                continue
            usq = np.float32(0.0)
            if clip:
                if adaptive:
                    for t in range(d):
                        gu = _clip(g32 * dp[t] + wd32 * user_emb[u, t], bound)
                        usq += gu * gu
                lr_u = _row_lr(user_acc, u, usq * inv_d, lr32, eps32, adaptive)
                for t in range(d):
                    user_emb[u, t] -= lr_u * _clip(g32 * dp[t] + wd32 * user_emb[u, t], bound)
                continue
            if adaptive:
                for t in range(d):
                    gu = g32 * dp[t] + wd32 * user_emb[u, t]
                    usq += gu * gu
            lr_u = _row_lr(user_acc, u, usq * inv_d, lr32, eps32, adaptive)
            keep = np.float32(1.0) - lr_u * wd32
            gstep = lr_u * g32
            for t in range(d):
                user_emb[u, t] = keep * user_emb[u, t] - gstep * dp[t]
        if use_agg and pending > 0:
            _apply_dv(V, dV, vlr32, vwd32, pending)
            if use_att:
                _apply_query(att_q, dq, vlr32)
        rng_state[c] = state
        tile_left[c] = left


# The arguments of fused_sgd_step after ``att_b``, in order: passed to the numba pass unchanged.
_PASS_THROUGH = (
    "att_q", "aggregator", "users", "items", "hist_indptr", "hist_indices", "given_negatives", "given_masks",
    "num_negatives", "g", "margin", "negative_weight", "dropout", "lr", "v_lr", "weight_decay", "v_weight_decay",
    "user_acc", "item_acc", "adagrad_eps", "rng_state", "tiles", "tile_left", "tile_refresh", "v_sync", "num_chunks",
    "losses",
)  # fmt: skip


def fused_sgd_step(
    user_emb: np.ndarray,
    item_emb: np.ndarray,
    V: np.ndarray,
    att_w: np.ndarray,
    att_b: np.ndarray,
    *rest: Any,
    loss: int = LOSS_CCL,
    temperature: float = 0.07,
    grad_clip: float = 0.0,
) -> None:
    """One fused SGD pass over a batch of positives, updating the tables and aggregator parameters in place.

    Args (positional, in this order, up to ``losses``; then keyword-only):
        user_emb: ``(num_users, d)`` float32, C-contiguous.
        item_emb: ``(num_items, d)`` float32, C-contiguous.
        V: ``(d, d)`` float32 aggregator matrix (``p = g e_u + (1 - g) V h``); unused when ``g >= 1``.
        att_w: ``(d, d)`` float32 attention key weights ``W_k`` (attention aggregators; else any ``(1, 1)``).
        att_b: ``(d,)`` float32 attention key bias ``b_k`` (attention aggregators; else any ``(1,)``).
        att_q: ``(d,)`` float32 attention query ``q`` (self-attention; else any ``(0,)``).
        aggregator: :data:`AGGREGATOR_MEAN`, :data:`AGGREGATOR_USER_ATTENTION` or :data:`AGGREGATOR_SELF_ATTENTION`.
        users: ``(B,)`` int64 user of each positive.
        items: ``(B,)`` int64 item of each positive.
        hist_indptr: ``(num_users + 1,)`` int64 CSR offsets of the (capped) histories.
        hist_indices: int64 CSR items of the histories.
        given_negatives: ``(B, n)`` int64 negatives to use, or a ``(0, 0)`` array to sample inside the kernel.
        given_masks: ``(B, d)`` float32 dropout masks to use (already scaled), or a ``(0, 0)`` array to draw them
            inside the kernel when ``dropout > 0``.
        num_negatives: ``n`` when sampling inside the kernel.
        g: gate; ``1`` is MF-CCL.
        margin: negative margin ``m``.
        negative_weight: ``w``; each active negative contributes ``w / n``.
        dropout: dropout rate on the normalised user vector (training), in ``[0, 1)``.
        lr: SGD learning rate (per sample) of the embedding rows.
        v_lr: SGD learning rate of the aggregator parameters (their accumulated per-sample gradients).
        weight_decay: L2 coefficient on the touched user, positive and negative rows.
        v_weight_decay: L2 coefficient on ``V`` per sample (applied with the accumulated ``dV``); keeps ``V`` from
            growing in directions the current histories no longer span.
        user_acc: ``(num_users,)`` float32 row-wise Adagrad accumulators of the user rows, or a ``(0,)`` array for
            plain SGD (``item_acc`` must then be empty too).
        item_acc: ``(num_items,)`` float32 row-wise Adagrad accumulators of the item rows, or ``(0,)``.
        adagrad_eps: Adagrad's ``eps`` added to ``sqrt(acc)``.
        rng_state: ``(>= num_chunks,)`` int64 per-chunk random state, advanced in place.
        tiles: ``(>= num_chunks, tile_size)`` int64 per-chunk negative tiles, redrawn in place.
        tile_left: ``(>= num_chunks,)`` int64 samples left before each tile is redrawn.
        tile_refresh: redraw a tile every this many samples; ``0`` selects uniform sampling over all items.
        v_sync: apply each chunk's accumulated gradients of ``V`` and ``q`` every this many samples (``W_k`` and
            ``b_k`` move once, after the pass).
        num_chunks: number of chunks processed in parallel.
        losses: ``(B,)`` float32 output, the loss of each positive.
        loss: :data:`LOSS_CCL` (``margin`` and ``negative_weight`` apply) or :data:`LOSS_SOFTMAX` (cross-entropy of the
            positive among itself and its negatives over ``cos / temperature``; ``margin`` and ``negative_weight``
            are unused). Keyword-only, default CCL.
        temperature: the softmax temperature (``> 0``); unused by CCL. Default 0.07 (HEAT's code).
        grad_clip: clip each coordinate of every embedding row's per-sample gradient (loss and weight decay) to
            ``[-grad_clip, grad_clip]`` before its update, as HEAT's SGD does (hipdac-lab/ICS23-HEAT,
            ``cf_cpu/src/modules/optimizers/sgd.cpp``: ``clip_grad`` on each coordinate, then ``emb -= lr * grad``);
            ``0`` turns clipping off. HEAT clips a per-row gradient buffer that it clears only at the end of an
            epoch, so earlier samples' (clipped) gradients ride along; here each sample's own gradient is clipped.
            The aggregator parameters are not clipped. Needs the mean aggregator when ``g < 1``. Default 0.
    """
    if len(rest) != len(_PASS_THROUGH):
        raise TypeError(f"fused_sgd_step takes {5 + len(_PASS_THROUGH)} arguments, got {5 + len(rest)}")
    arg = dict(zip(_PASS_THROUGH, rest, strict=True))
    aggregator, g, lr, v_lr = arg["aggregator"], arg["g"], arg["lr"], arg["v_lr"]
    user_acc, item_acc, adagrad_eps = arg["user_acc"], arg["item_acc"], arg["adagrad_eps"]
    if loss not in (LOSS_CCL, LOSS_SOFTMAX) or (loss == LOSS_SOFTMAX and not temperature > 0):
        raise ValueError(
            f"fused_sgd_step: loss must be LOSS_CCL or LOSS_SOFTMAX with temperature > 0, got {loss}, {temperature}."
        )
    if grad_clip > 0 and g < 1.0 and aggregator != AGGREGATOR_MEAN:
        # the attention keys' gradient reaches the item rows after the pass, summed over the batch: not per sample
        raise ValueError("fused_sgd_step: grad_clip needs the mean aggregator when g < 1.")
    # None selects the kernel's plain-CCL specialisation (see _fused_sgd_kernel)
    options = None if loss == LOSS_CCL and not grad_clip > 0 else (int(loss), float(temperature), float(grad_clip))
    tail = (*rest, options)
    if g >= 1.0 or aggregator == AGGREGATOR_MEAN:
        placeholder = np.zeros((1, 1), np.float32)
        _fused_sgd_kernel(user_emb, item_emb, V, placeholder, placeholder, *tail)
        return
    # The attention keys depend on the item rows and W_k only, not on the user: computed once per batch (as the
    # batched reference does) they cost O(num_items d^2) a batch instead of O(|H| d^2) a sample.
    rows_before = torch.from_numpy(item_emb.copy())
    w, b = torch.from_numpy(att_w), torch.from_numpy(att_b)
    keys = torch.tanh(torch.addmm(b, rows_before, w.T)).numpy()
    key_grad = np.zeros_like(item_emb)
    _fused_sgd_kernel(user_emb, item_emb, V, keys, key_grad, *tail)
    touched = np.flatnonzero(np.any(key_grad != 0, axis=1))
    grad = torch.from_numpy(key_grad[touched])
    step = (grad @ w).numpy()
    if user_acc.shape[0] > 0:  # row-wise Adagrad: the key path steps with the row's rate, as already accumulated
        step *= (np.float32(lr) / (np.sqrt(item_acc[touched]) + np.float32(adagrad_eps)))[:, None]
    else:
        step *= np.float32(lr)
    item_emb[touched] -= step
    att_w -= np.float32(v_lr) * (grad.T @ rows_before[touched]).numpy()
    att_b -= np.float32(v_lr) * grad.sum(dim=0).numpy()


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def project_rows(table: np.ndarray, norm: float) -> None:
    """Rescale every row of ``table`` to L2 norm ``norm`` in place; all-zero rows stay zero.

    One pass per row while it is in cache, rows split across threads: the fused backend's form of
    :func:`lightning_sdp.kernels.cf_reference.project_rows` (torch reads the table twice and allocates the norms).
    """
    n, d = table.shape
    target = np.float32(norm)
    for r in prange(n):
        ss = np.float32(0.0)
        for t in range(d):
            ss += table[r, t] * table[r, t]
        scale = target / max(np.float32(np.sqrt(ss)), _EPS)
        for t in range(d):
            table[r, t] *= scale
