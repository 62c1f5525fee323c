"""LAMB optimiser (You et al., "Large Batch Optimization for Deep Learning", arXiv 1904.00962), plain torch.

Offered by :class:`~lightning_sdp.models.fastclip.FastCLIPModule` as ``optimizer="lamb"`` (FastCLIP's scripts use
it for large batches). As in the official code (``Optimization-AI/fast_clip``, ``src/training/optimizer.py``) and
``timm.optim.Lamb``, the trust ratio is applied only to tensors whose group has a non-zero weight decay (biases,
norms and ``logit_scale`` take the plain Adam step). One loop over parameters, no fused kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class Lamb(torch.optim.Optimizer):
    """Adam moments with a per-tensor trust ratio ``||w|| / ||update||`` (1 when either norm is 0).

    Args:
        params: parameters or parameter groups.
        lr: learning rate. Default 1e-3.
        betas: moment decays. Default (0.9, 0.999).
        eps: denominator epsilon. Default 1e-6.
        weight_decay: decoupled weight decay added to the update before the trust ratio. Default 0.
        always_adapt: apply the trust ratio to every tensor, also those without weight decay
            (``timm.optim.Lamb``'s option of the same name). Default False (the official code).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        always_adapt: bool = False,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Invalid LAMB hyper-parameters: lr={lr}, betas={betas}, eps={eps}, wd={weight_decay}.")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "always_adapt": always_adapt}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimisation step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = m / (1 - beta1 ** state["step"])
                v_hat = v / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update = update + group["weight_decay"] * p
                if group["weight_decay"] or group.get("always_adapt", False):
                    w_norm, u_norm = p.norm(), update.norm()
                    trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                    update = update * trust
                p.add_(update, alpha=-group["lr"])
        return loss
