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
   clipping each coordinate of every row's gradient to ``[-grad_clip, grad_clip]`` first: the sample's own gradient
   (ours), or a running gradient buffer per row that the sample's gradient is added to (HEAT's code,
   :data:`CLIP_ROW_BUFFER`); a per-interaction weight scales the sample's loss and so all its gradients;
5. samples its negatives inside the kernel, uniformly over all items or from a per-thread tile of ``tile_size``
   items redrawn every ``tile_refresh`` samples (HEAT's tiled sampler), never the positive unless asked
   (``exclude_positive``);
6. accumulates the gradients of the shared aggregator parameters (``V``, and ``q`` of self-attention) per thread
   and applies them every ``v_sync`` samples; the attention keys ``tanh(W_k e_k + b_k)`` are computed once per
   call for every item, and what flows back through them (to ``W_k``, ``b_k`` and the history rows) is summed per
   item and applied after the pass, as the batched reference does (``O(|H| d)`` a sample instead of ``O(|H| d^2)``).

The batch is split into ``num_chunks`` contiguous chunks processed in parallel (one per thread); each chunk owns
its random state, its tile and its aggregator-gradient buffers, so the result for a fixed chunk count and a single
thread is deterministic. Before any update a sample checks that what it read is finite; the first sample that read
a NaN or infinite value stops every thread and is reported (:class:`StepFailure`), so a bad row never spreads
through the tables. This module imports numba at import time: import it only when the fused backend is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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

# How ``grad_clip`` clips (the ``clip_mode`` of :class:`StepSettings`). Per sample (ours): each coordinate of the
# gradient a sample gives a row is clipped, then applied. Row buffer (HEAT's code, hipdac-lab/ICS23-HEAT
# ``cf_cpu/src/modules/optimizers/sgd.cpp`` and ``models/matrix_factorization.cpp``): every row keeps a gradient
# buffer; a sample adds its gradient to the buffer of each row it touches, the buffer is clipped in place, and the row
# steps by ``lr`` times the whole buffer, which is cleared once per epoch (``engine.cpp``), so earlier samples'
# gradients keep moving a row until the epoch ends.
CLIP_PER_SAMPLE = 0
CLIP_ROW_BUFFER = 1
CLIP_MODES = {"sample": CLIP_PER_SAMPLE, "row_buffer": CLIP_ROW_BUFFER}

# What a failure record (:class:`StepFailure`) says read a non-finite value: the user vector (the user row, a history
# row or the aggregator), the positive's row, or a negative's row.
FAILED_USER_VECTOR = 0
FAILED_POSITIVE = 1
FAILED_NEGATIVE = 2

# numba's fastmath without "nnan" and "ninf" (with them LLVM assumes no NaN or infinity exists and drops the
# finiteness checks) and without "nsz" (with "reassoc" it dropped them too, in numba 0.68's prange bodies; the kernel
# tests catch it); "reassoc" is what lets it vectorise the dot products
_FASTMATH = {"arcp", "contract", "afn", "reassoc"}


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
    buffer: np.ndarray,
    lr: float,
    eps: float,
    adaptive: bool,
    inv_d: float,
    dp: np.ndarray,
) -> None:
    """Step ``table[row]`` along its clipped gradient ``g = a q + bb e``; add ``a e`` to ``dp``.

    ``e`` is the row before the step (what the user vector's gradient needs). With an empty ``buffer`` the step is
    ``clip(g)`` (per sample; row-wise Adagrad accumulates the clipped gradient, as an optimiser stepping on clipped
    gradients would); with a ``buffer`` of the table's shape it is HEAT's: ``buf = clip(buf + g)``, step ``lr buf``.
    """
    if buffer.shape[0] > 0:
        for t in range(q.shape[0]):
            e = table[row, t]
            dp[t] += a * e
            total = _clip(buffer[row, t] + a * q[t] + bb * e, bound)
            buffer[row, t] = total
            table[row, t] = e - lr * total
        return
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
def _buffered_step(table: np.ndarray, buffer: np.ndarray, row: int, grad: np.ndarray, bound: float, lr: float) -> None:
    """HEAT's row step: ``buf = clip(buf + grad)``, then ``row -= lr buf``."""
    for t in range(grad.shape[0]):
        total = _clip(buffer[row, t] + grad[t], bound)
        buffer[row, t] = total
        table[row, t] -= lr * total


