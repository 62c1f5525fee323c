"""FastCLIP contrastive losses as plain ``torch.nn.Module`` s (usable without Lightning).

Paper: Wei et al., "FastCLIP: A Suite of Optimization Techniques to Accelerate CLIP Training with Limited
Resources", arXiv 2407.01445. Notation (see ``docs/fastclip.md``): ``e1_i``/``e2_i`` are the L2-normalised image and
text embeddings of pair ``i``, ``B`` the global batch (``n`` pairs over ``K`` ranks), ``tau`` the temperature and

    g1_i = mean_{j in B, j != i} exp((e1_i . e2_j - e1_i . e2_i) / tau1_i)    (image anchor, text negatives)
    g2_i = mean_{j in B, j != i} exp((e1_j . e2_i - e1_i . e2_i) / tau2_i)    (text anchor, image negatives)

The global contrastive loss (GCL) ``tau * mean_i [log(eps + g1_i) + log(eps + g2_i)]`` is optimised with per-sample
moving-average estimators ``u1, u2`` (one entry per training sample, addressed by dataset index):
``u <- (1 - gamma) u + gamma g`` (``u = g`` on a sample's first visit) and the model gradient
``mean_i [grad g1_i / (u1_i + eps) + grad g2_i / (u2_i + eps)] / 2`` (times ``tau`` for RGCL-g / v3, times
``tau_i`` for RGCL / v2). :data:`VARIANTS` lists the variants.

:class:`GlobalContrastiveLoss` implements the paper's distributed reduction (features, estimator values and indices
all-gathered without autograd; each rank computes its anchors' terms and the terms in which its samples are the
negatives of other ranks' anchors), so the parameter gradient after data parallelism's all-reduce equals the
full-global-batch gradient. :func:`reference_global_contrastive_loss` is a plain full-batch transcription of the
*exact* gradient; the tests also compare every variant, over several epochs, with an independent transcription of the
official code (``Optimization-AI/fast_clip`` at the commit pinned in ``tests/models/test_fastclip_reference.py``,
``src/fast_clip/loss.py`` and ``src/training/train.py``), which is the default (``temperature_gradient="reference"``).

:class:`SigLIPLoss` wraps ``open_clip``'s sigmoid loss (Zhai et al., arXiv 2303.15343), the loss users pick for small
batches today, as a peer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sdp.models.fastclip.distributed import all_gather_no_grad, check_equal_batch_sizes, world

Objective = Literal["mbcl", "sigmoid", "gcl", "rgcl", "rgcl_g"]
TemperatureMode = Literal["learnable", "constant", "individual"]
TemperatureGradient = Literal["reference", "exact"]

# The one source of the defaults (the module, ``build_loss`` and the loss classes read them from here).
DEFAULT_EPS = 1e-14
"""``eps`` in ``log(eps + g)`` and ``1 / (u + eps)`` (the official code's default)."""
DEFAULT_RHO: dict[str, float] = {"rgcl": 7.0, "rgcl_g": 6.5}
"""KL radius: RGCL (v2, iSogCLR; paper script 7.0) and RGCL-g (v3; 6.5 for CC3M, 8.5 CC12M, 16 LAION)."""
DEFAULT_TEMPERATURE: dict[str, float] = {"learnable": 0.07, "constant": 0.07, "individual": 0.03, "sigmoid": 0.1}
"""Initial temperature: global 0.07 (CLIP), individual 0.03 (v2 paper script), SigLIP 0.1 (``log 10`` scale)."""
DEFAULT_LR_TAU_INDIVIDUAL = 0.0133
"""Step size of the individual temperatures' Adam-like update (v2 paper script)."""
DEFAULT_SIGLIP_BIAS = -10.0
"""SigLIP's initial logit bias (paper and open_clip)."""


@dataclass(frozen=True)
class Variant:
    """One row of the FastCLIP variant table.

    Attributes:
        objective: ``mbcl`` (OpenCLIP's mini-batch loss), ``sigmoid`` (SigLIP), ``gcl``, ``rgcl`` (individual
            temperatures) or ``rgcl_g`` (global learnable temperature, loss multiplied by tau).
        gamma_schedule: ``cosine`` or ``constant`` inner learning rate (``None`` without estimators).
        temperature: ``learnable`` (global, by autograd), ``constant`` or ``individual`` (per sample and side).
    """

    objective: Objective
    gamma_schedule: Literal["cosine", "constant"] | None
    temperature: TemperatureMode

    @property
    def temperature_init(self) -> float:
        """Default initial temperature (from :data:`DEFAULT_TEMPERATURE`)."""
        key = "sigmoid" if self.objective == "sigmoid" else self.temperature
        return DEFAULT_TEMPERATURE[key]

    @property
    def rho(self) -> float:
        """Default KL radius (from :data:`DEFAULT_RHO`; 0 for the objectives without one)."""
        return DEFAULT_RHO.get(self.objective, 0.0)


VARIANTS: dict[str, Variant] = {
    "openclip": Variant("mbcl", None, "learnable"),
    "siglip": Variant("sigmoid", None, "learnable"),
    "sogclr": Variant("gcl", "constant", "constant"),
    "isogclr": Variant("rgcl", "constant", "individual"),
    "fastclip_v0": Variant("gcl", "cosine", "learnable"),
    "fastclip_v1": Variant("gcl", "cosine", "constant"),
    "fastclip_v2": Variant("rgcl", "cosine", "individual"),
    "fastclip_v3": Variant("rgcl_g", "cosine", "learnable"),
}


def get_variant(name: str) -> Variant:
    """Look a variant up by name, with an error listing the known ones."""
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"Unknown FastCLIP loss {name!r}; choose one of {sorted(VARIANTS)}.") from None


