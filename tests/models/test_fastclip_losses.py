"""FastCLIP losses: reference vs implementation, the ClipLoss anchor, estimators, temperatures, bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_sdp.models.fastclip.losses import (
    VARIANTS,
    GlobalContrastiveLoss,
    build_loss,
    reference_global_contrastive_loss,
)


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: on two shared cores OpenMP spin-waiting makes two threads several times slower."""
    torch.set_num_threads(1)


def _features(n: int = 8, d: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    e1 = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    e2 = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    return e1.requires_grad_(), e2.requires_grad_()


def _double(loss: GlobalContrastiveLoss) -> GlobalContrastiveLoss:
    return loss.double()


@pytest.mark.open_clip
def test_gamma_one_eps_matches_open_clip_clip_loss_gradient():
    import open_clip

    n, tau = 8, 0.1
    e1, e2 = _features(n)
    loss = _double(GlobalContrastiveLoss(20, objective="gcl", temperature="constant", gamma=1.0, eps=1 / (n - 1)))
    out = loss(e1, e2, torch.arange(3, 3 + n), math.log(1 / tau))
    ga, gb = torch.autograd.grad(out.loss, (e1, e2))
    f1, f2 = e1.detach().clone().requires_grad_(), e2.detach().clone().requires_grad_()
    ref = open_clip.ClipLoss()(f1, f2, torch.tensor(1 / tau, dtype=torch.float64))
    ra, rb = torch.autograd.grad(ref, (f1, f2))
    torch.testing.assert_close(ga, ra, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gb, rb, rtol=1e-9, atol=1e-12)
    # the losses differ by a constant: ClipLoss = mean log(1 + (n-1) g) = tau^-1 GCL/2 + log(n - 1) at eps = 1/(n-1)
    assert float(out.value) / tau / 2 + math.log(n - 1) == pytest.approx(float(ref.detach()), rel=1e-9)


@pytest.mark.parametrize("objective", ["gcl", "rgcl_g"])
@pytest.mark.parametrize("gamma", [1.0, 0.3])
def test_matches_plain_reference_over_two_steps(objective, gamma):
    n = 6
    temperature = "learnable"
    loss = _double(
        GlobalContrastiveLoss(
            10, objective=objective, temperature=temperature, gamma=gamma, rho=2.0, temperature_gradient="exact"
        )
    )
    idx = torch.tensor([9, 0, 4, 2, 7, 5])
    u1 = torch.zeros(n, dtype=torch.float64)
    u2 = torch.zeros(n, dtype=torch.float64)
    for step in range(2):
        e1, e2 = _features(n, seed=step)
        ls = torch.tensor(math.log(1 / 0.2), dtype=torch.float64, requires_grad=True)
        out = loss(e1, e2, idx, ls)
        grads = torch.autograd.grad(out.loss, (e1, e2, ls))
        f1, f2 = e1.detach().clone().requires_grad_(), e2.detach().clone().requires_grad_()
        ls_ref = ls.detach().clone().requires_grad_()
        ref, u1, u2 = reference_global_contrastive_loss(f1, f2, u1, u2, gamma, ls_ref, objective=objective, rho=2.0)
        rgrads = torch.autograd.grad(ref, (f1, f2, ls_ref))
        for a, b in zip(grads, rgrads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(loss.u1[idx], u1)
        torch.testing.assert_close(loss.u2[idx], u2)
    # untouched samples keep u = 0
    assert float(loss.u1[[1, 3, 6, 8]].abs().sum()) == 0.0


def test_first_visit_sets_u_to_g_then_moving_average():
    loss = _double(GlobalContrastiveLoss(12, objective="gcl", temperature="constant", gamma=0.25))
    e1, e2 = _features(4)
    idx = torch.tensor([1, 5, 6, 11])
    out = loss(e1, e2, idx, math.log(10.0))
    torch.testing.assert_close(loss.u1[idx], out.g1)
    torch.testing.assert_close(loss.u2[idx], out.g2)
    e1b, e2b = _features(4, seed=3)
    out2 = loss(e1b, e2b, idx, math.log(10.0))
    torch.testing.assert_close(loss.u1[idx], 0.75 * out.g1 + 0.25 * out2.g1)
    # a new sample in the batch is a first visit again
    out3 = loss(e1b, e2b, torch.tensor([1, 5, 6, 0]), math.log(10.0))
    assert float(loss.u1[0]) == pytest.approx(float(out3.g1[3]))


def _opposed_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """Two float32 pairs whose positives are nearly opposite and whose negatives nearly agree: at tau = 0.01 the
    scaled logit difference (and so v2's running bound) jumps from 0 to about 140."""
    a = torch.tensor([1.0, 0.0, 0.0])
    b = torch.tensor([0.0, 1.0, 0.0])
    e1 = torch.stack([a, b])
    e2 = F.normalize(torch.stack([b - 0.95 * a, a - 0.95 * b]), dim=1)
    return e1, e2


@pytest.mark.parametrize("gamma", [0.5, 1.0])
def test_v2_estimator_reset_tests_the_stored_u_before_rescaling(gamma):
    """The official rule (``Optimization-AI/fast_clip``, ``FastCLIPLossIndividual.forward``): with gamma < 1, a stored
    u below 1e-35 (or not finite) is replaced by g; the test is made on the stored u, *before* it is rescaled to the new
    bound, so a stored estimate that the rescaling sends to 0 (a bound jump above ~104 in float32) is averaged,
    ``u = (1 - gamma) * 0 + gamma * g``, not reset to ``g``."""
    loss = GlobalContrastiveLoss(4, objective="rgcl", temperature="individual", gamma=gamma)
    loss.tau1.fill_(0.01)
    loss.tau2.fill_(0.01)
    loss.u1.fill_(1.0)
    loss.u2.fill_(1.0)
    e1, e2 = _opposed_pairs()
    idx = torch.tensor([0, 1])
    out = loss(e1, e2, idx, None)
    assert float(loss.bound1[idx].min()) > 120  # the bound jumped: exp(-jump) underflows in float32
    assert float(torch.exp(-loss.bound1[idx]).max()) == 0.0
    expected = gamma * out.g1 if gamma < 1 else out.g1
    assert torch.equal(loss.u1[idx], expected)


def test_estimator_reset_below_1e_35_only_when_gamma_below_one():
    """A stored u in (0, 1e-35) is a reset (``u = g``) in the official code when gamma < 1, not a moving average."""
    loss = GlobalContrastiveLoss(8, objective="gcl", temperature="constant", gamma=0.25)
    loss.u1.fill_(1e-36)
    loss.u2.fill_(2e-35)  # above the threshold: averaged
    e1, e2 = (t.detach().float() for t in _features(4))
    idx = torch.tensor([0, 2, 4, 6])
    out = loss(e1, e2, idx, math.log(10.0))
    assert torch.equal(loss.u1[idx], out.g1)
    torch.testing.assert_close(loss.u2[idx], 0.75 * torch.tensor(2e-35) + 0.25 * out.g2)


def test_v3_tau_gradient_is_rgcl_g_gradient_when_u_equals_g():
    """With gamma = 1 (u = g) the logit_scale gradient equals autograd of the rgcl_g objective.

    The objective is tau*mean[log(eps+g1)+log(eps+g2)]/2 + rho tau.
    """
    e1, e2 = _features(6)
    loss = _double(
        GlobalContrastiveLoss(
            6, objective="rgcl_g", temperature="learnable", gamma=1.0, rho=3.0, temperature_gradient="exact"
        )
    )
    ls = torch.tensor(math.log(1 / 0.3), dtype=torch.float64, requires_grad=True)
    out = loss(e1, e2, torch.arange(6), ls)
    (g_ls,) = torch.autograd.grad(out.loss, (ls,))
    ls2 = ls.detach().clone().requires_grad_()
    tau = 1 / ls2.exp()
    sims = e1.detach() @ e2.detach().T
    pos = sims.diag()
    off = ~torch.eye(6, dtype=torch.bool)
    g1 = (torch.exp((sims - pos[:, None]) / tau) * off).sum(1) / 5
    g2 = (torch.exp((sims.T - pos[:, None]) / tau) * off).sum(1) / 5
    rgclg = tau * (torch.log(1e-14 + g1) + torch.log(1e-14 + g2)).mean() / 2 + 3.0 * tau
    (r_ls,) = torch.autograd.grad(rgclg, (ls2,))
    torch.testing.assert_close(g_ls, r_ls, rtol=1e-8, atol=1e-12)
    assert float(out.value) == pytest.approx(2 * float(rgclg), rel=1e-9)


def test_individual_temperatures_stay_in_bounds_and_are_state():
    torch.manual_seed(0)
    loss = GlobalContrastiveLoss(32, objective="rgcl", temperature="individual", lr_tau=0.5, rho=7.0)
    for _step in range(6):
        e1 = F.normalize(torch.randn(8, 5), dim=1).requires_grad_()
        e2 = F.normalize(e1.detach() + 0.3 * torch.randn(8, 5), dim=1).requires_grad_()
        idx = torch.randperm(32)[:8]
        out = loss(e1, e2, idx, None)
        out.loss.backward()
        assert torch.isfinite(out.loss)
        assert torch.isfinite(e1.grad).all()
    for name in ("tau1", "tau2"):
        t = getattr(loss, name)
        assert float(t.min()) >= 0.01 - 1e-7 and float(t.max()) <= 1.0 + 1e-7
    assert int(loss.tau_steps.max()) >= 1
    assert not torch.allclose(loss.tau1, torch.full_like(loss.tau1, 0.03))  # the update moved them
    assert {"tau1", "tau2", "bound1", "bound2", "m1", "v1", "tau_steps", "u1", "u2"} <= set(loss.state_dict())


def test_individual_bound_shift_keeps_gradient_of_unshifted_loss():
    """The running bound only rescales g and u together: gradients equal those computed without a bound."""
    e1, e2 = _features(5)
    loss = _double(
        GlobalContrastiveLoss(
            5, objective="rgcl", temperature="individual", gamma=1.0, eps=0.0, temperature_gradient="exact"
        )
    )
    loss.tau1.fill_(0.05)
    loss.tau2.fill_(0.1)
    out = loss(e1, e2, torch.arange(5), None)
    ga = torch.autograd.grad(out.loss, (e1,))[0]
    assert float(loss.bound1.max()) > 0  # a bound was set
    sims = e1.detach() @ e2.detach().T
    f1 = e1.detach().clone().requires_grad_()
    sims = f1 @ e2.detach().T
    pos = (f1 * e2.detach()).sum(1)
    off = ~torch.eye(5, dtype=torch.bool)
    g1 = (torch.exp((sims - pos[:, None]) / 0.05) * off).sum(1) / 4
    g2 = (torch.exp((f1 @ e2.detach().T).T.sub(pos[:, None]) / 0.1) * off).sum(1) / 4
    ref = (0.05 * g1 / g1.detach() + 0.1 * g2 / g2.detach()).sum() / 10
    (gr,) = torch.autograd.grad(ref, (f1,))
    torch.testing.assert_close(ga, gr, rtol=1e-8, atol=1e-10)


def test_bad_input_errors():
    loss = GlobalContrastiveLoss(10, objective="gcl", temperature="constant")
    e1, e2 = _features(4)
    with pytest.raises(IndexError, match="data_size"):
        loss(e1.float(), e2.float(), torch.tensor([0, 1, 2, 10]), 1.0)
    with pytest.raises(ValueError, match="appears twice"):
        loss(e1.float(), e2.float(), torch.tensor([0, 1, 1, 3]), 1.0)
    with pytest.raises(ValueError, match="shape"):
        loss(e1.float(), e2.float()[:3], torch.tensor([0, 1, 2, 3]), 1.0)
    with pytest.raises(ValueError, match="indices"):
        loss(e1.float(), e2.float(), torch.tensor([0, 1, 2]), 1.0)
    with pytest.raises(ValueError, match="Unknown FastCLIP loss"):
        build_loss("fastclip_v9", 10)
    with pytest.raises(ValueError, match="data_size"):
        build_loss("fastclip_v3", None)
    with pytest.raises(ValueError, match="gamma"):
        loss.gamma = 0.0


def test_one_pair_batch_error_names_drop_last():
    loss = GlobalContrastiveLoss(10, objective="gcl", temperature="constant")
    e1, e2 = _features(1)
    with pytest.raises(ValueError, match=r"(?s)at least 2 pairs \(it holds 1.*drop_last=True"):
        loss(e1.float(), e2.float(), torch.tensor([3]), 1.0)


def test_variant_table_matches_spec():
    assert VARIANTS["fastclip_v3"].objective == "rgcl_g" and VARIANTS["fastclip_v3"].temperature == "learnable"
    assert VARIANTS["sogclr"].gamma_schedule == "constant" and VARIANTS["fastclip_v1"].gamma_schedule == "cosine"
    assert VARIANTS["fastclip_v2"].temperature == VARIANTS["isogclr"].temperature == "individual"
    assert VARIANTS["openclip"].objective == "mbcl"
    for name in VARIANTS:
        assert build_loss(name, 16) is not None