@njit(inline="always")
def _draw_negative(state: int, n_items: int, positive: int, exclude: bool) -> tuple[int, int]:
    """One uniform negative and the advanced LCG state; with ``exclude``, uniform over the items but ``positive``.

    Drawing from ``n_items - 1`` values and skipping over the positive gives the distribution of redrawing until
    the draw differs from the positive, in one draw.
    """
    state = _lcg(state)
    if not exclude:
        return state, _draw(state, n_items)
    neg = _draw(state, n_items - 1)
    return state, neg + 1 if neg >= positive else neg


@njit(cache=True)
def draw_negatives(state: int, n_items: int, positives: np.ndarray, exclude: bool, out: np.ndarray) -> int:
    """Fill ``out[b]`` with ``out.shape[1]`` uniform negatives of ``positives[b]`` as the kernel draws them.

    The kernel's own draw (:func:`_draw_negative`, uniform sampler) exposed for tests: with ``exclude`` no negative
    equals its positive. Returns the advanced state.
    """
    for b in range(out.shape[0]):
        for j in range(out.shape[1]):
            state, out[b, j] = _draw_negative(state, n_items, positives[b], exclude)
    return state


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


@njit(cache=True)
def _longest_history(hist_indptr: np.ndarray, attention: bool) -> int:
    """The longest history (rows of the attention aggregators' scratch); 1 without attention."""
    longest = 1
    if attention:
        for u in range(hist_indptr.shape[0] - 1):
            longest = max(longest, hist_indptr[u + 1] - hist_indptr[u])
    return longest