@dataclass
class LossOutput:
    """What a loss returns.

    Attributes:
        loss: differentiable scalar to call ``backward`` on (its gradient is the algorithm's gradient; for the
            compositional losses it is a surrogate whose *value* is not the objective).
        value: detached objective value over this rank's anchors (for logging).
        g1: detached ``g1`` of this rank's anchors (``None`` for ``openclip``).
        g2: detached ``g2`` of this rank's anchors.
    """

    loss: Tensor
    value: Tensor
    g1: Tensor | None = None
    g2: Tensor | None = None


def _check_inputs(image_features: Tensor, text_features: Tensor, indices: Tensor | None, data_size: int | None) -> None:
    if image_features.dim() != 2 or image_features.shape != text_features.shape:
        raise ValueError(
            "image_features and text_features must both have shape (batch, dim), got "
            f"{tuple(image_features.shape)} and {tuple(text_features.shape)}."
        )
    if indices is None:
        return
    if indices.dim() != 1 or indices.shape[0] != image_features.shape[0]:
        raise ValueError(
            f"indices must have shape (batch,) = ({image_features.shape[0]},), got {tuple(indices.shape)}. The data "
            "pipeline must return each sample's dataset index (ImageTextDataModule does)."
        )
    if indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise TypeError(f"indices must be an integer tensor, got {indices.dtype}.")
    if data_size is not None and indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= data_size):
        raise IndexError(
            f"Dataset index out of range: got indices in [{int(indices.min())}, {int(indices.max())}] but data_size "
            f"is {data_size}. Set data_size to the length of the training set (len(train_set))."
        )


def _open_clip_loss(owner: Any, feature: str, build: Callable[[int, int], nn.Module]) -> nn.Module:
    """``owner``'s open_clip loss object for the current (rank, world size), built once per world.

    open_clip's losses bake the rank and world size in at construction, so they are rebuilt when those change.
    """
    from lightning_sdp._imports import require

    require("open_clip", feature=feature)
    key = world(owner.group)
    if owner._loss is None or owner._world != key:
        owner._loss, owner._world = build(*key), key
    return owner._loss


