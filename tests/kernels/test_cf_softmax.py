"""HEAT's own loss (softmax over temperature-scaled cosines) and per-sample gradient clipping: kernel vs reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_sdp.kernels import cf_reference as ref
from tests.kernels.test_cf_kernels import _fused, _problem, _reference_step

pytestmark = pytest.mark.numba

_TEMPERATURE = 0.07  # HEAT's code: logits = cos / 0.07


def _closed_form_grad_p(p: np.ndarray, pos: np.ndarray, neg: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample loss and dL/dp of the softmax loss written out by hand (float64, no autograd).

    ``L = log(1 + sum_j exp((c_j - c_i) / t))``; ``dL/dc_j = pi_j / t``, ``dL/dc_i = (pi_0 - 1) / t`` with ``pi`` the
    softmax over ``[c_i, c_j...] / t``; ``dcos(a, b)/da = b / (|a||b|) - cos a / |a|^2``.
    """
    rows = np.concatenate([pos[:, None], neg], axis=1)  # (B, 1 + n, d)
    pn = np.linalg.norm(p, axis=-1)
    rn = np.linalg.norm(rows, axis=-1)
    cos = np.einsum("bd,bkd->bk", p, rows) / (pn[:, None] * rn)
    z = cos / t
    pi = np.exp(z - z.max(1, keepdims=True))
    pi /= pi.sum(1, keepdims=True)
    loss = np.log1p(np.exp((cos[:, 1:] - cos[:, :1]) / t).sum(1))
    dcos = pi / t
    dcos[:, 0] -= 1.0 / t
    dc_dp = rows / (pn[:, None, None] * rn[..., None]) - cos[..., None] * p[:, None] / (pn[:, None, None] ** 2)
    return loss, np.einsum("bk,bkd->bd", dcos, dc_dp)


def test_softmax_cosine_loss_against_closed_form_and_finite_differences():
    gen = torch.Generator().manual_seed(0)
    p, pos, neg = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((5, 6), (5, 6), (5, 4, 6)))
    p.requires_grad_(True)
    loss = ref.softmax_cosine_loss(p, pos, neg, _TEMPERATURE, reduction="none")
    loss.sum().backward()
    expected_loss, expected_grad = _closed_form_grad_p(p.detach().numpy(), pos.numpy(), neg.numpy(), _TEMPERATURE)
    np.testing.assert_allclose(loss.detach().numpy(), expected_loss, rtol=1e-10)
    np.testing.assert_allclose(p.grad.numpy(), expected_grad, rtol=1e-8, atol=1e-10)
    # the same loss as torch's cross-entropy with the positive as class 0
    logits = torch.cat([F.cosine_similarity(p, pos, dim=-1)[:, None], F.cosine_similarity(p[:, None], neg, dim=-1)], 1)
    torch.testing.assert_close(
        loss, F.cross_entropy(logits / _TEMPERATURE, torch.zeros(5, dtype=torch.long), reduction="none")
    )
    # finite differences through every input (positive and negative rows too), with and without a dropout mask
    mask = (torch.rand(5, 6, generator=gen, dtype=torch.float64) > 0.3) / 0.7
    for dropout_mask in (None, mask):
        inputs = tuple(x.detach().clone().requires_grad_(True) for x in (p, pos, neg))
        assert torch.autograd.gradcheck(
            lambda a, b, c, m=dropout_mask: ref.softmax_cosine_loss(a, b, c, 0.5, reduction="sum", dropout_mask=m),
            inputs,
        )
    with pytest.raises(ValueError, match="temperature"):
        ref.softmax_cosine_loss(p, pos, neg, 0.0)


def _unclipped_grads(problem, **kw) -> dict[str, np.ndarray]:
    return _reference_step(problem, **kw)[1]


