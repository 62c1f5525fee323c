"""HEAT's fused numba kernel against the plain-torch SimpleX reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_sdp.kernels import cf_reference as ref

pytestmark = pytest.mark.numba


def _problem(seed: int, num_users: int = 12, num_items: int = 60, d: int = 8):
    rng = np.random.default_rng(seed)
    user_emb = rng.normal(size=(num_users, d)).astype(np.float32)
    item_emb = rng.normal(size=(num_items, d)).astype(np.float32)
    V = (np.eye(d) + 0.3 * rng.normal(size=(d, d))).astype(np.float32)
    # three positives with disjoint users, items, negatives and histories (so per-sample SGD == batch SGD)
    users = np.array([0, 1, 2])
    items = np.array([3, 4, 5])
    negatives = np.arange(10, 10 + 3 * 5).reshape(3, 5)
    indptr = np.array([0, 3, 6, 9] + [9] * (num_users - 3))
    indices = np.array([3, 40, 41, 42, 43, 4, 44, 45, 46])  # user 0/1 histories contain their positive
    return user_emb, item_emb, V, users, items, negatives, indptr, indices


_NO_WEIGHTS = np.zeros(0, np.float32)


def _no_sums():
    """Empty row-wise Adagrad accumulators and eps: the kernel runs plain SGD."""
    return np.zeros(0, np.float32), np.zeros(0, np.float32), 1e-8


def _attention(aggregator: str, d: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random attention parameters ``(W_k, b_k, q)`` of ``aggregator`` (unused placeholders for the mean)."""
    rng = np.random.default_rng(seed)
    if aggregator == "mean":
        return np.zeros((1, 1), np.float32), np.zeros(1, np.float32), np.zeros(0, np.float32)
    w = (rng.normal(size=(d, d)) / np.sqrt(d)).astype(np.float32)
    b = (0.1 * rng.normal(size=d)).astype(np.float32)
    q = rng.normal(size=d).astype(np.float32) if aggregator == "self_attention" else np.zeros(0, np.float32)
    return w, b, q


def _fused(
    user_emb,
    item_emb,
    V,
    users,
    items,
    negatives,
    indptr,
    indices,
    *,
    g,
    margin,
    w,
    lr,
    wd,
    chunks=1,
    sums=None,
    vwd=0.0,
    aggregator="mean",
    att=None,
    masks=None,
    dropout=0.0,
    rng_state=None,
    weights=_NO_WEIGHTS,
    **loss_options,
):
    """One ``fused_sgd_step`` on copies of the problem; ``loss_options`` are further ``StepSettings`` fields."""
    from lightning_sdp.kernels import cf_numba

    ue, ie, v = user_emb.copy(), item_emb.copy(), V.copy()
    aw, ab, aq = (a.copy() for a in (att or _attention("mean", 1, 0)))
    losses = np.zeros(len(users), np.float32)
    acc = _no_sums() if sums is None else (sums[0], sums[1], 1e-8)
    given_masks = np.zeros((0, 0), np.float32) if masks is None else masks
    state = np.arange(4, dtype=np.int64) if rng_state is None else rng_state
    settings = cf_numba.StepSettings(
        aggregator=cf_numba.AGGREGATORS[aggregator],
        num_negatives=negatives.shape[1],
        g=g,
        margin=margin,
        negative_weight=w,
        dropout=dropout,
        lr=lr,
        v_lr=lr,
        weight_decay=wd,
        v_weight_decay=vwd,
        adagrad_eps=acc[2],
        v_sync=10_000,
        num_chunks=chunks,
        **loss_options,
    )
    failure = cf_numba.fused_sgd_step(
        cf_numba.Tables(ue, ie, v, aw, ab, aq),
        cf_numba.Batch(users, items, weights, negatives, given_masks),
        cf_numba.History(indptr, indices),
        cf_numba.StepState(state, np.zeros((4, 0), np.int64), np.zeros(4, np.int64), losses, acc[0], acc[1]),
        settings,
    )
    assert failure is None
    return ue, ie, v, losses, (aw, ab, aq)