@njit(nogil=True, fastmath=_FASTMATH)
def _fused_chunk(  # noqa: C901  (the per-sample pass of the fused kernel: its branches are the point)
    c: int,
    chunk: int,
    hmax: int,
    user_emb: np.ndarray,
    item_emb: np.ndarray,
    V: np.ndarray,
    att_keys: np.ndarray,
    att_key_grad: np.ndarray,
    att_q: np.ndarray,
    users: np.ndarray,
    items: np.ndarray,
    weights: np.ndarray,
    given_negatives: np.ndarray,
    given_masks: np.ndarray,
    hist_indptr: np.ndarray,
    hist_indices: np.ndarray,
    user_acc: np.ndarray,
    item_acc: np.ndarray,
    rng_state: np.ndarray,
    tiles: np.ndarray,
    tile_left: np.ndarray,
    losses: np.ndarray,
    failure: np.ndarray,
    aggregator: int,
    num_negatives: int,
    g: float,
    margin: float,
    negative_weight: float,
    dropout: float,
    lr: float,
    v_lr: float,
    weight_decay: float,
    v_weight_decay: float,
    adagrad_eps: float,
    tile_refresh: int,
    v_sync: int,
    num_chunks: int,
    exclude_positive: bool,
    history_grad: bool,
    loss_options: tuple[int, float, float, np.ndarray, np.ndarray] | None,
) -> None:
    """Chunk ``c`` (``chunk`` samples) of :func:`_fused_sgd_kernel`'s batch, with ``hmax`` attention scratch rows."""
    start = c * chunk
    stop = min(users.shape[0], start + chunk)
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
    weighted = weights.shape[0] > 0
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
    one = np.float32(1.0)
    # ``loss_options`` is None for CCL without clipping: numba then compiles a specialisation in which the flags
    # below are constants and the softmax and clipping code is dead
    use_softmax = False
    clip = False
    inv_tau = np.float32(1.0)
    bound = np.float32(np.inf)
    user_buf = np.zeros((0, 0), np.float32)
    item_buf = np.zeros((0, 0), np.float32)
    if loss_options is not None:
        use_softmax = loss_options[0] == LOSS_SOFTMAX
        if use_softmax:
            inv_tau = np.float32(1.0 / loss_options[1])
        clip = loss_options[2] > 0.0
        if clip:
            bound = np.float32(loss_options[2])
        user_buf = loss_options[3]
        item_buf = loss_options[4]
    buffered = user_buf.shape[0] > 0  # HEAT's row buffers: every touched row steps, even with a zero gradient
    general = use_softmax or clip  # the path that writes each row's gradient out (and clips it)
    zero = np.float32(0.0)
    halt = failure[num_chunks]
    p = np.empty(d, np.float32)
    h = np.zeros(d, np.float32)
    dp = np.empty(d, np.float32)
    dh = np.empty(d, np.float32)
    neg_ids = np.empty(n, np.int64)
    neg_dot = np.empty(n, np.float32)
    neg_norm = np.empty(n, np.float32)
    neg_coef = np.empty(n if use_softmax else 1, np.float32)  # softmax: dL/dcos of each negative
    gh = np.empty(d if clip and use_agg else 1, np.float32)  # clipping: each history row's gradient
    gu = np.empty(d if buffered else 1, np.float32)  # row buffers: the user row's gradient
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
        if halt[0] != 0:  # another chunk read a non-finite value: stop before spreading it
            break
        u = users[b]
        i = items[b]
        wgt = weights[b] if weighted else one
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
        if not np.isfinite(pp):
            failure[c, 0], failure[c, 1], failure[c, 2] = b, FAILED_USER_VECTOR, u
            halt[0] = 1
            break
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
        bad_negative = -1
        for j in range(n):
            if use_given:
                neg = given_negatives[b, j]
            elif use_tile:
                state = _lcg(state)
                neg = tiles[c, _draw(state, tile_size)]
                if exclude_positive and neg == i:  # the tile may hold nothing else: draw among all others
                    state, neg = _draw_negative(state, n_items, i, True)
            else:
                state, neg = _draw_negative(state, n_items, i, exclude_positive)
            neg_ids[j] = neg
            x = np.float32(0.0)
            ss = np.float32(0.0)
            for t in range(d):
                e = item_emb[neg, t]
                x += q[t] * e
                ss += e * e
            neg_dot[j] = x
            neg_norm[j] = max(np.float32(np.sqrt(ss)), _EPS)
            if bad_negative < 0 and not np.isfinite(x + ss):
                bad_negative = neg
        left -= 1
        # ---- positive: forward, its share of dp, in-place update ------------------------------------------
        x = np.float32(0.0)
        ss = np.float32(0.0)
        for t in range(d):
            e = item_emb[i, t]
            x += q[t] * e
            ss += e * e
        if not np.isfinite(x + ss):
            failure[c, 0], failure[c, 1], failure[c, 2] = b, FAILED_POSITIVE, i
            halt[0] = 1
            break
        if bad_negative >= 0:
            failure[c, 0], failure[c, 1], failure[c, 2] = b, FAILED_NEGATIVE, bad_negative
            halt[0] = 1
            break
        for t in range(d):
            dp[t] = 0.0
        self_coef = np.float32(0.0)  # dp = mask * sum_j G_j e_j / (|p||e_j|) - (sum_j G_j c_j / |p|^2) p
        en = max(np.float32(np.sqrt(ss)), _EPS)
        cos = x / (pn * en)
        loss = np.float32(0.0)
        if general:
            # softmax loss or clipping: each row's gradient a q + bb e is written out coordinate by coordinate
            # (the CCL path below folds it into one scale and one axpy)
            G = -wgt  # dL/dcos of the positive (CCL: -1 while active), times the sample's weight
            if use_softmax:
                loss, G = _softmax_coefficients(cos, neg_dot, neg_norm, pn, inv_tau, neg_coef)
                loss *= wgt
                G *= wgt
            a, bb = zero, wd32  # an inactive row's gradient is its decay alone (a = 0 leaves dp alone)
            if use_softmax or cos < 1.0:
                if not use_softmax:
                    loss += wgt * (np.float32(1.0) - cos)
                self_coef += G * cos / (pn * pn)
                a = G / (pn * en)
                bb = wd32 - G * cos / (en * en)
            if a != zero or wd32 > 0.0 or buffered:
                _clipped_row_step(item_emb, i, q, a, bb, bound, item_acc, item_buf, lr32, eps32, adaptive, inv_d, dp)
            for j in range(n):
                neg = neg_ids[j]
                en = neg_norm[j]
                cos = neg_dot[j] / (pn * en)
                a, bb = zero, wd32
                if use_softmax or cos > m32:
                    Gj = neg_coef[j] * wgt if use_softmax else wn * wgt  # dL/dcos of this negative
                    if not use_softmax:
                        loss += wn * wgt * (cos - m32)
                    self_coef += Gj * cos / (pn * pn)
                    a = Gj / (pn * en)
                    bb = wd32 - Gj * cos / (en * en)
                if a != zero or wd32 > 0.0 or buffered:
                    _clipped_row_step(
                        item_emb, neg, q, a, bb, bound, item_acc, item_buf, lr32, eps32, adaptive, inv_d, dp
                    )
        elif cos < 1.0:
            loss += wgt * (np.float32(1.0) - cos)
            G = -wgt
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
        wnb = wn * wgt
        for j in range(0 if general else n):
            neg = neg_ids[j]
            en = neg_norm[j]
            cos = neg_dot[j] / (pn * en)
            if cos > m32:
                loss += wnb * (cos - m32)
                self_coef += wnb * cos / (pn * pn)
                a = wnb / (pn * en)
                bb = wd32 - wnb * cos / (en * en)
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
            if history_grad:
                for r in range(d):
                    dh[r] = 0.0
                for t in range(d):
                    gt = omg * dp[t]
                    for r in range(d):
                        dh[r] += V[t, r] * gt
                        dV[t, r] += gt * h[r]
            else:  # HEAT's code: the history rows only feed the aggregator, so dh is never needed
                for t in range(d):
                    gt = omg * dp[t]
                    for r in range(d):
                        dV[t, r] += gt * h[r]
            if not history_grad:
                pass
            elif use_att:
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
            elif cnt > 0 and buffered:
                inv_cnt = np.float32(1.0 / cnt)  # each history row's gradient is dh / cnt, the same for all
                for t in range(d):
                    gh[t] = dh[t] * inv_cnt
                for k in range(hist_indptr[u], hist_indptr[u + 1]):
                    it = hist_indices[k]
                    if it != i:
                        _buffered_step(item_emb, item_buf, it, gh, bound, lr32)
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
                    gu_t = g32 * dp[t] + dcv[t] + wd32 * user_emb[u, t]
                    usq += gu_t * gu_t
            lr_u = _row_lr(user_acc, u, usq * inv_d, lr32, eps32, adaptive)
            keep = np.float32(1.0) - lr_u * wd32
            for t in range(d):
                user_emb[u, t] = keep * user_emb[u, t] - lr_u * (g32 * dp[t] + dcv[t])
                dcv[t] = 0.0
            continue
        if buffered:
            for t in range(d):
                gu[t] = g32 * dp[t] + wd32 * user_emb[u, t]
            _buffered_step(user_emb, user_buf, u, gu, bound, lr32)
            continue
        usq = np.float32(0.0)
        if clip:
            if adaptive:
                for t in range(d):
                    gu_t = _clip(g32 * dp[t] + wd32 * user_emb[u, t], bound)
                    usq += gu_t * gu_t
            lr_u = _row_lr(user_acc, u, usq * inv_d, lr32, eps32, adaptive)
            for t in range(d):
                user_emb[u, t] -= lr_u * _clip(g32 * dp[t] + wd32 * user_emb[u, t], bound)
            continue
        if adaptive:
            for t in range(d):
                gu_t = g32 * dp[t] + wd32 * user_emb[u, t]
                usq += gu_t * gu_t
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


