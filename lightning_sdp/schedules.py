"""Learning-rate multipliers shared by the models (warm-up + cosine, linear decay).

They are small classes rather than closures so that a ``LambdaLR`` holding them (and so a checkpoint) can be
pickled. Each returns the factor that multiplies the base learning rate at optimizer step ``step`` (0-based).
"""

from __future__ import annotations

import math


class WarmupCosine:
    """Linear warm-up to 1 over ``warmup`` steps, cosine decay to ``min_ratio`` at ``total`` steps, then flat.

    The warm-up is ``(step + 1) / warmup`` (the form of the FastCLIP and open_clip reference code), so the last
    warm-up step reaches exactly 1.

    Args:
        warmup: warm-up steps (``0`` starts at 1).
        total: step at which the decay reaches ``min_ratio``.
        min_ratio: final factor, in ``[0, 1]``.
    """

    def __init__(self, warmup: int, total: int, min_ratio: float = 0.0) -> None:
        if warmup < 0 or total < 1:
            raise ValueError(f"WarmupCosine: need warmup >= 0 and total >= 1, got warmup={warmup}, total={total}.")
        if not 0.0 <= min_ratio <= 1.0:
            raise ValueError(f"WarmupCosine: min_ratio must lie in [0, 1], got {min_ratio}.")
        self.warmup, self.total, self.min_ratio = int(warmup), int(total), float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LinearDecay:
    """Linear decay from 1 at step 0 to ``min_ratio`` at ``total`` steps, then flat (SimpleX's schedule).

    Args:
        total: step at which the factor reaches ``min_ratio``.
        min_ratio: final factor, in ``[0, 1]``.
    """

    def __init__(self, total: int, min_ratio: float = 0.0) -> None:
        if total < 1:
            raise ValueError(f"LinearDecay: need total >= 1, got {total}.")
        if not 0.0 <= min_ratio <= 1.0:
            raise ValueError(f"LinearDecay: min_ratio must lie in [0, 1], got {min_ratio}.")
        self.total, self.min_ratio = int(total), float(min_ratio)

    def __call__(self, step: int) -> float:
        progress = min(1.0, max(0, step) / self.total)
        return 1.0 - (1.0 - self.min_ratio) * progress