def _reference_step(problem, *, g, margin, w, wd, vwd=0.0, aggregator="mean", att=None, masks=None, **loss_options):
    """Autograd gradients of the reference objective (sum over the batch): per-sample losses and ``{name: grad}``.

    ``loss_options``: the ``loss``, ``temperature`` and ``grad_clip`` arguments of ``ref.simplex_loss``.
    """
    user_emb, item_emb, V, users, items, negatives, indptr, indices = problem
    params = {"user": user_emb, "item": item_emb, "V": V}
    if aggregator != "mean":
        params.update(zip(("W", "b", "q"), att, strict=True))
    tensors = {k: torch.tensor(a, requires_grad=True) for k, a in params.items()}
    objective, per_sample = ref.simplex_loss(
        tensors["user"],
        tensors["item"],
        tensors["V"],
        torch.tensor(users),
        torch.tensor(items),
        torch.tensor(negatives),
        g,
        margin,
        w,
        ref.padded_history(indptr, indices),
        weight_decay=wd,
        reduction="sum",
        aggregator_weight_decay=vwd,
        aggregator=aggregator,
        att_w=tensors.get("W"),
        att_b=tensors.get("b"),
        att_q=tensors.get("q") if aggregator == "self_attention" else None,
        dropout_mask=None if masks is None else torch.from_numpy(masks),
        **loss_options,
    )
    objective.backward()
    grads = {k: (t.grad.numpy() if t.grad is not None else np.zeros_like(params[k])) for k, t in tensors.items()}
    return per_sample.detach().numpy(), grads