class OpenCLIPLoss(nn.Module):
    """OpenCLIP's mini-batch contrastive loss (MBCL) through ``open_clip.ClipLoss``.

    Uses ``local_loss=True, gather_with_grad=True`` when distributed (the OpenCLIP recipe: features gathered with an
    autograd-aware all-gather whose backward is a feature-gradient collective), so the gradient after data-parallel
    averaging equals the full-global-batch gradient.

    Args:
        group: process group (default: the world).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self._loss: nn.Module | None = None
        self._world: tuple[int, int] | None = None

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        indices: Tensor | None = None,
        logit_scale: Tensor | None = None,
    ) -> LossOutput:
        """Compute the loss.

        Args:
            image_features: ``(b, d)`` L2-normalised image embeddings (with autograd).
            text_features: ``(b, d)`` L2-normalised text embeddings.
            indices: unused (accepted for a uniform interface).
            logit_scale: ``log(1 / tau)`` (a tensor, learnable or not).
        """
        _check_inputs(image_features, text_features, None, None)
        if logit_scale is None:
            raise ValueError("OpenCLIPLoss needs logit_scale = log(1 / temperature).")

        def build(rank: int, size: int) -> nn.Module:
            import open_clip

            return open_clip.ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=size)

        loss = _open_clip_loss(self, "the openclip loss", build)(image_features, text_features, logit_scale.exp())
        return LossOutput(loss=loss, value=loss.detach())


class SigLIPLoss(nn.Module):
    """SigLIP's pairwise sigmoid loss (Zhai et al., arXiv 2303.15343) through ``open_clip.loss.SigLipLoss``.

    Every image-text pair of the global batch is a binary classification (positive on the diagonal), with a learnable
    temperature (``logit_scale``) and a learnable logit bias. Distributed, open_clip exchanges text features between
    neighbouring ranks with autograd, so the gradient after data-parallel averaging is the full-global-batch one.

    Args:
        group: process group (default: the world).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self._loss: nn.Module | None = None
        self._world: tuple[int, int] | None = None

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        indices: Tensor | None = None,
        logit_scale: Tensor | None = None,
        logit_bias: Tensor | None = None,
    ) -> LossOutput:
        """Compute the loss.

        Args:
            image_features: ``(b, d)`` L2-normalised image embeddings (with autograd).
            text_features: ``(b, d)`` L2-normalised text embeddings.
            indices: unused (accepted for a uniform interface).
            logit_scale: ``log(1 / tau)`` (a tensor, learnable or not).
            logit_bias: the learnable logit bias (a scalar tensor).
        """
        _check_inputs(image_features, text_features, None, None)
        if logit_scale is None or logit_bias is None:
            raise ValueError(
                "SigLIPLoss needs logit_scale = log(1 / temperature) and logit_bias (FastCLIPModule has both)."
            )

        def build(rank: int, size: int) -> nn.Module:
            from open_clip.loss import SigLipLoss

            return SigLipLoss(rank=rank, world_size=size)

        loss = _open_clip_loss(self, "the siglip loss", build)(
            image_features, text_features, logit_scale.exp(), logit_bias
        )
        return LossOutput(loss=loss, value=loss.detach())


