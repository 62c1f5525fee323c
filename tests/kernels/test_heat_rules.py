"""HEAT's own rules, as options, against a plain-Python transcription of the artifact's arithmetic.

The transcription follows hipdac-lab/ICS23-HEAT: ``cf_cpu/src/modules/models/matrix_factorization.cpp``
(``forward_backward``: the softmax loss over ``(cos_neg - cos_pos) / 0.07``, the gradients added to each row's
gradient buffer, each negative stepped inside the loop), ``optimizers/sgd.cpp`` (``sparse_step``: clip the buffer
in place, ``row -= lr * buffer``), ``behavior_aggregators/behavior_aggregators.cpp`` (``p = gamma e_u + (1 - gamma)
mean(H) W``; ``W`` steps by ``lr`` times the mean of 32 samples' gradients; the user's buffer is scaled by ``gamma``)
and ``train/engine.cpp`` (the buffers are cleared once per epoch).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_sdp.kernels import cf_reference as ref

_TAU = 0.07


class HeatArtifact:
    """The artifact's per-sample arithmetic on numpy copies of the tables (one thread, one epoch)."""

    def __init__(self, users: np.ndarray, items: np.ndarray, W: np.ndarray, gamma: float, lr: float, clip: float):
        self.U, self.I, self.W = users.astype(np.float64), items.astype(np.float64), W.astype(np.float64)
        self.user_grads = np.zeros_like(self.U)
        self.item_grads = np.zeros_like(self.I)
        self.gamma, self.lr, self.clip = gamma, lr, clip
        self.iteration = 0
        self.w_grad_sum = np.zeros_like(self.W)

    def _sparse_step(self, emb: np.ndarray, grad: np.ndarray) -> None:  # SGD::sparse_step
        grad[:] = np.clip(grad, -self.clip, self.clip)
        emb -= self.lr * grad

    def forward_backward(self, user: int, pos: int, negs: list[int], history: list[int]) -> float:
        eps = 1e-8
        u = self.U[user].copy()
        # BehaviorAggregator::forward
        means = self.I[history].mean(0)
        u = self.gamma * u + (1 - self.gamma) * (means @ self.W)
        self.iteration += 1
        p = self.I[pos].copy()
        uu, pp, up = u @ u, p @ p, u @ p
        un, pn = np.sqrt(max(uu, eps)), np.sqrt(max(pp, eps))
        u_p_cos_u_grad = (uu * p - up * u) / (un**3 * pn)
        u_p_cos_p_grad = -(pp * u - up * p) / (un * pn**3)
        neg_embs = self.I[negs].copy()
        user_neg_dots = neg_embs @ u
        neg_neg_dots = (neg_embs * neg_embs).sum(1)
        neg_norm = np.sqrt(np.where(neg_neg_dots < eps, eps, neg_neg_dots))
        score = (user_neg_dots / (un * neg_norm) - up / (un * pn)) / _TAU
        top = score.max()
        exp_score = np.exp(score - top)
        total = exp_score.sum() + np.exp(-top)
        loss = top + np.log(total)
        loss_grad = exp_score / total / _TAU
        user_grad = self.user_grads[user].copy()
        pos_grad = self.item_grads[pos].copy()
        for j, neg in enumerate(negs):
            neg_grad = self.item_grads[neg].copy()
            u_n_cos_u_grad = (uu * neg_embs[j] - user_neg_dots[j] * u) / (un**3 * neg_norm[j])
            u_n_cos_n_grad = (neg_neg_dots[j] * u - user_neg_dots[j] * neg_embs[j]) / (un * neg_norm[j] ** 3)
            user_grad += loss_grad[j] * (u_n_cos_u_grad - u_p_cos_u_grad)
            pos_grad += loss_grad[j] * u_p_cos_p_grad
            neg_grad += loss_grad[j] * u_n_cos_n_grad
            self._sparse_step(neg_embs[j], neg_grad)
            self.I[neg] = neg_embs[j]
            self.item_grads[neg] = neg_grad
        # BehaviorAggregator::backward on the user's buffer
        self.w_grad_sum += np.outer(means, (1 - self.gamma) * user_grad)
        if self.iteration % 32 == 0:
            self.W -= self.lr * self.w_grad_sum / 32
            self.w_grad_sum[:] = 0
        user_grad *= self.gamma
        self._sparse_step(u, user_grad)
        self._sparse_step(p, pos_grad)
        self.U[user], self.user_grads[user] = u, user_grad
        self.I[pos], self.item_grads[pos] = p, pos_grad
        return float(loss)