@pytest.mark.parametrize("aggregator", ["mean", "user_attention", "self_attention"])
@pytest.mark.parametrize("g", [1.0, 0.7, 0.5])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_fused_step_equals_reference_sgd_step(aggregator, g, wd):
    seed = int(g * 10) + int(wd * 100) + 100 * ("mean", "user_attention", "self_attention").index(aggregator)
    problem = _problem(seed)
    user_emb, item_emb, V, users, items, negatives, indptr, indices = problem
    att = _attention(aggregator, user_emb.shape[1], seed)
    margin, w, lr, vwd = 0.1, 3.0, 0.05, 5 * wd  # with wd > 0, V decays too (SimpleX only)
    per_sample, grads = _reference_step(
        problem, g=g, margin=margin, w=w, wd=wd, vwd=vwd, aggregator=aggregator, att=att
    )
    ue, ie, v, losses, (aw, ab, aq) = _fused(
        *problem, g=g, margin=margin, w=w, lr=lr, wd=wd, vwd=vwd, aggregator=aggregator, att=att
    )
    np.testing.assert_allclose(losses, per_sample, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ue, user_emb - lr * grads["user"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ie, item_emb - lr * grads["item"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v, V - lr * grads["V"], rtol=1e-5, atol=1e-6)
    if aggregator != "mean":
        np.testing.assert_allclose(aw, att[0] - lr * grads["W"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ab, att[1] - lr * grads["b"], rtol=1e-5, atol=1e-6)
        if aggregator == "self_attention":
            np.testing.assert_allclose(aq, att[2] - lr * grads["q"], rtol=1e-5, atol=1e-6)
    # the step did something: some rows moved, and (for SimpleX) the aggregator and history rows too
    assert np.abs(ie - item_emb).max() > 1e-4
    if g < 1:
        assert np.abs(v - V).max() > 1e-5
        assert np.abs(ie[40] - item_emb[40]).max() > 1e-6  # history row of user 0
        if aggregator != "mean":
            assert np.abs(aw - att[0]).max() > 1e-6 and np.abs(ab - att[1]).max() > 1e-6
        if aggregator == "self_attention":
            assert np.abs(aq - att[2]).max() > 1e-6
    if g < 1:
        return  # with two threads the shared V is updated while the other thread reads it (Hogwild)
    # two chunks (threads) on disjoint rows give the same result
    ue2, ie2, _, _, _ = _fused(*problem, g=g, margin=margin, w=w, lr=lr, wd=wd, chunks=2)
    np.testing.assert_allclose(ue2, ue, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ie2, ie, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("aggregator", ["mean", "user_attention", "self_attention"])
@pytest.mark.parametrize("g", [1.0, 0.5])
def test_fused_dropout_with_a_given_mask_equals_reference(aggregator, g):
    problem = _problem(21 + int(g * 10))
    user_emb, item_emb, V, users, items, negatives, indptr, indices = problem
    att = _attention(aggregator, user_emb.shape[1], 3)
    rate = 0.3
    masks = (np.random.default_rng(5).random((len(users), user_emb.shape[1])) >= rate) / np.float32(1 - rate)
    masks = masks.astype(np.float32)
    margin, w, lr = 0.1, 3.0, 0.05
    per_sample, grads = _reference_step(
        problem, g=g, margin=margin, w=w, wd=0.0, aggregator=aggregator, att=att, masks=masks
    )
    ue, ie, v, losses, (aw, ab, _) = _fused(
        *problem, g=g, margin=margin, w=w, lr=lr, wd=0.0, aggregator=aggregator, att=att, masks=masks
    )
    np.testing.assert_allclose(losses, per_sample, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ue, user_emb - lr * grads["user"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ie, item_emb - lr * grads["item"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v, V - lr * grads["V"], rtol=1e-5, atol=1e-6)
    if aggregator != "mean":
        np.testing.assert_allclose(aw, att[0] - lr * grads["W"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ab, att[1] - lr * grads["b"], rtol=1e-5, atol=1e-6)
    # the mask mattered: without it the losses differ
    _, _, _, plain, _ = _fused(*problem, g=g, margin=margin, w=w, lr=lr, wd=0.0, aggregator=aggregator, att=att)
    assert np.abs(plain - losses).max() > 1e-3


def test_in_kernel_dropout_draws_the_masks_of_draw_dropout_mask():
    from lightning_sdp.kernels import cf_numba

    problem = _problem(31)
    user_emb, item_emb, V, users, items, negatives, indptr, indices = problem
    d, rate = user_emb.shape[1], 0.25
    # with given negatives the per-chunk random state is used for the dropout masks only, one sample after another
    state = np.int64(77)
    masks = np.zeros((len(users), d), np.float32)
    for b in range(len(users)):
        state = cf_numba.draw_dropout_mask(state, rate, masks[b])
    kw = {"g": 0.5, "margin": 0.1, "w": 3.0, "lr": 0.05, "wd": 0.0}
    drawn_state = np.array([77, 0, 0, 0], np.int64)
    drawn = _fused(*problem, **kw, dropout=rate, rng_state=drawn_state)
    given = _fused(*problem, **kw, masks=masks)
    for a, b in zip(drawn[:4], given[:4], strict=True):
        np.testing.assert_array_equal(a, b)
    assert drawn_state[0] == state  # d draws per sample
    # the masks are inverted dropout: 0 or 1 / (1 - rate), kept with probability 1 - rate
    big = np.zeros(200_000, np.float32)
    cf_numba.draw_dropout_mask(np.int64(3), rate, big)
    assert set(np.unique(big).tolist()) == {0.0, np.float32(1 / (1 - rate))}
    assert abs((big > 0).mean() - (1 - rate)) < 0.005
    assert abs(big.mean() - 1.0) < 0.01


@pytest.mark.parametrize("g", [1.0, 0.7])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_fused_rowwise_adagrad_step_equals_reference_optimizer(g, wd):
    seed = 7 + int(g * 10) + int(wd * 100)
    user_emb, item_emb, V, users, items, negatives, indptr, indices = _problem(seed)
    margin, w, lr = 0.1, 3.0, 0.05
    rng = np.random.default_rng(seed)
    user_sums = rng.uniform(0.0, 0.5, len(user_emb)).astype(np.float32)  # as if earlier steps had run
    item_sums = rng.uniform(0.0, 0.5, len(item_emb)).astype(np.float32)
    tu, ti, tv = (torch.tensor(a, requires_grad=True) for a in (user_emb, item_emb, V))
    opt = ref.RowWiseAdagrad([{"params": [tu, ti]}, {"params": [tv], "rowwise": False}], lr=lr, eps=1e-8)
    opt.row_sums(tu).copy_(torch.from_numpy(user_sums))
    opt.row_sums(ti).copy_(torch.from_numpy(item_sums))
    objective, _ = ref.simplex_loss(
        tu,
        ti,
        tv,
        torch.tensor(users),
        torch.tensor(items),
        torch.tensor(negatives),
        g,
        margin,
        w,
        ref.padded_history(indptr, indices),
        weight_decay=wd,
        reduction="sum",
    )
    objective.backward()
    opt.step()
    sums = (user_sums.copy(), item_sums.copy())
    ue, ie, v, _, _ = _fused(
        user_emb,
        item_emb,
        V,
        users,
        items,
        negatives,
        indptr,
        indices,
        g=g,
        margin=margin,
        w=w,
        lr=lr,
        wd=wd,
        sums=sums,
    )
    np.testing.assert_allclose(sums[0], opt.row_sums(tu).numpy(), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(sums[1], opt.row_sums(ti).numpy(), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(ue, tu.detach().numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ie, ti.detach().numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(v, tv.detach().numpy(), rtol=1e-4, atol=1e-6)
    # the accumulators of touched rows grew, the others did not, and the step differs from plain SGD
    touched = np.unique(np.concatenate([items, negatives.ravel()] + ([indices] if g < 1 else [])))
    grew = np.flatnonzero(sums[1] > item_sums)
    assert set(grew) <= set(touched) and len(grew) >= len(items)
    assert (sums[0][users] > user_sums[users]).all() and (sums[0][3:] == user_sums[3:]).all()
    ue_sgd, _, _, _, _ = _fused(
        user_emb, item_emb, V, users, items, negatives, indptr, indices, g=g, margin=margin, w=w, lr=lr, wd=wd
    )
    assert np.abs(ue_sgd - ue).max() > 1e-4


def test_rowwise_adagrad_reference_skips_untouched_rows():
    emb = torch.nn.Parameter(torch.randn(5, 3))
    before = emb.detach().clone()
    opt = ref.RowWiseAdagrad([emb], lr=0.1, initial_accumulator_value=0.25)
    emb.grad = torch.zeros(5, 3)
    emb.grad[1] = torch.tensor([3.0, 0.0, -3.0])
    opt.step()
    sums = opt.row_sums(emb)
    torch.testing.assert_close(sums, torch.tensor([0.25, 0.25 + 6.0, 0.25, 0.25, 0.25]))
    torch.testing.assert_close(emb.detach()[[0, 2, 3, 4]], before[[0, 2, 3, 4]])
    torch.testing.assert_close(emb.detach()[1], before[1] - 0.1 * torch.tensor([3.0, 0.0, -3.0]) / (6.25**0.5 + 1e-8))
    with pytest.raises(ValueError, match="lr"):
        ref.RowWiseAdagrad([emb], lr=0.0)


def test_inactive_margin_gives_no_negative_gradient():
    user_emb, item_emb, V, users, items, negatives, indptr, indices = _problem(5)
    _, ie, _, losses, _ = _fused(
        user_emb, item_emb, V, users, items, negatives, indptr, indices, g=1.0, margin=1.0, w=3.0, lr=0.1, wd=0.0
    )
    np.testing.assert_array_equal(ie[negatives.ravel()], item_emb[negatives.ravel()])
    assert not np.array_equal(ie[items], item_emb[items])
    assert (losses > 0).all()


def _sampling_run(
    tile_refresh: int, chunks: int, seed: int = 0, exclude_positive: bool = False
) -> dict[str, np.ndarray]:
    from lightning_sdp.kernels import cf_numba

    rng = np.random.default_rng(seed)
    n_users, n_items, d, B = 50, 300, 8, 400
    ue = rng.normal(size=(n_users, d)).astype(np.float32)
    ie = rng.normal(size=(n_items, d)).astype(np.float32)
    out = {"items": rng.integers(0, n_items, B), "ie_init": ie.copy()}
    users = rng.integers(0, n_users, B)
    indptr = np.zeros(n_users + 1, np.int64)
    state = np.arange(1, 5, dtype=np.int64) * 12345
    tiles = np.zeros((4, 16), np.int64)
    left = np.zeros(4, np.int64)
    losses = np.zeros(B, np.float32)
    # margin -1: every negative is active, so every sampled negative row moves
    settings = cf_numba.StepSettings(
        num_negatives=8,
        margin=-1.0,
        negative_weight=1.0,
        lr=0.01,
        v_lr=0.01,
        tile_refresh=tile_refresh,
        num_chunks=chunks,
        exclude_positive=exclude_positive,
    )
    cf_numba.fused_sgd_step(
        cf_numba.Tables(ue, ie, np.eye(d, dtype=np.float32), *_attention("mean", d, 0)),
        cf_numba.Batch(users, out["items"]),
        cf_numba.History(indptr, np.zeros(0, np.int64)),
        cf_numba.StepState(state, tiles, left, losses),
        settings,
    )
    out.update(ue=ue, ie=ie, state=state, tiles=tiles, left=left, losses=losses)
    return out


def test_in_kernel_sampling_is_deterministic_and_advances_state():
    a = _sampling_run(0, 1)
    b = _sampling_run(0, 1)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert a["state"][0] != 12345  # the used chunk's state advanced
    np.testing.assert_array_equal(a["state"][1:], np.arange(2, 5) * 12345)  # unused chunks untouched
    assert np.isfinite(a["losses"]).all() and (a["losses"] > 0).all()
    moved = np.abs(a["ie"] - a["ie_init"]).max(1) > 0
    assert moved.sum() > 250  # uniform sampling touches most of the 300 items


def test_tile_sampler_draws_from_tiles_and_refreshes():
    r = _sampling_run(tile_refresh=100, chunks=2)
    # 200 samples per chunk, a redraw every 100: drawn at samples 0 and 100, nothing left at the end
    np.testing.assert_array_equal(r["left"][:2], [0, 0])
    assert (r["tiles"][2:] == 0).all()  # chunks that did not run keep their state

    r = _sampling_run(tile_refresh=1000, chunks=2)
    np.testing.assert_array_equal(r["left"][:2], [800, 800])  # one tile per chunk, drawn once
    tiles = r["tiles"][:2]
    assert (tiles >= 0).all() and (tiles < 300).all() and len(np.unique(tiles[0])) > 4
    one = _sampling_run(tile_refresh=1000, chunks=1)  # a single thread is deterministic (two race, Hogwild)
    np.testing.assert_array_equal(one["ie"], _sampling_run(tile_refresh=1000, chunks=1)["ie"])
    # only positives and tile items can have moved, and all tile items did (every negative is active)
    moved = set(np.flatnonzero(np.abs(r["ie"] - r["ie_init"]).max(1) > 0))
    assert moved <= set(r["items"]) | set(tiles.ravel())
    assert set(tiles.ravel()) <= moved
    assert len(moved - set(r["items"])) <= tiles.size  # uniform sampling would touch ~all non-positives


def test_cap_history_keeps_a_seeded_subset():
    indptr = np.array([0, 5, 7, 7])
    indices = np.array([1, 2, 3, 4, 5, 8, 9])
    hp, hi = ref.cap_history(indptr, indices, 3, seed=1)
    np.testing.assert_array_equal(hp, [0, 3, 5, 5])
    assert set(hi[:3]) <= {1, 2, 3, 4, 5} and len(set(hi[:3])) == 3
    assert set(hi[3:5]) == {8, 9}
    hp2, hi2 = ref.cap_history(indptr, indices, 3, seed=1)
    np.testing.assert_array_equal(hi, hi2)
    pad = ref.padded_history(hp, hi)
    assert pad.shape == (3, 3) and (pad[2] == -1).all()


def test_user_vectors_exclude_the_positive():
    d = 4
    item_emb = torch.arange(12, dtype=torch.float32).reshape(3, d)
    user_emb = torch.zeros(1, d)
    hist = torch.tensor([[0, 1, 2]])
    p = ref.user_vectors(user_emb, item_emb, torch.eye(d), torch.tensor([0]), 0.0, hist, exclude=torch.tensor([2]))
    torch.testing.assert_close(p[0], item_emb[:2].mean(0))
    with pytest.raises(ValueError, match="history"):
        ref.user_vectors(user_emb, item_emb, torch.eye(d), torch.tensor([0]), 0.5)


@pytest.mark.parametrize("norm", [1.0, 2.5])
def test_numba_row_projection_equals_reference(norm):
    from lightning_sdp.kernels import cf_numba

    table = np.random.default_rng(int(norm * 10)).normal(scale=3.0, size=(37, 19)).astype(np.float32)
    table[5] = 0.0  # a row that was never touched and has no direction
    expected = torch.from_numpy(table.copy())
    ref.project_rows(expected, norm)
    cf_numba.project_rows(table, norm)
    np.testing.assert_allclose(table, expected.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(np.delete(table, 5, axis=0), axis=1), norm, rtol=1e-5)
    assert not table[5].any()