@njit(parallel=True, nogil=True, fastmath=_FASTMATH, cache=True)
def _fused_sgd_kernel(
    user_emb: np.ndarray,
    item_emb: np.ndarray,
    V: np.ndarray,
    att_keys: np.ndarray,
    att_key_grad: np.ndarray,
    att_q: np.ndarray,
    users: np.ndarray,
    items: np.ndarray,
    weights: np.ndarray,
    given_negatives: np.ndarray,
    given_masks: np.ndarray,
    hist_indptr: np.ndarray,
    hist_indices: np.ndarray,
    user_acc: np.ndarray,
    item_acc: np.ndarray,
    rng_state: np.ndarray,
    tiles: np.ndarray,
    tile_left: np.ndarray,
    losses: np.ndarray,
    failure: np.ndarray,
    aggregator: int,
    num_negatives: int,
    g: float,
    margin: float,
    negative_weight: float,
    dropout: float,
    lr: float,
    v_lr: float,
    weight_decay: float,
    v_weight_decay: float,
    adagrad_eps: float,
    tile_refresh: int,
    v_sync: int,
    num_chunks: int,
    exclude_positive: bool,
    history_grad: bool,
    loss_options: tuple[int, float, float, np.ndarray, np.ndarray] | None,
) -> None:
    """The numba pass behind :func:`fused_sgd_step`: its tables, batch, history and state, then its settings.

    ``att_keys`` holds the attention keys ``tanh(W_k e + b_k)`` of every item, computed once per call from the item
    rows at its start; the kernel adds the gradient of each key's pre-activation to that item's row of
    ``att_key_grad`` (Hogwild across threads), and :func:`fused_sgd_step` applies what flows through ``W_k`` after
    the pass. Both are ``(1, 1)`` placeholders for the mean aggregator and MF-CCL. ``failure`` is ``(num_chunks + 1,
    3)`` int64: row ``c`` records the first sample of chunk ``c`` that read a non-finite value (``sample, what,
    row``, else ``-1``), the last row's first entry stops every chunk once one has failed. ``loss_options`` is
    ``None`` for CCL without clipping, else ``(loss, temperature, grad_clip, user_buffer, item_buffer)`` (the
    buffers are ``(0, 0)`` unless clipping uses HEAT's row buffers).
    """
    hmax = _longest_history(hist_indptr, g < 1.0 and aggregator != AGGREGATOR_MEAN)
    chunk = (users.shape[0] + num_chunks - 1) // num_chunks
    for c in prange(num_chunks):
        # one call per chunk: numba's parfor passes then see a loop of one call, not the whole per-sample body
        _fused_chunk(
            np.int64(c),  # the same argument types here and in the parfor's gufunc (uint64 index): one compilation
            chunk,
            hmax,
            user_emb,
            item_emb,
            V,
            att_keys,
            att_key_grad,
            att_q,
            users,
            items,
            weights,
            given_negatives,
            given_masks,
            hist_indptr,
            hist_indices,
            user_acc,
            item_acc,
            rng_state,
            tiles,
            tile_left,
            losses,
            failure,
            aggregator,
            num_negatives,
            g,
            margin,
            negative_weight,
            dropout,
            lr,
            v_lr,
            weight_decay,
            v_weight_decay,
            adagrad_eps,
            tile_refresh,
            v_sync,
            num_chunks,
            exclude_positive,
            history_grad,
            loss_options,
        )


