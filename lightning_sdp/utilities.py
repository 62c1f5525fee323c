"""Tiny helpers around Lightning objects that several parts of the package need (one home for each)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from tqdm import tqdm


def unwrap_optimizer(optimizer: Optimizer | LightningOptimizer | Any) -> Optimizer:
    """The user's ``torch.optim.Optimizer`` behind Lightning's ``LightningOptimizer`` wrapper.

    Lightning hands hooks and strategies a :class:`~lightning.pytorch.core.optimizer.LightningOptimizer` in some
    places and the raw optimizer in others; state keyed by the optimizer must use the raw one.

    Args:
        optimizer: a ``LightningOptimizer`` or an optimizer (returned as is).
    """
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def rank_zero_say(message: str) -> None:
    """``rank_zero_info(message)`` on a line of its own, also while a progress bar is drawn.

    Lightning's log messages go to the terminal the progress bar redraws in place, so a message logged mid-epoch
    lands at the end of the bar's line. Every tqdm bar (Lightning's included) is cleared first and redrawn after.
    """
    with tqdm.external_write_mode():
        rank_zero_info(message)
