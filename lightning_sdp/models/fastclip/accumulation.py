"""Gradient accumulation for contrastive losses: the micro-batches of one optimizer step form one contrastive batch.

With ``Trainer(accumulate_grad_batches=k)`` Lightning runs ``training_step`` on ``k`` micro-batches and steps the
optimizer once. A contrastive loss computed per micro-batch would see only ``b - 1`` negatives and, for FastCLIP,
update the estimators from those. As open_clip's ``--accum-freq`` does, the ``k`` micro-batches here form *one*
batch: the loss (and FastCLIP's estimator update, once per optimizer step) is computed over all of them, so the
gradient equals that of one batch ``k`` times larger.

How: the first ``k - 1`` micro-batches are encoded under non-reentrant activation checkpointing
(:func:`torch.utils.checkpoint.checkpoint`): their embeddings keep an autograd graph, but only the inputs are
stored, and the encoders run again, one micro-batch at a time, when the loss of the last micro-batch is
back-propagated. That costs one extra forward pass of ``k - 1`` micro-batches (open_clip re-runs the forward of all
``k``) and holds one micro-batch's activations at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

Encode = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass
class HeldBatches:
    """Embeddings (with a checkpointed graph) and indices of the micro-batches held until the optimizer step."""

    image_features: list[Tensor] = field(default_factory=list)
    text_features: list[Tensor] = field(default_factory=list)
    indices: list[Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.indices)

    def hold(self, encode: Encode, images: Tensor, tokens: Tensor, indices: Tensor) -> None:
        """Encode a micro-batch whose gradient is taken at the optimizer step, storing only its inputs."""
        e1, e2 = checkpoint(encode, images, tokens, use_reentrant=False)
        self.image_features.append(e1)
        self.text_features.append(e2)
        self.indices.append(indices)

    def release(self, e1: Tensor, e2: Tensor, indices: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The whole accumulated batch: the held micro-batches, then the last one (``e1``, ``e2``, ``indices``)."""
        out = (
            torch.cat([*self.image_features, e1]),
            torch.cat([*self.text_features, e2]),
            torch.cat([*(i.to(indices.device) for i in self.indices), indices]),
        )
        self.clear()
        return out

    def clear(self) -> None:
        self.image_features.clear()
        self.text_features.clear()
        self.indices.clear()


def closes_window(batch_idx: int, accumulate: int, batches_per_epoch: float) -> bool:
    """Whether Lightning steps the optimizer after micro-batch ``batch_idx`` (as its fit loop decides: every
    ``accumulate`` batches and at the epoch's last batch)."""
    return (batch_idx + 1) % accumulate == 0 or batch_idx + 1 >= batches_per_epoch


def placeholder_loss(like: Tensor) -> Tensor:
    """What a held micro-batch's ``training_step`` returns: a zero that Lightning may back-propagate (it reaches no
    parameter; returning ``None`` is not allowed on several processes)."""
    return torch.zeros((), device=like.device, dtype=torch.float32, requires_grad=True)