def _sequence(seed: int, num_users: int, num_items: int, samples: int, n: int):
    """Samples that revisit users and items (so the buffers carry gradients from one visit to the next)."""
    rng = np.random.default_rng(seed)
    users = rng.integers(0, num_users, samples)
    items = rng.integers(0, num_items, samples)
    negatives = np.stack([rng.choice(np.delete(np.arange(num_items), i), n, replace=False) for i in items])
    return users.astype(np.int64), items.astype(np.int64), negatives.astype(np.int64)


def _tables(seed: int, num_users: int, num_items: int, d: int):
    rng = np.random.default_rng(seed)
    return (
        (0.3 * rng.normal(size=(num_users, d))).astype(np.float32),
        (0.3 * rng.normal(size=(num_items, d))).astype(np.float32),
    )


def _fused_sequence(user_emb, item_emb, users, items, negatives, *, lr, clip, mode, g=1.0, V=None, hist=None, **kw):
    from lightning_sdp.kernels import cf_numba

    d = user_emb.shape[1]
    ue, ie = user_emb.copy(), item_emb.copy()
    v = np.eye(d, dtype=np.float32) if V is None else V.copy()
    indptr, indices = hist if hist is not None else (np.zeros(len(ue) + 1, np.int64), np.zeros(0, np.int64))
    buffered = mode == cf_numba.CLIP_ROW_BUFFER
    user_buf = np.zeros_like(ue) if buffered else np.zeros((0, 0), np.float32)
    item_buf = np.zeros_like(ie) if buffered else np.zeros((0, 0), np.float32)
    losses = np.zeros(len(users), np.float32)
    state = cf_numba.StepState(
        np.arange(1, 2, dtype=np.int64),
        np.zeros((1, 0), np.int64),
        np.zeros(1, np.int64),
        losses,
        user_buffer=user_buf,
        item_buffer=item_buf,
    )
    settings = cf_numba.StepSettings(
        num_negatives=negatives.shape[1],
        g=g,
        lr=lr,
        loss=cf_numba.LOSS_SOFTMAX,
        temperature=_TAU,
        grad_clip=clip,
        clip_mode=mode,
        num_chunks=1,
        **kw,
    )
    placeholders = (np.zeros((1, 1), np.float32), np.zeros(1, np.float32), np.zeros(0, np.float32))
    failure = cf_numba.fused_sgd_step(
        cf_numba.Tables(ue, ie, v, *placeholders),
        cf_numba.Batch(users, items, negatives=negatives),
        cf_numba.History(indptr, indices),
        state,
        settings,
    )
    assert failure is None
    return ue, ie, v, user_buf, item_buf, losses


@pytest.mark.numba
@pytest.mark.parametrize("clip", [0.05, 0.5])
def test_fused_row_buffer_clipping_is_the_artifacts(clip):
    from lightning_sdp.kernels import cf_numba

    num_users, num_items, d, lr = 4, 12, 6, 0.05
    user_emb, item_emb = _tables(1, num_users, num_items, d)
    users, items, negatives = _sequence(2, num_users, num_items, 40, 5)
    heat = HeatArtifact(user_emb, item_emb, np.zeros((d, d)), gamma=1.0, lr=lr, clip=clip)
    want_losses = [heat.forward_backward(u, i, list(n), [0]) for u, i, n in zip(users, items, negatives, strict=True)]
    ue, ie, _, ubuf, ibuf, losses = _fused_sequence(
        user_emb, item_emb, users, items, negatives, lr=lr, clip=clip, mode=cf_numba.CLIP_ROW_BUFFER
    )
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ue, heat.U, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ie, heat.I, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ubuf, heat.user_grads, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ibuf, heat.item_grads, rtol=1e-4, atol=1e-5)
    # clipping each sample's own gradient is another rule: it parts from the artifact once rows are revisited
    ue_sample, ie_sample, *_ = _fused_sequence(
        user_emb, item_emb, users, items, negatives, lr=lr, clip=clip, mode=cf_numba.CLIP_PER_SAMPLE
    )
    assert np.abs(ie_sample - heat.I).max() > 1e-3