_NO_ROWS = np.zeros((0, 0), np.float32)


class Tables(NamedTuple):
    """The parameters a fused step updates in place (float32, C-contiguous).

    Attributes:
        user: ``(num_users, d)`` user rows.
        item: ``(num_items, d)`` item rows.
        V: ``(d, d)`` aggregator matrix (``p = g e_u + (1 - g) V h``); unused when ``g >= 1``.
        att_w: ``(d, d)`` attention key weights ``W_k`` (attention aggregators; else any ``(1, 1)``).
        att_b: ``(d,)`` attention key bias ``b_k`` (attention aggregators; else any ``(1,)``).
        att_q: ``(d,)`` attention query ``q`` (self-attention; else any ``(0,)``).
    """

    user: np.ndarray
    item: np.ndarray
    V: np.ndarray
    att_w: np.ndarray
    att_b: np.ndarray
    att_q: np.ndarray


class Batch(NamedTuple):
    """The positives of one step, and what tests may fix instead of the kernel's random draws.

    Attributes:
        users: ``(B,)`` int64 user of each positive.
        items: ``(B,)`` int64 item of each positive.
        weights: ``(B,)`` float32 weight of each positive (it multiplies the sample's loss), or ``(0,)`` for 1.
        negatives: ``(B, n)`` int64 negatives to use, or ``(0, 0)`` to sample inside the kernel.
        masks: ``(B, d)`` float32 dropout masks to use (already scaled), or ``(0, 0)`` to draw them inside the
            kernel when ``dropout > 0``.
    """

    users: np.ndarray
    items: np.ndarray
    weights: np.ndarray = np.zeros(0, np.float32)
    negatives: np.ndarray = np.zeros((0, 0), np.int64)
    masks: np.ndarray = _NO_ROWS