class GlobalContrastiveLoss(nn.Module):
    """GCL / RGCL / RGCL-g with per-sample estimators and FastCLIP's distributed gradient reduction.

    State (registered buffers, so it is in ``state_dict`` and checkpoints, identical on every rank): ``u1, u2``
    (length ``data_size``); for individual temperatures also ``tau1, tau2``, the running log-sum-exp bounds
    ``bound1, bound2``, the Adam moments ``m1, m2, v1, v2`` and the per-sample visit count ``tau_steps``. The
    official temperature update also reads the current epoch, :attr:`epoch` (a plain attribute, 0 until set: the
    FastCLIP module and ``GammaScheduler`` set it at every epoch start; set it yourself when you drive the loss
    without them).

    Args:
        data_size: number of training samples (indices must lie in ``[0, data_size)``).
        objective: ``gcl`` (SogCLR, v0, v1), ``rgcl`` (iSogCLR, v2) or ``rgcl_g`` (v3).
        temperature: ``learnable`` (global ``logit_scale`` trained by autograd), ``constant`` or ``individual``
            (per sample and side, updated inside the loss; required for and only allowed with ``rgcl``).
        gamma: inner learning rate of the estimator update (set each epoch by ``GammaScheduler``). Default 1.
        eps: ``eps`` in ``log(eps + g)`` and ``1 / (u + eps)``. Default :data:`DEFAULT_EPS` (1e-14).
        rho: KL radius of the robust losses; ``None`` takes :data:`DEFAULT_RHO` (7.0 for ``rgcl``, 6.5 for ``rgcl_g``).
        tau_init: initial individual temperature; ``None`` takes :data:`DEFAULT_TEMPERATURE` (0.03).
        lr_tau: step size of the individual temperatures' Adam-like update; ``None`` takes
            :data:`DEFAULT_LR_TAU_INDIVIDUAL` (0.0133).
        temperature_gradient: ``reference`` (default) follows the official code (``Optimization-AI/fast_clip``):
            the learnable temperature's gradient is taken through both halves of the surrogate (the anchors' terms
            and the negatives' terms, so the surrogate's part counts twice: at world size 1 the ``logit_scale``
            gradient is 2x the exact one for GCL), individual temperatures (v2) do not weight the model gradient,
            both halves use the temperatures from before this step's update, and the individual temperatures'
            Adam-like update uses no momentum in epoch 0 (``beta = 0``) and bias-corrects by ``epoch + 1``.
            ``exact``: the exact gradient of the objective (temperature detached in the negatives' half, v2's model
            gradient weighted by ``tau_i``) and a standard per-sample Adam update (bias correction by the sample's
            own number of updates, ``beta1_tau`` / ``beta2_tau`` from the first visit on), which does not assume
            one visit per epoch. The model gradient of GCL / RGCL-g is the same in both.
        beta1_tau: first-moment decay of that update (from epoch 1 on in ``reference`` mode). Default 0.9.
        beta2_tau: second-moment decay (likewise). Default 0.999.
        eps_tau: denominator epsilon of that update. Default 1e-8.
        tau_min: lower clamp of the individual temperatures. Default 0.01.
        tau_max: upper clamp. Default 1.0.
        grad_clamp_tau: the temperature gradient is clamped to ``[-grad_clamp_tau, grad_clamp_tau]``. Default 5.
        group: process group (default: the world).
    """

    # Registered buffers (declared here so type checkers know they are tensors, not ``Module.__getattr__``'s union).
    gamma_buf: Tensor
    u1: Tensor
    u2: Tensor
    tau1: Tensor
    tau2: Tensor
    bound1: Tensor
    bound2: Tensor
    m1: Tensor
    m2: Tensor
    v1: Tensor
    v2: Tensor
    tau_steps: Tensor

    def __init__(
        self,
        data_size: int,
        objective: Literal["gcl", "rgcl", "rgcl_g"] = "rgcl_g",
        temperature: TemperatureMode = "learnable",
        gamma: float = 1.0,
        eps: float = DEFAULT_EPS,
        rho: float | None = None,
        tau_init: float | None = None,
        lr_tau: float | None = None,
        temperature_gradient: TemperatureGradient = "reference",
        beta1_tau: float = 0.9,
        beta2_tau: float = 0.999,
        eps_tau: float = 1e-8,
        tau_min: float = 0.01,
        tau_max: float = 1.0,
        grad_clamp_tau: float = 5.0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if data_size < 2:
            raise ValueError(f"data_size must be >= 2, got {data_size}.")
        if objective not in ("gcl", "rgcl", "rgcl_g"):
            raise ValueError(f"objective must be 'gcl', 'rgcl' or 'rgcl_g', got {objective!r}.")
        if (objective == "rgcl") != (temperature == "individual"):
            raise ValueError("Individual temperatures go with the 'rgcl' objective and only with it.")
        if objective == "rgcl_g" and temperature != "learnable":
            raise ValueError("The 'rgcl_g' objective (FastCLIP-v3) needs a learnable global temperature.")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}.")
        if temperature_gradient not in ("reference", "exact"):
            raise ValueError(f"temperature_gradient must be 'reference' or 'exact', got {temperature_gradient!r}.")
        rho = DEFAULT_RHO.get(objective, 0.0) if rho is None else rho
        tau_init = DEFAULT_TEMPERATURE["individual"] if tau_init is None else tau_init
        lr_tau = DEFAULT_LR_TAU_INDIVIDUAL if lr_tau is None else lr_tau
        if not 0.0 < tau_min <= tau_init <= tau_max:
            raise ValueError(f"Need 0 < tau_min <= tau_init <= tau_max, got {tau_min}, {tau_init}, {tau_max}.")
        self.data_size = int(data_size)
        self.objective = objective
        self.temperature = temperature
        self.eps = float(eps)
        self.rho = float(rho)
        self.temperature_gradient: TemperatureGradient = temperature_gradient
        self.lr_tau = float(lr_tau)
        self.beta1_tau = float(beta1_tau)
        self.beta2_tau = float(beta2_tau)
        self.eps_tau = float(eps_tau)
        self.tau_min = float(tau_min)
        self.tau_max = float(tau_max)
        self.grad_clamp_tau = float(grad_clamp_tau)
        self.group = group
        self._epoch = 0
        self.register_buffer("gamma_buf", torch.tensor(float(gamma), dtype=torch.float64))
        self.register_buffer("u1", torch.zeros(data_size))
        self.register_buffer("u2", torch.zeros(data_size))
        if temperature == "individual":
            self.register_buffer("tau1", torch.full((data_size,), float(tau_init)))
            self.register_buffer("tau2", torch.full((data_size,), float(tau_init)))
            for name in ("bound1", "bound2", "m1", "m2", "v1", "v2"):
                self.register_buffer(name, torch.zeros(data_size))
            self.register_buffer("tau_steps", torch.zeros(data_size, dtype=torch.int64))

    @property
    def gamma(self) -> float:
        """Current inner learning rate (stored in the ``gamma_buf`` buffer so it is checkpointed)."""
        return float(self.gamma_buf)

    @gamma.setter
    def gamma(self, value: float) -> None:
        if not 0.0 < value <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {value}.")
        self.gamma_buf.fill_(float(value))

    @property
    def epoch(self) -> int:
        """Current training epoch (0-based), read by the ``reference`` temperature update."""
        return self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        if int(value) < 0:
            raise ValueError(f"epoch must be >= 0, got {value}.")
        self._epoch = int(value)

    def forward(
        self, image_features: Tensor, text_features: Tensor, indices: Tensor, logit_scale: Tensor | float | None = None
    ) -> LossOutput:
        """One step: update the estimators of the global batch's samples and return the loss.

        Args:
            image_features: ``(b, d)`` L2-normalised local image embeddings (with autograd).
            text_features: ``(b, d)`` L2-normalised local text embeddings.
            indices: ``(b,)`` dataset indices of the local samples.
            logit_scale: ``log(1 / tau)`` of the global temperature (a tensor that may require grad, or a float);
                ignored with individual temperatures.
        """
        _check_inputs(image_features, text_features, indices, self.data_size)
        individual = self.temperature == "individual"
        reference = self.temperature_gradient == "reference"
        if not individual and logit_scale is None:
            raise ValueError(f"A global-temperature loss ({self.objective}) needs logit_scale = log(1 / tau).")
        rank, size = world(self.group)
        b, d = image_features.shape
        check_equal_batch_sizes(b, self.group)
        n = b * size
        if n < 2:
            raise ValueError(
                f"The global batch must hold at least 2 pairs (it holds {n}: {b} per rank on {size} rank(s)); the "
                "contrastive loss needs negatives. This is usually the last, short batch of an epoch: give the "
                "training DataLoader drop_last=True (ImageTextDataModule does by default), or a batch size that "
                "divides the training set."
            )
        e1, e2 = image_features, text_features
        indices = indices.to(device=e1.device, dtype=torch.long)
        gathered = all_gather_no_grad(torch.cat([e1, e2], dim=1), self.group)
        all_e1, all_e2 = gathered[:, :d], gathered[:, d:]
        off = rank * b
        # The official code's split (Optimization-AI/fast_clip, FastCLIPLoss.local / forward): (1) this rank's anchors
        # against all gathered negatives, detached (autograd reaches the anchor and its positive); (2) every anchor of
        # the global batch, detached, against this rank's samples as negatives (autograd reaches the negatives). After
        # data parallelism's average each pair's gradient is counted once through each role.
        diag = (e1 * e2).sum(dim=1)
        sim1 = e1 @ all_e2.T  # (b, n): image anchors vs all texts
        sim2 = e2 @ all_e1.T  # (b, n): text anchors vs all images
        rows = torch.arange(b, device=e1.device)
        not_pos = torch.ones(b, n, dtype=torch.bool, device=e1.device)
        not_pos[rows, rows + off] = False

        if individual:
            tau1, tau2 = self.tau1[indices].clone(), self.tau2[indices].clone()
            s1, s2 = (1.0 / tau1)[:, None], (1.0 / tau2)[:, None]
        else:
            assert logit_scale is not None  # checked above; narrows the type
            s = logit_scale.exp() if isinstance(logit_scale, Tensor) else torch.tensor(math.exp(logit_scale))
            s = s.to(e1.dtype).to(e1.device).reshape(())
            s1 = s2 = s
        d1 = (sim1 - diag[:, None]) * s1
        d2 = (sim2 - diag[:, None]) * s2
        if individual:
            old_b1, old_b2 = self.bound1[indices], self.bound2[indices]
            new_b1 = torch.maximum(old_b1, d1.detach().masked_fill(~not_pos, -math.inf).amax(dim=1))
            new_b2 = torch.maximum(old_b2, d2.detach().masked_fill(~not_pos, -math.inf).amax(dim=1))
            d1 = d1 - new_b1[:, None]
            d2 = d2 - new_b2[:, None]
        ex1 = torch.exp(d1).masked_fill(~not_pos, 0.0)
        ex2 = torch.exp(d2).masked_fill(~not_pos, 0.0)
        g1 = ex1.sum(dim=1) / (n - 1)
        g2 = ex2.sum(dim=1) / (n - 1)

        with torch.no_grad():
            g1d, g2d = g1.detach(), g2.detach()
            gamma = self.gamma
            u1_old, u2_old = self.u1[indices], self.u2[indices]
            # (individual temperatures: the old estimate is re-expressed relative to the new bound)
            u1_new = _estimator_update(u1_old, g1d, gamma, torch.exp(old_b1 - new_b1) if individual else None)
            u2_new = _estimator_update(u2_old, g2d, gamma, torch.exp(old_b2 - new_b2) if individual else None)
            cols = [u1_new, u2_new]
            if individual:
                gt1 = self._tau_gradient(u1_new, new_b1, ex1.detach(), d1.detach(), n)
                gt2 = self._tau_gradient(u2_new, new_b2, ex2.detach(), d2.detach(), n)
                cols += [tau1, tau2, new_b1, new_b2, gt1, gt2]
            stats = torch.stack([c.double() for c in cols] + [indices.double()], dim=1)
            all_stats = all_gather_no_grad(stats, self.group)
            all_idx = all_stats[:, -1].long()
            if torch.unique(all_idx).numel() != n:
                raise ValueError(
                    "A dataset index appears twice in one global batch; the per-sample estimators need distinct "
                    "samples. Use a sampler without replacement and drop_last=True (no DistributedSampler padding)."
                )
            dt = self.u1.dtype
            self.u1[all_idx] = all_stats[:, 0].to(dt)
            self.u2[all_idx] = all_stats[:, 1].to(dt)
            if individual:
                self.bound1[all_idx] = all_stats[:, 4].to(dt)
                self.bound2[all_idx] = all_stats[:, 5].to(dt)
                self._adam_tau_update(all_idx, all_stats[:, 6].to(dt), all_stats[:, 7].to(dt))

        w1 = 1.0 / (u1_new + self.eps)
        w2 = 1.0 / (u2_new + self.eps)
        c1 = tau1 if (individual and not reference) else 1.0
        c2 = tau2 if (individual and not reference) else 1.0
        surrogate = (w1 * g1 * c1 + w2 * g2 * c2).sum() / (2 * n)
        # (2) Every anchor of the global batch (detached, weighted by its gathered estimator) against this rank's
        # samples as negatives.
        a_stats = all_stats.to(e1.dtype)
        a_diag = (all_e1 * all_e2).sum(dim=1)
        ab1: Tensor | float  # the anchors' log-sum-exp bounds (0: no shift with a global temperature)
        ab2: Tensor | float
        if individual:
            # the anchors' temperatures from before this step's update, gathered with the estimators (as the
            # official code has done since it gathers them: the bounds above were computed at these temperatures)
            as1, as2 = (1.0 / a_stats[:, 2])[:, None], (1.0 / a_stats[:, 3])[:, None]
            ab1, ab2 = a_stats[:, 4:5], a_stats[:, 5:6]
        else:
            as1 = as2 = s if reference else s.detach()
            ab1 = ab2 = 0.0
        is_pos = torch.zeros(n, b, dtype=torch.bool, device=e1.device)
        is_pos[rows + off, rows] = True
        ag1 = torch.exp((all_e1 @ e2.T - a_diag[:, None]) * as1 - ab1).masked_fill(is_pos, 0.0).sum(dim=1) / (n - 1)
        ag2 = torch.exp((all_e2 @ e1.T - a_diag[:, None]) * as2 - ab2).masked_fill(is_pos, 0.0).sum(dim=1) / (n - 1)
        aw1 = 1.0 / (a_stats[:, 0] + self.eps)
        aw2 = 1.0 / (a_stats[:, 1] + self.eps)
        ac1 = a_stats[:, 2] if (individual and not reference) else 1.0
        ac2 = a_stats[:, 3] if (individual and not reference) else 1.0
        surrogate = surrogate + (aw1 * ag1 * ac1 + aw2 * ag2 * ac2).sum() / (2 * n)

        if self.objective == "rgcl_g":
            tau = 1.0 / s
            log_u = (torch.log(u1_new + self.eps) + torch.log(u2_new + self.eps)).sum() / (2 * n)
            loss = tau.detach() * surrogate + (b / n) * self.rho * tau + tau * log_u
        else:
            loss = surrogate
        # Data parallelism averages parameter gradients over the ranks; each rank's loss carries the full-batch
        # gradient of its own samples' features, so scale by the world size to get the full-batch gradient.
        loss = loss * size

        with torch.no_grad():
            lg1 = _log_eps(g1d, self.eps, new_b1 if individual else None)
            lg2 = _log_eps(g2d, self.eps, new_b2 if individual else None)
            if self.objective == "rgcl":
                value = (tau1 * (lg1 + self.rho) + tau2 * (lg2 + self.rho)).mean()
            else:
                tau_v = 1.0 / s.detach()
                value = tau_v * (lg1 + lg2).mean()
                if self.objective == "rgcl_g":
                    value = value + 2 * self.rho * tau_v
        return LossOutput(loss=loss, value=value, g1=g1d, g2=g2d)

    def _tau_gradient(self, u: Tensor, bound: Tensor, ex: Tensor, shifted_d: Tensor, n: int) -> Tensor:
        """Gradient of ``tau_i (log g_i(tau_i) + rho)`` in ``tau_i``, with ``g_i`` replaced by its estimator.

        ``log(u + eps) + bound + rho - mean_j exp(d_ij - bound) d_ij / (u + eps)`` with ``d_ij`` the scaled logit
        difference, clamped to ``[-grad_clamp_tau, grad_clamp_tau]``.
        """
        weighted = (ex * (shifted_d + bound[:, None])).sum(dim=1) / (n - 1)
        grad = torch.log(u + self.eps) + bound + self.rho - weighted / (u + self.eps)
        return grad.clamp(-self.grad_clamp_tau, self.grad_clamp_tau)

    def _adam_tau_update(self, idx: Tensor, grad1: Tensor, grad2: Tensor) -> None:
        """The individual temperatures' Adam-like step for the samples ``idx``.

        ``reference``: the official rule, ``beta = 0`` in epoch 0 (so the moments restart from this step's
        gradient) and bias correction ``1 - beta ** (epoch + 1)``. ``exact``: Adam per sample, bias correction
        ``1 - beta ** k`` with ``k`` the sample's own number of updates.
        """
        steps = self.tau_steps[idx] + 1
        self.tau_steps[idx] = steps
        beta1: float
        beta2: float
        bc1: Tensor | float
        bc2: Tensor | float
        if self.temperature_gradient == "reference":
            beta1 = self.beta1_tau if self._epoch > 0 else 0.0
            beta2 = self.beta2_tau if self._epoch > 0 else 0.0
            bc1 = 1.0 - beta1 ** (self._epoch + 1)
            bc2 = 1.0 - beta2 ** (self._epoch + 1)
        else:
            beta1, beta2 = self.beta1_tau, self.beta2_tau
            bc1 = 1.0 - self.beta1_tau ** steps.to(grad1.dtype)
            bc2 = 1.0 - self.beta2_tau ** steps.to(grad1.dtype)
        for tau, m, v, grad in ((self.tau1, self.m1, self.v1, grad1), (self.tau2, self.m2, self.v2, grad2)):
            m_new = beta1 * m[idx] + (1.0 - beta1) * grad
            v_new = beta2 * v[idx] + (1.0 - beta2) * grad * grad
            m[idx] = m_new
            v[idx] = v_new
            step = self.lr_tau * (m_new / bc1) / ((v_new / bc2).sqrt() + self.eps_tau)
            tau[idx] = (tau[idx] - step).clamp(self.tau_min, self.tau_max)


