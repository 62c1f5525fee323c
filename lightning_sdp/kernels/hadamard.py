"""Block Hadamard transform used by SDP4Bit's TLq-HS gradient quantisation (plain-torch reference).

SDP4Bit (Jia et al., NeurIPS 2024, arXiv 2410.15526) multiplies every block of ``n`` (default 32) gradient values
by the unnormalised Sylvester Hadamard matrix ``H`` (entries ±1, ``H = H^T``, ``H H = n I``) before quantising. The
transform spreads outliers over the block, so the group's absmax, and with it the quantisation step, shrinks.
The receiver applies ``H`` once more and divides by ``n``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def _check_size(n: int) -> None:
    if n < 1 or n & (n - 1):
        raise ValueError(f"The Hadamard size must be a power of two, got {n}.")


@functools.lru_cache(maxsize=16)
def _hadamard_cpu(n: int) -> Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> Tensor:
    """The ``n x n`` Sylvester Hadamard matrix with ±1 entries (``H[i, j] = (-1)^popcount(i & j)``).

    Args:
        n: size, a power of two.
        dtype: dtype of the result.
        device: device of the result.
    """
    _check_size(n)
    return _hadamard_cpu(n).to(dtype=dtype, device=device)


def hadamard_transform(x: Tensor, block: int = 32) -> Tensor:
    """Apply ``H`` (unnormalised) to every block of ``block`` contiguous values of ``x`` (flattened).

    Args:
        x: floating tensor whose number of elements is a multiple of ``block``.
        block: Hadamard size, a power of two (32 in the paper).

    Returns:
        A new tensor of ``x``'s shape and dtype.
    """
    _check_size(block)
    if x.numel() % block:
        raise ValueError(
            f"The Hadamard transform needs a whole number of blocks of {block}; got {x.numel()} elements. "
            "Pad the buffer with zeros."
        )
    h = hadamard_matrix(block, dtype=x.dtype, device=x.device)
    return (x.reshape(-1, block) @ h).reshape(x.shape)


def fast_walsh_hadamard(x: Tensor, block: int = 32) -> Tensor:
    """Butterfly form of :func:`hadamard_transform` (``log2(block)`` add/subtract stages, no matrix).

    Computes the same function in O(n log n); kept as an independent check of the matrix form.

    Args:
        x: floating tensor whose number of elements is a multiple of ``block``.
        block: Hadamard size, a power of two.
    """
    _check_size(block)
    if x.numel() % block:
        raise ValueError(f"The Hadamard transform needs a whole number of blocks of {block}; got {x.numel()}.")
    y = x.reshape(-1, block).clone()
    h = 1
    while h < block:
        y = y.view(-1, block // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(x.shape)