class History(NamedTuple):
    """The (capped) histories as CSR: ``indptr`` ``(num_users + 1,)`` int64 offsets and ``indices`` int64 items."""

    indptr: np.ndarray
    indices: np.ndarray


class StepState(NamedTuple):
    """What a fused step reads and advances besides the parameters.

    Attributes:
        rng: ``(>= num_chunks,)`` int64 per-chunk random state.
        tiles: ``(>= num_chunks, tile_size)`` int64 per-chunk negative tiles, redrawn in place.
        tile_left: ``(>= num_chunks,)`` int64 samples left before each tile is redrawn.
        losses: ``(B,)`` float32 output, the (weighted) loss of each positive.
        user_acc: ``(num_users,)`` float32 row-wise Adagrad accumulators of the user rows, or ``(0,)`` for SGD
            (``item_acc`` must then be empty too).
        item_acc: ``(num_items,)`` float32 row-wise Adagrad accumulators of the item rows, or ``(0,)``.
        user_buffer: ``(num_users, d)`` float32 running gradient buffers of the user rows for
            ``clip_mode=CLIP_ROW_BUFFER``, else ``(0, 0)``.
        item_buffer: ``(num_items, d)`` float32 buffers of the item rows, else ``(0, 0)``.
    """

    rng: np.ndarray
    tiles: np.ndarray
    tile_left: np.ndarray
    losses: np.ndarray
    user_acc: np.ndarray = np.zeros(0, np.float32)
    item_acc: np.ndarray = np.zeros(0, np.float32)
    user_buffer: np.ndarray = _NO_ROWS
    item_buffer: np.ndarray = _NO_ROWS


@dataclass(frozen=True)
class StepSettings:
    """The scalar settings of one fused step (see :class:`~lightning_sdp.models.simplex.SimpleXModule`).

    Attributes:
        aggregator: :data:`AGGREGATOR_MEAN`, :data:`AGGREGATOR_USER_ATTENTION` or :data:`AGGREGATOR_SELF_ATTENTION`.
        num_negatives: ``n`` when sampling inside the kernel.
        g: gate; ``1`` is MF-CCL.
        margin: negative margin ``m`` (CCL).
        negative_weight: ``w``; each active negative contributes ``w / n`` (CCL).
        dropout: dropout rate on the normalised user vector (training), in ``[0, 1)``.
        lr: SGD learning rate (per sample) of the embedding rows.
        v_lr: SGD learning rate of the aggregator parameters; a thread applies the sum of its samples' gradients
            every ``v_sync`` samples (``W_k`` and ``b_k`` move once, after the pass).
        weight_decay: L2 coefficient on the touched user, positive and negative rows.
        v_weight_decay: L2 coefficient on ``V`` per sample (applied with the accumulated ``dV``).
        adagrad_eps: row-wise Adagrad's ``eps`` added to ``sqrt(acc)``.
        tile_refresh: redraw a tile every this many samples; ``0`` selects uniform sampling over all items.
        v_sync: samples between applications of a thread's aggregator gradients.
        num_chunks: chunks processed in parallel (one per thread).
        exclude_positive: never draw a sample's positive as one of its negatives (a draw that hits it is replaced
            by a uniform draw among the other items); with given negatives this is the caller's business.
        history_grad: whether the history rows get their share of the gradient (SimpleX); ``False`` is HEAT's code,
            where they only feed the aggregator (needs the mean aggregator).
        loss: :data:`LOSS_CCL` or :data:`LOSS_SOFTMAX` (cross-entropy of the positive among itself and its negatives
            over ``cos / temperature``; ``margin`` and ``negative_weight`` unused).
        temperature: the softmax temperature; its float32 inverse must be finite.
        grad_clip: bound of each coordinate of a row's gradient, ``0`` for none (needs the mean aggregator when
            ``g < 1``; ``V`` is never clipped).
        clip_mode: :data:`CLIP_PER_SAMPLE` or :data:`CLIP_ROW_BUFFER` (HEAT's; needs SGD and the buffers).
    """

    aggregator: int = AGGREGATOR_MEAN
    num_negatives: int = 64
    g: float = 1.0
    margin: float = 0.9
    negative_weight: float = 150.0
    dropout: float = 0.0
    lr: float = 0.05
    v_lr: float = 0.05
    weight_decay: float = 0.0
    v_weight_decay: float = 0.0
    adagrad_eps: float = 1e-8
    tile_refresh: int = 0
    v_sync: int = 32
    num_chunks: int = 1
    exclude_positive: bool = True
    history_grad: bool = True
    loss: int = LOSS_CCL
    temperature: float = 0.07
    grad_clip: float = 0.0
    clip_mode: int = CLIP_PER_SAMPLE