RESET_BELOW = 1e-35
"""A stored estimate below this (a first visit stores 0) is replaced by ``g`` when gamma < 1 (the official rule)."""


def _estimator_update(u_stored: Tensor, g: Tensor, gamma: float, rescale: Tensor | None = None) -> Tensor:
    """``(1 - gamma) u + gamma g``, with ``u = u_stored * rescale`` (v2: the stored estimate at the new bound).

    The official rule (``Optimization-AI/fast_clip``, ``FastCLIPLoss.local`` and ``FastCLIPLossIndividual.forward``):
    only when gamma < 1, a *stored* estimate below :data:`RESET_BELOW` or not finite (a first visit) is replaced by
    ``g``. The test reads the stored value before the rescaling, so an estimate that the rescaling sends to 0 (a bound
    jump above ~104 in float32) is averaged with 0, not reset. With gamma = 1 the update is ``g``.
    """
    if gamma >= 1.0:
        return g.clone()
    kept = (1.0 - gamma) * u_stored
    if rescale is not None:  # in the official code's order of operations, so float32 rounds alike
        kept = kept * rescale
    reset = (u_stored < RESET_BELOW) | ~torch.isfinite(u_stored)
    return torch.where(reset, g, kept + gamma * g)


def _log_eps(g: Tensor, eps: float, bound: Tensor | None) -> Tensor:
    """``log(eps + g_true)`` where ``g_true = g * exp(bound)`` when a bound shifts ``g``."""
    if bound is None:
        return torch.log(eps + g)
    return torch.log(eps * torch.exp(-bound) + g) + bound


