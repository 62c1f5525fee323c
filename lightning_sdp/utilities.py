"""Tiny helpers around Lightning objects that several parts of the package need (one home for each)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer


def unwrap_optimizer(optimizer: Optimizer | LightningOptimizer | Any) -> Optimizer:
    """The user's ``torch.optim.Optimizer`` behind Lightning's ``LightningOptimizer`` wrapper.

    Lightning hands hooks and strategies a :class:`~lightning.pytorch.core.optimizer.LightningOptimizer` in some
    places and the raw optimizer in others; state keyed by the optimizer must use the raw one.

    Args:
        optimizer: a ``LightningOptimizer`` or an optimizer (returned as is).
    """
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