class StepFailure(NamedTuple):
    """The first sample of a fused step that read a non-finite value (the step stopped there).

    Attributes:
        sample: its position in the batch.
        what: :data:`FAILED_USER_VECTOR`, :data:`FAILED_POSITIVE` or :data:`FAILED_NEGATIVE`.
        row: the user row (user vector) or the item row (positive, negative) that was read.
    """

    sample: int
    what: int
    row: int


def _loss_options(settings: StepSettings, state: StepState) -> tuple[int, float, float, np.ndarray, np.ndarray] | None:
    """The kernel's ``loss_options``, after checking them; ``None`` selects its plain-CCL specialisation."""
    s = settings
    if s.loss not in (LOSS_CCL, LOSS_SOFTMAX):
        raise ValueError(f"fused_sgd_step: loss must be LOSS_CCL or LOSS_SOFTMAX, got {s.loss}.")
    if s.loss == LOSS_SOFTMAX and not (s.temperature > 0 and np.isfinite(np.float32(1.0) / np.float32(s.temperature))):
        raise ValueError(f"fused_sgd_step: the temperature's float32 inverse must be finite, got {s.temperature}.")
    if not s.history_grad and s.aggregator != AGGREGATOR_MEAN:
        raise ValueError("fused_sgd_step: history_grad=False (HEAT's rule) needs the mean aggregator.")
    if s.grad_clip > 0 and s.g < 1.0 and s.aggregator != AGGREGATOR_MEAN:
        # the attention keys' gradient reaches the item rows after the pass, summed over the batch: not per sample
        raise ValueError("fused_sgd_step: grad_clip needs the mean aggregator when g < 1.")
    buffered = s.clip_mode == CLIP_ROW_BUFFER
    if buffered:
        if not (s.grad_clip > 0 and state.user_acc.shape[0] == 0 and state.user_buffer.shape[0] > 0):
            raise ValueError(
                "fused_sgd_step: clip_mode=CLIP_ROW_BUFFER needs grad_clip > 0, SGD (no Adagrad accumulators) and "
                "the row buffers in the state."
            )
    if s.loss == LOSS_CCL and not s.grad_clip > 0:
        return None
    buffers = (state.user_buffer, state.item_buffer) if buffered else (_NO_ROWS, _NO_ROWS)
    return int(s.loss), float(s.temperature), float(s.grad_clip), *buffers