def build_loss(
    name: str,
    data_size: int | None,
    gamma: float = 1.0,
    eps: float = DEFAULT_EPS,
    rho: float | None = None,
    tau_init: float | None = None,
    lr_tau: float | None = None,
    temperature_gradient: TemperatureGradient = "reference",
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Build the loss module of a named variant (see :data:`VARIANTS`).

    Args:
        name: variant name, e.g. ``"fastclip_v3"``.
        data_size: training-set size (needed by every variant except ``openclip`` and ``siglip``).
        gamma: initial inner learning rate. Default 1.
        eps: epsilon of the compositional losses. Default :data:`DEFAULT_EPS`.
        rho: KL radius of RGCL / RGCL-g; ``None`` takes the variant's default (:data:`DEFAULT_RHO`).
        tau_init: initial individual temperature (v2, iSogCLR); ``None``: :data:`DEFAULT_TEMPERATURE`.
        lr_tau: step size of the individual temperature update (v2, iSogCLR); ``None``:
            :data:`DEFAULT_LR_TAU_INDIVIDUAL`.
        temperature_gradient: ``reference`` (the official code's gradients, default) or ``exact`` (see
            :class:`GlobalContrastiveLoss`).
        group: process group (default: the world).
    """
    variant = get_variant(name)
    if variant.objective == "mbcl":
        return OpenCLIPLoss(group=group)
    if variant.objective == "sigmoid":
        return SigLIPLoss(group=group)
    if data_size is None:
        raise ValueError(f"The {name} loss keeps one estimator per training sample: pass data_size=len(train_set).")
    return GlobalContrastiveLoss(
        data_size,
        objective=variant.objective,
        temperature=variant.temperature,
        gamma=gamma,
        eps=eps,
        rho=rho,
        tau_init=tau_init,
        lr_tau=lr_tau,
        temperature_gradient=temperature_gradient,
        group=group,
    )


def reference_global_contrastive_loss(
    image_features: Tensor,
    text_features: Tensor,
    u1: Tensor,
    u2: Tensor,
    gamma: float,
    logit_scale: Tensor | float,
    objective: Literal["gcl", "rgcl_g"] = "gcl",
    eps: float = DEFAULT_EPS,
    rho: float = DEFAULT_RHO["rgcl_g"],
) -> tuple[Tensor, Tensor, Tensor]:
    """Plain full-batch transcription of one GCL / RGCL-g step's *exact* gradient (``temperature_gradient="exact"``),
    one anchor at a time, with a global temperature.

    Args:
        image_features: ``(n, d)`` normalised image embeddings of the whole global batch.
        text_features: ``(n, d)`` normalised text embeddings.
        u1: ``(n,)`` current estimators of the batch's samples (0 = never visited).
        u2: ``(n,)`` current estimators, text side.
        gamma: inner learning rate.
        logit_scale: ``log(1 / tau)``.
        objective: ``gcl`` or ``rgcl_g``.
        eps: epsilon.
        rho: KL radius (``rgcl_g``).

    Returns:
        ``(loss, new_u1, new_u2)``; ``loss.backward()`` gives the algorithm's gradient.
    """
    n = image_features.shape[0]
    tau = 1.0 / (logit_scale.exp() if isinstance(logit_scale, Tensor) else math.exp(logit_scale))
    terms = []
    new_u1, new_u2 = u1.clone(), u2.clone()
    log_u: Tensor | float = 0.0
    for i in range(n):
        pos = image_features[i] @ text_features[i]
        others = [j for j in range(n) if j != i]
        # ``sum`` of tensors is a tensor (typeshed's ``sum`` adds its ``int`` start to the type)
        g1 = cast(Tensor, sum(torch.exp((image_features[i] @ text_features[j] - pos) / tau) for j in others)) / (n - 1)
        g2 = cast(Tensor, sum(torch.exp((image_features[j] @ text_features[i] - pos) / tau) for j in others)) / (n - 1)
        for g, u, new_u in ((g1, u1, new_u1), (g2, u2, new_u2)):
            new_u[i] = g.detach() if u[i] == 0 else (1 - gamma) * u[i] + gamma * g.detach()
        terms.append(g1 / (new_u1[i] + eps) + g2 / (new_u2[i] + eps))
        log_u = log_u + torch.log(new_u1[i] + eps) + torch.log(new_u2[i] + eps)
    surrogate = torch.stack(terms).sum() / (2 * n)
    if objective == "rgcl_g":
        tau_t = tau if isinstance(tau, Tensor) else torch.tensor(tau)
        loss = tau_t.detach() * surrogate + rho * tau_t + tau_t * log_u / (2 * n)
    else:
        loss = surrogate
    return loss, new_u1, new_u2
