"""Gradient norms that also work under :class:`~lightning_sdp.plugins.sdp4bit.SDP4BitStrategy`."""

from __future__ import annotations

from typing import Any, cast

from torch import Tensor
from torch.nn import Module


def grad_norm(
    module: Module, norm_type: float | int | str, group_separator: str = "/", strategy: Any = None
) -> dict[str, Tensor]:
    """Drop-in for :func:`lightning.pytorch.utilities.grad_norm` that also works under :class:`SDP4BitStrategy`.

    SDP4Bit reduces the gradients into flat shards and drops the parameters' ``.grad`` before
    ``on_before_optimizer_step``; this returns the norms of the reduced gradients (what DDP's ``.grad`` holds), with
    the same keys. Under any other strategy it calls Lightning's ``grad_norm``. Under SDP4Bit it is a collective:
    call it on every rank (hooks run on every rank).

    Args:
        module: the module to report (usually ``self`` in a LightningModule hook).
        norm_type: the p of the p-norm; ``"inf"`` for the max norm.
        group_separator: separator in the keys (default ``"/"``).
        strategy: the strategy; default ``module.trainer.strategy`` for a LightningModule.
    """
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    if strategy is None:
        trainer = getattr(module, "_trainer", None)
        strategy = getattr(trainer, "strategy", None)
    from lightning_sdp.plugins.sdp4bit.strategy import SDP4BitStrategy  # the strategy module imports Lightning

    if isinstance(strategy, SDP4BitStrategy) and strategy._buckets:
        return strategy.grad_norm(module, norm_type, group_separator)
    # Lightning annotates its values as ``float`` but returns 0-dim tensors (``p.grad.norm(...)``), as we do
    return cast(dict[str, Tensor], lightning_grad_norm(module, norm_type, group_separator))