def fused_sgd_step(
    tables: Tables, batch: Batch, history: History, state: StepState, settings: StepSettings
) -> StepFailure | None:
    """One fused SGD pass over a batch of positives, updating ``tables`` and ``state`` in place.

    Args:
        tables: the parameters (:class:`Tables`).
        batch: the positives (:class:`Batch`).
        history: the capped histories (:class:`History`).
        state: samplers, losses, optimiser state (:class:`StepState`).
        settings: the scalar settings (:class:`StepSettings`).

    Returns:
        ``None``, or the first sample that read a NaN or infinite value (:class:`StepFailure`): every thread stopped
        there, before that sample changed anything, so the caller can name the row.
    """
    s = settings
    options = _loss_options(s, state)
    failure = np.full((s.num_chunks + 1, 3), -1, np.int64)
    failure[s.num_chunks] = 0
    head = (batch.users, batch.items, batch.weights, batch.negatives, batch.masks, history.indptr, history.indices)
    tail = (
        *head,
        state.user_acc,
        state.item_acc,
        state.rng,
        state.tiles,
        state.tile_left,
        state.losses,
        failure,
        s.aggregator,
        s.num_negatives,
        s.g,
        s.margin,
        s.negative_weight,
        s.dropout,
        s.lr,
        s.v_lr,
        s.weight_decay,
        s.v_weight_decay,
        s.adagrad_eps,
        s.tile_refresh,
        s.v_sync,
        s.num_chunks,
        s.exclude_positive,
        s.history_grad,
        options,
    )
    if s.g >= 1.0 or s.aggregator == AGGREGATOR_MEAN:
        placeholder = np.zeros((1, 1), np.float32)
        _fused_sgd_kernel(tables.user, tables.item, tables.V, placeholder, placeholder, tables.att_q, *tail)
    else:
        _attention_step(tables, tail, s, state.item_acc)
    return _first_failure(failure[: s.num_chunks])


def _attention_step(tables: Tables, tail: tuple, s: StepSettings, item_acc: np.ndarray) -> None:
    """The kernel pass of an attention aggregator, with the key path applied after it."""
    # The attention keys depend on the item rows and W_k only, not on the user: computed once per batch (as the
    # batched reference does) they cost O(num_items d^2) a batch instead of O(|H| d^2) a sample.
    item_emb, att_w, att_b = tables.item, tables.att_w, tables.att_b
    rows_before = torch.from_numpy(item_emb.copy())
    w, b = torch.from_numpy(att_w), torch.from_numpy(att_b)
    keys = torch.tanh(torch.addmm(b, rows_before, w.T)).numpy()
    key_grad = np.zeros_like(item_emb)
    _fused_sgd_kernel(tables.user, item_emb, tables.V, keys, key_grad, tables.att_q, *tail)
    touched = np.flatnonzero(np.any(key_grad != 0, axis=1))
    grad = torch.from_numpy(key_grad[touched])
    step = (grad @ w).numpy()
    if item_acc.shape[0] > 0:  # row-wise Adagrad: the key path steps with the row's rate, as already accumulated
        step *= (np.float32(s.lr) / (np.sqrt(item_acc[touched]) + np.float32(s.adagrad_eps)))[:, None]
    else:
        step *= np.float32(s.lr)
    item_emb[touched] -= step
    att_w -= np.float32(s.v_lr) * (grad.T @ rows_before[touched]).numpy()
    att_b -= np.float32(s.v_lr) * grad.sum(dim=0).numpy()


def compile_counts() -> tuple[int, int]:
    """``(compiled, loaded)``: specialisations of the fused kernel compiled, and loaded from the disk cache, so far
    in this process."""
    stats = _fused_sgd_kernel.stats
    return sum(stats.cache_misses.values()), sum(stats.cache_hits.values())


def cache_dir() -> str:
    """The folder numba caches the compiled kernels in.

    numba tries, in order: ``NUMBA_CACHE_DIR`` when set; the ``__pycache__`` folder beside this file when it is
    writable (a source checkout, an editable install); else a user-wide folder (``$XDG_CACHE_HOME/numba`` or
    ``~/.cache/numba`` on Linux), which is where an installed, read-only package caches.
    """
    return str(_fused_sgd_kernel.stats.cache_path)


def _first_failure(records: np.ndarray) -> StepFailure | None:
    """The failure of the earliest sample among the chunks' records (``-1``: none)."""
    failed = records[records[:, 0] >= 0]
    if len(failed) == 0:
        return None
    first = failed[failed[:, 0].argmin()]
    return StepFailure(int(first[0]), int(first[1]), int(first[2]))


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