@pytest.mark.parametrize("clip", [0.05, 0.5])
def test_reference_row_buffer_clipping_is_the_artifacts_one_sample_per_batch(clip):
    from lightning_sdp.models.simplex import SimpleXModule

    num_users, num_items, d, lr = 4, 12, 6, 0.05
    user_emb, item_emb = _tables(3, num_users, num_items, d)
    users, items, negatives = _sequence(4, num_users, num_items, 30, 5)
    heat = HeatArtifact(user_emb, item_emb, np.zeros((d, d)), gamma=1.0, lr=lr, clip=clip)
    for u, i, n in zip(users, items, negatives, strict=True):
        heat.forward_backward(u, i, list(n), [0])
    model = SimpleXModule(
        num_users,
        num_items,
        dim=d,
        backend="reference",
        optimizer="sgd",
        lr=lr,
        loss="softmax",
        temperature=_TAU,
        grad_clip=clip,
        grad_clip_mode="row_buffer",
        num_negatives=5,
    )
    with torch.no_grad():
        model.user_embedding.weight.copy_(torch.from_numpy(user_emb))
        model.item_embedding.weight.copy_(torch.from_numpy(item_emb))
    model.set_interactions(np.zeros(num_users + 1, np.int64), np.zeros(0, np.int64))
    opt = model._optimizer()
    assert isinstance(opt, ref.RowBufferSGD)
    for b in range(len(users)):
        u, i, n = torch.tensor(users[b : b + 1]), torch.tensor(items[b : b + 1]), torch.tensor(negatives[b : b + 1])
        opt.zero_grad()
        objective, _ = model.reference_loss(u, i, n, reduction="sum")
        objective.backward()
        opt.touch(model.user_embedding.weight, u)
        opt.touch(model.item_embedding.weight, torch.cat([i, n.reshape(-1)]))
        opt.step()
    np.testing.assert_allclose(model.user_embedding.weight.detach().numpy(), heat.U, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(model.item_embedding.weight.detach().numpy(), heat.I, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(model.clip_buffer_item.numpy(), heat.item_grads, rtol=1e-4, atol=1e-5)


def _disjoint_simplex_batch(num_samples: int, n: int, hist_len: int, num_users: int):
    """Samples that share no row at all (users, positives, negatives, histories; no history holds its positive)."""
    items = np.arange(num_samples)
    negatives = num_samples + np.arange(num_samples * n).reshape(num_samples, n)
    start = num_samples * (1 + n)
    history = [list(start + s * hist_len + np.arange(hist_len)) for s in range(num_samples)]
    indptr = np.zeros(num_users + 1, np.int64)
    indptr[1 : num_samples + 1] = np.cumsum([hist_len] * num_samples)
    indptr[num_samples + 1 :] = indptr[num_samples]
    indices = np.concatenate(history).astype(np.int64)
    return (
        np.arange(num_samples, dtype=np.int64),
        items.astype(np.int64),
        negatives.astype(np.int64),
        history,
        (
            indptr,
            indices,
        ),
    )


@pytest.mark.numba
def test_aggregator_step_is_the_artifacts_mean_of_32_with_a_rate_of_lr_over_v_sync():
    """HEAT steps W by lr times the mean of 32 samples' gradients; the fused kernel steps V by the sum of v_sync
    samples' gradients at aggregator_lr_scale * lr, so aggregator_lr_scale = 1 / v_sync is HEAT's step."""
    from lightning_sdp.kernels import cf_numba

    samples, n, hist_len, d, gamma, lr = 32, 3, 4, 6, 0.4, 0.05
    users, items, negatives, history, hist = _disjoint_simplex_batch(samples, n, hist_len, samples + 2)
    num_items = samples * (1 + n + hist_len)
    user_emb, item_emb = _tables(5, samples + 2, num_items, d)
    W = (np.eye(d) + 0.2 * np.random.default_rng(6).normal(size=(d, d))).astype(np.float32)
    heat = HeatArtifact(user_emb, item_emb, W, gamma=gamma, lr=lr, clip=1e9)
    for s in range(samples):
        heat.forward_backward(int(users[s]), int(items[s]), list(negatives[s]), history[s])
    _, _, v, *_ = _fused_sequence(
        user_emb,
        item_emb,
        users,
        items,
        negatives,
        lr=lr,
        clip=1e9,
        mode=cf_numba.CLIP_PER_SAMPLE,
        g=gamma,
        V=np.ascontiguousarray(W.T),
        hist=hist,
        v_lr=lr / 32,
        v_sync=32,
    )
    assert np.abs(heat.W - W).max() > 1e-4  # the artifact's W moved
    np.testing.assert_allclose(v, heat.W.T, rtol=1e-4, atol=1e-6)
    # at aggregator_lr_scale = 1 the kernel's step is 32 times HEAT's: per-sample SGD on V, delayed
    _, _, v_sum, *_ = _fused_sequence(
        user_emb,
        item_emb,
        users,
        items,
        negatives,
        lr=lr,
        clip=1e9,
        mode=cf_numba.CLIP_PER_SAMPLE,
        g=gamma,
        V=np.ascontiguousarray(W.T),
        hist=hist,
        v_lr=lr,
        v_sync=32,
    )
    np.testing.assert_allclose(v_sum - W.T, 32 * (heat.W.T - W.T), rtol=1e-3, atol=1e-5)


def test_reference_aggregator_steps_by_the_batch_mean_as_the_artifact():
    """The reference backend's SGD steps V by lr times the batch mean: HEAT's rule for a batch of 32 samples."""
    from lightning_sdp.models.simplex import SimpleXModule

    samples, n, hist_len, d, gamma, lr = 32, 3, 4, 6, 0.4, 0.05
    num_users = samples + 2
    users, items, negatives, history, hist = _disjoint_simplex_batch(samples, n, hist_len, num_users)
    num_items = samples * (1 + n + hist_len)
    user_emb, item_emb = _tables(7, num_users, num_items, d)
    W = (np.eye(d) + 0.2 * np.random.default_rng(8).normal(size=(d, d))).astype(np.float32)
    heat = HeatArtifact(user_emb, item_emb, W, gamma=gamma, lr=lr, clip=1e9)
    for s in range(samples):
        heat.forward_backward(int(users[s]), int(items[s]), list(negatives[s]), history[s])
    model = SimpleXModule(
        num_users,
        num_items,
        dim=d,
        g=gamma,
        backend="reference",
        optimizer="sgd",
        lr=lr,
        loss="softmax",
        temperature=_TAU,
        grad_clip=None,
        num_negatives=n,
        max_history=hist_len,
    )
    with torch.no_grad():
        model.user_embedding.weight.copy_(torch.from_numpy(user_emb))
        model.item_embedding.weight.copy_(torch.from_numpy(item_emb))
        model.aggregator.copy_(torch.from_numpy(np.ascontiguousarray(W.T)))
    model.set_interactions(*hist)
    opt = model._optimizer()
    objective, _ = model.reference_loss(torch.tensor(users), torch.tensor(items), torch.tensor(negatives))
    objective.backward()
    opt.step()
    np.testing.assert_allclose(model.aggregator.detach().numpy(), heat.W.T, rtol=1e-4, atol=1e-6)


@pytest.mark.numba
@pytest.mark.parametrize("clip", [0.02, 1e9])
def test_fused_history_rows_are_only_read_as_in_the_artifact(clip):
    """history_grad=False with row buffers and HEAT's aggregator step: item rows (the history rows unchanged) and V
    equal the transcription at gamma 0.4 (the user rows differ by design: HEAT writes p into the user row)."""
    from lightning_sdp.kernels import cf_numba

    samples, n, hist_len, d, gamma, lr = 32, 3, 4, 6, 0.4, 0.05
    users, items, negatives, history, hist = _disjoint_simplex_batch(samples, n, hist_len, samples + 2)
    num_items = samples * (1 + n + hist_len)
    user_emb, item_emb = _tables(9, samples + 2, num_items, d)
    W = (np.eye(d) + 0.2 * np.random.default_rng(10).normal(size=(d, d))).astype(np.float32)
    heat = HeatArtifact(user_emb, item_emb, W, gamma=gamma, lr=lr, clip=clip)
    for s in range(samples):
        heat.forward_backward(int(users[s]), int(items[s]), list(negatives[s]), history[s])
    common = dict(lr=lr, clip=clip, mode=cf_numba.CLIP_ROW_BUFFER, g=gamma, V=np.ascontiguousarray(W.T), hist=hist)
    _, ie, v, *_ = _fused_sequence(
        user_emb, item_emb, users, items, negatives, **common, v_lr=lr / 32, v_sync=32, history_grad=False
    )
    np.testing.assert_allclose(ie, heat.I, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(v, heat.W.T, rtol=1e-4, atol=1e-6)
    history_rows = hist[1]
    np.testing.assert_array_equal(ie[history_rows], item_emb[history_rows])
    # SimpleX's rule (the default) moves the history rows
    _, ie_simplex, *_ = _fused_sequence(user_emb, item_emb, users, items, negatives, **common, v_lr=lr / 32)
    assert np.abs(ie_simplex[history_rows] - item_emb[history_rows]).max() > 1e-5


def test_reference_history_rows_get_no_gradient_without_history_grad():
    from lightning_sdp.models.simplex import SimpleXModule

    samples, n, hist_len, d = 8, 3, 4, 6
    num_users = samples + 2
    users, items, negatives, _, hist = _disjoint_simplex_batch(samples, n, hist_len, num_users)
    num_items = samples * (1 + n + hist_len)
    grads = {}
    for history_grad in (True, False):
        model = SimpleXModule(
            num_users,
            num_items,
            dim=d,
            g=0.4,
            backend="reference",
            optimizer="sgd",
            loss="softmax",
            grad_clip=None,
            num_negatives=n,
            max_history=hist_len,
            history_grad=history_grad,
        )
        model.set_interactions(*hist)
        objective, _ = model.reference_loss(torch.tensor(users), torch.tensor(items), torch.tensor(negatives))
        objective.backward()
        grads[history_grad] = (model.item_embedding.weight.grad.clone(), model.aggregator.grad.clone())
    history_rows = torch.from_numpy(hist[1])
    assert grads[True][0][history_rows].abs().max() > 0
    assert grads[False][0][history_rows].abs().max() == 0
    others = torch.ones(num_items, dtype=torch.bool)
    others[history_rows] = False
    torch.testing.assert_close(grads[False][0][others], grads[True][0][others])  # positives and negatives as before
    torch.testing.assert_close(grads[False][1], grads[True][1])  # V's gradient does not depend on it


def test_history_grad_false_needs_the_mean_aggregator():
    from lightning_sdp.models.simplex import SimpleXModule

    with pytest.raises(ValueError, match="history_grad=False.*aggregator='mean'"):
        SimpleXModule(10, 10, g=0.5, aggregator="user_attention", history_grad=False, grad_clip=None)
    with pytest.raises(TypeError, match="history_grad"):
        SimpleXModule(10, 10, history_grad="no")


# ---------------------------------------------------------------------------------------------- negatives
@pytest.mark.numba
def test_kernel_negatives_never_equal_the_positive_and_are_uniform_over_the_others():
    from lightning_sdp.kernels import cf_numba

    num_items, n = 7, 64
    positives = np.tile(np.arange(num_items), 400).astype(np.int64)
    out = np.zeros((len(positives), n), np.int64)
    cf_numba.draw_negatives(np.int64(11), num_items, positives, True, out)
    assert not (out == positives[:, None]).any()
    for item in range(num_items):
        counts = np.bincount(out[positives == item].ravel(), minlength=num_items)
        others = np.delete(counts, item)
        expected = others.sum() / (num_items - 1)
        assert np.abs(others - expected).max() < 5 * np.sqrt(expected)  # uniform over the other items
    cf_numba.draw_negatives(np.int64(11), num_items, positives, False, out)
    hits = (out == positives[:, None]).mean()
    assert abs(hits - 1 / num_items) < 0.01  # without the flag, the positive is drawn like any item


@pytest.mark.numba
@pytest.mark.parametrize("tile_refresh", [0, 4])
def test_in_kernel_negatives_skip_the_positive_with_either_sampler(tile_refresh):
    """With two items every negative of a positive must be the other item: the losses say which were drawn."""
    from lightning_sdp.kernels import cf_numba

    d, n, w, margin = 4, 16, 2.0, -1.0  # margin -1: every negative counts, by its cosine
    item_emb = np.array([[1, 0, 0, 0], [0.6, 0.8, 0, 0]], np.float32)
    user_emb = np.array([[1, 0.2, 0, 0]], np.float32)
    users, items = np.zeros(50, np.int64), np.zeros(50, np.int64)
    cos = (item_emb @ user_emb[0]) / (np.linalg.norm(item_emb, axis=1) * np.linalg.norm(user_emb[0]))
    for exclude in (True, False):
        losses = np.zeros(50, np.float32)
        cf_numba.fused_sgd_step(
            cf_numba.Tables(user_emb.copy(), item_emb.copy(), np.eye(d, dtype=np.float32), *_placeholders()),
            cf_numba.Batch(users, items),
            cf_numba.History(np.zeros(2, np.int64), np.zeros(0, np.int64)),
            cf_numba.StepState(np.array([5], np.int64), np.zeros((1, 3), np.int64), np.zeros(1, np.int64), losses),
            cf_numba.StepSettings(
                num_negatives=n,
                margin=margin,
                negative_weight=w,
                lr=0.0,
                v_lr=0.0,
                tile_refresh=tile_refresh,
                exclude_positive=exclude,
            ),
        )
        all_other = (1 - cos[0]) + w * (cos[1] - margin)
        if exclude:
            np.testing.assert_allclose(losses, all_other, rtol=1e-5)
        else:
            assert np.abs(losses - all_other).max() > 1e-3


def _placeholders():
    return np.zeros((1, 1), np.float32), np.zeros(1, np.float32), np.zeros(0, np.float32)


def test_reference_negatives_never_equal_the_positive():
    gen = torch.Generator().manual_seed(0)
    items = torch.arange(5).repeat(300)
    drawn = ref.sample_negatives(items, 32, 5, gen)
    assert not (drawn == items[:, None]).any() and drawn.min() >= 0 and drawn.max() <= 4
    counts = torch.bincount(drawn[items == 2].flatten(), minlength=5)
    assert counts[2] == 0 and (counts[[0, 1, 3, 4]] > 0.2 * counts.sum()).all()
    with_positive = ref.sample_negatives(items, 32, 5, gen, exclude_positive=False)
    assert (with_positive == items[:, None]).any()
    with pytest.raises(ValueError, match="at least 2 items"):
        ref.sample_negatives(torch.tensor([0]), 3, 1, gen)


# ---------------------------------------------------------------------------------------------- through the Trainer
@pytest.mark.parametrize("backend", ["reference", pytest.param("fused", marks=pytest.mark.numba)])
def test_row_buffers_train_and_are_cleared_each_epoch(backend, tmp_path):
    from lightning.pytorch import Callback, Trainer

    from lightning_sdp.datamodules.interactions import InteractionsDataModule
    from lightning_sdp.models.simplex import SimpleXModule

    class Buffers(Callback):
        def __init__(self) -> None:
            self.at_epoch_start: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 0:  # after the module's on_train_epoch_start, before the epoch's first step
                self.at_epoch_start.append(float(pl_module.clip_buffer_item.abs().sum()))

    dm = InteractionsDataModule(num_users=60, num_items=40, batch_size=64, eval_batch_size=32)
    model = SimpleXModule(
        dim=8,
        num_negatives=4,
        backend=backend,
        optimizer="sgd",
        lr=0.05,
        loss="softmax",
        grad_clip=0.1,
        grad_clip_mode="row_buffer",
    )
    watch = Buffers()
    trainer = Trainer(
        max_epochs=2,
        accelerator="cpu",
        callbacks=[watch],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, dm)
    assert watch.at_epoch_start == [0.0, 0.0]  # cleared at each epoch's start
    assert float(model.clip_buffer_item.abs().sum()) > 0 and float(model.clip_buffer_item.abs().max()) <= 0.1 + 1e-6
    ckpt = tmp_path / "model.ckpt"
    trainer.save_checkpoint(ckpt)
    loaded = SimpleXModule.load_from_checkpoint(ckpt)
    assert torch.equal(loaded.clip_buffer_item, model.clip_buffer_item)


def test_row_buffers_need_a_clip_and_sgd():
    from lightning_sdp.models.simplex import SimpleXModule

    with pytest.raises(ValueError, match="numeric grad_clip and optimizer='sgd'"):
        SimpleXModule(grad_clip_mode="row_buffer", grad_clip=None)
    with pytest.raises(ValueError, match="numeric grad_clip and optimizer='sgd'"):
        SimpleXModule(grad_clip_mode="row_buffer", grad_clip=0.1, optimizer="rowwise_adagrad")
    with pytest.raises(ValueError, match="numeric grad_clip and optimizer='sgd'"):
        SimpleXModule(grad_clip_mode="row_buffer", grad_clip=0.1, backend="reference")  # auto: Adam