# CCL without clipping is tests/kernels/test_cf_kernels.py's
@pytest.mark.parametrize(("loss", "grad_clip"), [("softmax", None), ("softmax", 0.05), ("ccl", 0.05)])
@pytest.mark.parametrize("g", [1.0, 0.7])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_fused_step_equals_reference_sgd_step(loss, grad_clip, g, wd):
    seed = 300 + int(g * 10) + int(wd * 100) + (grad_clip is not None) + 7 * (loss == "ccl")
    problem = _problem(seed)
    user_emb, item_emb, V, users, items, negatives, indptr, indices = problem
    margin, w, lr, vwd = 0.1, 3.0, 0.05, 5 * wd
    options = {"loss": loss, "temperature": _TEMPERATURE, "grad_clip": grad_clip}
    kw = {"g": g, "margin": margin, "w": w, "wd": wd, "vwd": vwd}
    per_sample, grads = _reference_step(problem, **kw, **options)
    from lightning_sdp.kernels import cf_numba

    kernel_options = {"loss": cf_numba.LOSSES[loss], "temperature": _TEMPERATURE, "grad_clip": grad_clip or 0.0}
    ue, ie, v, losses, _ = _fused(*problem, **kw, lr=lr, **kernel_options)
    np.testing.assert_allclose(losses, per_sample, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ue, user_emb - lr * grads["user"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ie, item_emb - lr * grads["item"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v, V - lr * grads["V"], rtol=1e-5, atol=1e-6)
    if loss == "softmax":  # no margin: every negative row has a gradient (if tiny at t = 0.07)
        assert (np.abs(grads["item"][negatives.ravel()]).max(1) > 0).all()
    if grad_clip is None:
        return
    # clipping was active: some per-sample gradient coordinates of the user, positive, negative (and history) rows
    # exceeded the bound, the clipped step differs from the unclipped one, and no row moved more than lr * bound
    raw = _unclipped_grads(problem, **kw, loss=loss, temperature=_TEMPERATURE)
    touched = {"user": users, "positive": items, "negative": negatives.ravel()}
    if g < 1:
        touched["history"] = np.array([40, 41, 42, 43, 44, 45, 46])
    for name, rows in touched.items():
        table = "user" if name == "user" else "item"
        assert (np.abs(raw[table][rows]) > grad_clip).any(), name
    assert np.abs(raw["item"] - grads["item"]).max() > 1e-3
    assert np.abs(ie - item_emb).max() <= lr * grad_clip + 1e-6  # + the rounding of e - step on |e| ~ 1
    assert np.abs(ue - user_emb).max() <= lr * grad_clip + 1e-6


def test_fused_softmax_with_dropout_and_rowwise_adagrad_equals_reference():
    """The softmax loss and clipping also compose with a given dropout mask and row-wise Adagrad."""
    from lightning_sdp.kernels import cf_numba

    problem = _problem(41)
    user_emb, item_emb, V, users, items, negatives, indptr, indices = problem
    rng = np.random.default_rng(41)
    masks = ((rng.random((len(users), user_emb.shape[1])) >= 0.3) / np.float32(0.7)).astype(np.float32)
    user_sums = rng.uniform(0.0, 0.5, len(user_emb)).astype(np.float32)
    item_sums = rng.uniform(0.0, 0.5, len(item_emb)).astype(np.float32)
    g, lr, wd, clip = 0.7, 0.05, 0.01, 0.05
    tu, ti, tv = (torch.tensor(a, requires_grad=True) for a in (user_emb, item_emb, V))
    opt = ref.RowWiseAdagrad([{"params": [tu, ti]}, {"params": [tv], "rowwise": False}], lr=lr, eps=1e-8)
    opt.row_sums(tu).copy_(torch.from_numpy(user_sums))
    opt.row_sums(ti).copy_(torch.from_numpy(item_sums))
    objective, per_sample = ref.simplex_loss(
        tu,
        ti,
        tv,
        torch.tensor(users),
        torch.tensor(items),
        torch.tensor(negatives),
        g,
        0.1,
        3.0,
        ref.padded_history(indptr, indices),
        weight_decay=wd,
        reduction="sum",
        dropout_mask=torch.from_numpy(masks),
        loss="softmax",
        temperature=_TEMPERATURE,
        grad_clip=clip,
    )
    objective.backward()
    assert (ti.grad.abs() == clip).any()  # some coordinates were clipped
    opt.step()
    sums = (user_sums.copy(), item_sums.copy())
    ue, ie, v, losses, _ = _fused(
        *problem,
        g=g,
        margin=0.1,
        w=3.0,
        lr=lr,
        wd=wd,
        sums=sums,
        masks=masks,
        loss=cf_numba.LOSS_SOFTMAX,
        temperature=_TEMPERATURE,
        grad_clip=clip,
    )
    np.testing.assert_allclose(losses, per_sample.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sums[0], opt.row_sums(tu).numpy(), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(sums[1], opt.row_sums(ti).numpy(), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(ue, tu.detach().numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ie, ti.detach().numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(v, tv.detach().numpy(), rtol=1e-4, atol=1e-6)


def test_fused_softmax_one_thread_is_deterministic_and_two_threads_agree_on_disjoint_rows():
    from lightning_sdp.kernels import cf_numba

    problem = _problem(51)
    kw = {"g": 1.0, "margin": 0.1, "w": 3.0, "lr": 0.05, "wd": 0.0}
    options = {"loss": cf_numba.LOSS_SOFTMAX, "temperature": _TEMPERATURE, "grad_clip": 0.1}
    first = _fused(*problem, **kw, **options)
    again = _fused(*problem, **kw, **options)
    two = _fused(*problem, **kw, chunks=2, **options)
    for a, b, c in zip(first[:4], again[:4], two[:4], strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-6)


def test_kernel_rejects_bad_loss_options():
    from lightning_sdp.kernels import cf_numba

    problem = _problem(61)
    kw = {"g": 1.0, "margin": 0.1, "w": 3.0, "lr": 0.05, "wd": 0.0}
    with pytest.raises(ValueError, match="temperature"):
        _fused(*problem, **kw, loss=cf_numba.LOSS_SOFTMAX, temperature=0.0)
    with pytest.raises(ValueError, match="loss"):
        _fused(*problem, **kw, loss=7)
    with pytest.raises(ValueError, match="mean aggregator"):
        from tests.kernels.test_cf_kernels import _attention

        att = _attention("user_attention", problem[0].shape[1], 0)
        _fused(*problem, **{**kw, "g": 0.5}, aggregator="user_attention", att=att, grad_clip=0.1)


def test_reference_mean_reduction_clips_each_sample_before_averaging():
    problem = _problem(71)
    kw = {"g": 0.7, "margin": 0.1, "w": 3.0, "wd": 0.0, "loss": "softmax", "temperature": _TEMPERATURE}
    _, summed = _reference_step(problem, **kw, grad_clip=0.05)
    user_emb, item_emb, V, users, items, negatives, indptr, indices = problem
    tensors = [torch.tensor(a, requires_grad=True) for a in (user_emb, item_emb, V)]
    objective, _ = ref.simplex_loss(
        *tensors,
        torch.tensor(users),
        torch.tensor(items),
        torch.tensor(negatives),
        0.7,
        0.1,
        3.0,
        ref.padded_history(indptr, indices),
        reduction="mean",
        loss="softmax",
        temperature=_TEMPERATURE,
        grad_clip=0.05,
    )
    objective.backward()
    for t, name in zip(tensors, ("user", "item", "V"), strict=True):
        np.testing.assert_allclose(t.grad.numpy(), summed[name] / len(users), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="mean aggregator"):
        ref.simplex_loss(
            *tensors,
            torch.tensor(users),
            torch.tensor(items),
            torch.tensor(negatives),
            0.7,
            0.1,
            3.0,
            ref.padded_history(indptr, indices),
            aggregator="user_attention",
            grad_clip=0.1,
        )


# ---------------------------------------------------------------------------------------------- through SimpleXModule
def _disjoint_batch(model, num_negatives: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three positives whose users, histories, positives and negatives share no row (per-sample SGD == batch SGD)."""
    indptr, indices = model.histories().indptr, model.histories().indices
    users: list[int] = []
    items: list[int] = []
    used: set[int] = set()
    for u in range(model.num_users):
        h = set(indices[indptr[u] : indptr[u + 1]].tolist())
        if len(h) > 1 and not h & used and len(users) < 3:
            users.append(u)
            items.append(sorted(h)[0])
            used |= h
    free = [i for i in range(model.num_items) if i not in used]
    negatives = torch.tensor(free[: 3 * num_negatives]).reshape(3, num_negatives)
    return torch.tensor(users), torch.tensor(items), negatives


@pytest.mark.parametrize("g", [1.0, 0.8])
def test_module_fused_step_equals_reference_step_with_softmax_and_clipping(g):
    from lightning_sdp.datamodules.interactions import InteractionsDataModule
    from lightning_sdp.models.simplex import SimpleXModule

    dm = InteractionsDataModule(num_users=120, num_items=80, batch_size=256, eval_batch_size=64, seed=0)
    dm.setup()
    model = SimpleXModule(
        dm.num_users,
        dm.num_items,
        dim=16,
        g=g,
        num_negatives=8,
        max_history=20,
        weight_decay=1e-3,
        loss="softmax",
        temperature=_TEMPERATURE,
        grad_clip=0.05,
        init_std=0.3,
    )
    model.set_interactions(*dm.train_csr)
    users, items, negatives = _disjoint_batch(model, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    objective, per_sample = model.reference_loss(users, items, negatives, reduction="sum")
    objective.backward()
    lr = 0.1
    losses = model.fused_step(users, items, lr, negatives=negatives, num_threads=1)
    torch.testing.assert_close(losses, per_sample.detach(), rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(p.detach(), before[name] - lr * grad, rtol=1e-5, atol=1e-6, msg=name)
    assert (model.item_embedding.weight.grad.abs() == 0.05).any()  # clipping was active


def test_config_validates_the_loss_options():
    from lightning_sdp.models.simplex import SimpleXConfig, SimpleXModule

    assert SimpleXConfig().loss == "auto" and SimpleXConfig().grad_clip == "auto"  # chosen from the data
    assert SimpleXConfig().loss_name == "ccl" and SimpleXConfig().grad_clip_value is None  # before any data
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        SimpleXModule(loss="softmax", temperature=0.0)
    with pytest.raises(ValueError, match="grad_clip must be positive"):
        SimpleXModule(grad_clip=-0.1)
    with pytest.raises(ValueError, match="loss must be one of 'ccl', 'softmax', 'auto', got 'bpr'"):
        SimpleXModule(loss="bpr")
    with pytest.raises(ValueError, match="grad_clip must be 'auto', a number or None, got '0.1'"):
        SimpleXModule(grad_clip="0.1")
    with pytest.raises(TypeError, match="grad_clip must be 'auto', a number or None, got True"):
        SimpleXModule(grad_clip=True)  # type: ignore[arg-type]  # a flag is not a threshold
    with pytest.raises(ValueError, match="grad_clip must be 'auto', a number or None, got '0.1'"):
        SimpleXModule(g=0.8, aggregator="user_attention", grad_clip="0.1")  # the type first, not the aggregator
    with pytest.raises(ValueError, match="grad_clip.*aggregator='mean'"):
        SimpleXModule(g=0.8, aggregator="user_attention", grad_clip=0.1)
    SimpleXModule(g=1.0, aggregator="user_attention", grad_clip=0.1)  # MF: no aggregator, nothing to refuse
    SimpleXModule(backend="reference", loss="softmax", grad_clip=0.1)  # the reference clips per sample too


def test_trains_with_heat_accelerator_and_beats_a_random_model(tmp_path):
    from lightning.pytorch import Trainer

    from lightning_sdp.datamodules.interactions import InteractionsDataModule
    from lightning_sdp.models.simplex import SimpleXModule
    from lightning_sdp.plugins.heat import HEATAccelerator

    dm = InteractionsDataModule(num_users=200, num_items=100, batch_size=256, eval_batch_size=64, seed=0)
    # clipped steps move a coordinate by at most lr * grad_clip = 0.3: one epoch of ~2,900 positives is enough
    model = SimpleXModule(loss="softmax", temperature=0.07, grad_clip=0.1, lr=3.0, num_negatives=16)
    trainer = Trainer(
        accelerator=HEATAccelerator(num_threads=1),
        devices=1,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    untrained = trainer.validate(model, dm, verbose=False)[0]["val/recall@20"]
    trainer.fit(model, dm)
    after = trainer.callback_metrics["val/recall@20"].item()
    assert np.isfinite(trainer.callback_metrics["train/loss"].item())
    # a random ranking finds each validation item in the top 20 with probability 20 / (items not known for the user)
    known = np.diff(dm.train_csr[0])
    has_val = np.diff(dm.val_csr[0]) > 0
    random_recall = float(np.mean(20 / (dm.num_items - known[has_val])))
    assert after > max(untrained, random_recall) + 0.05, (untrained, random_recall, after)
