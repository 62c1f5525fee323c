"""Collectives used by the FastCLIP losses: all-gathers *without* autograd, with a byte counter (:data:`GATHER_BYTES`).

FastCLIP (Wei et al., arXiv 2407.01445, Sec. 4) all-gathers features, estimator values and indices without
building an autograd graph through the collective: every rank computes the terms of its own anchors and the terms
in which its own samples are negatives of the other ranks' anchors, so after the usual parameter all-reduce of data
parallelism the gradient equals the full-global-batch gradient and no feature-gradient collective is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class GatherByteCounter:
    """Bytes this rank received from the other ranks through :func:`all_gather_no_grad`, and the number of calls.

    (Named apart from ``lightning_sdp.plugins.sdp4bit.CommStats``, which counts the SDP4Bit strategy's traffic.)
    """

    bytes_received: int = 0
    calls: int = 0

    def reset(self) -> None:
        self.bytes_received = 0
        self.calls = 0


GATHER_BYTES = GatherByteCounter()
"""The process-wide counter that :func:`all_gather_no_grad` adds to (``reset()`` it before a measurement)."""


def world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """Return ``(rank, world_size)`` of ``group``; ``(0, 1)`` when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def all_gather_no_grad(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate ``tensor`` from every rank along dim 0, detached (no autograd through the collective).

    Args:
        tensor: the local tensor; every rank must pass the same shape and dtype.
        group: process group (default: the world).

    Returns:
        ``(world_size * tensor.shape[0], ...)`` tensor in rank order. On one process, ``tensor.detach()``.
    """
    tensor = tensor.detach().contiguous()
    _, size = world(group)
    if size == 1:
        return tensor
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor, group=group)
    GATHER_BYTES.bytes_received += (size - 1) * tensor.numel() * tensor.element_size()
    GATHER_BYTES.calls += 1
    return torch.cat(out, dim=0)


def check_equal_batch_sizes(local_batch: int, group: dist.ProcessGroup | None = None) -> None:
    """Raise when the ranks' local batch sizes differ (the global-batch reduction needs equal shards).

    Args:
        local_batch: this rank's batch size.
        group: process group (default: the world).
    """
    _, size = world(group)
    if size == 1:
        return
    sizes = all_gather_no_grad(torch.tensor([local_batch], dtype=torch.int64), group)
    if bool((sizes != sizes[0]).any()):
        raise ValueError(
            f"FastCLIP needs the same local batch size on every rank, got {sizes.tolist()}. Use a sampler with "
            "`drop_last=True` (ImageTextDataModule does this for training) so the last partial batch is dropped."
        )
