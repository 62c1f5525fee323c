"""Fused Triton kernels for SDP4Bit's quantised communication (GPU fast path).

Each public function computes the same thing as its plain-torch reference in
:mod:`lightning_sdp.kernels.quantization`, in one pass over memory:

==================================  ==================================================  ============================
function                            step                                                reference
==================================  ==================================================  ============================
:func:`encode`                      (subtract +) (Hadamard +) quantise (+ pack int4)    ``quantize_difference``,
                                                                                        ``hadamard_quantize``,
                                                                                        ``encode``
:func:`dequantize_add_`             unpack + dequantise + add into the weights          ``dequantize_add_``
:func:`dequantize_sum_requantize`   dequantise K peers + sum + re-quantise              ``dequantize_sum_requantize``
:func:`dequantize_sum_hadamard`     dequantise K peers + sum + inverse Hadamard         ``dequantize_sum_hadamard``
==================================  ==================================================  ============================

One program handles one quantisation group (a power of two, e.g. 128 or 2048 values). Stochastic rounding either
reads explicit offsets (``noise=``, for bit-exact comparisons with the reference) or draws them in the kernel with
``tl.rand(seed, offset)`` (no extra memory traffic). The kernels run on CUDA tensors, and on CPU tensors under
``TRITON_INTERPRET=1`` (how the test suite checks them). ``triton`` is imported lazily.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from lightning_sdp._imports import require
from lightning_sdp.kernels.hadamard import hadamard_matrix
from lightning_sdp.kernels.quantization import Rounding, payload_bytes, qmax

_NOISE_NEAREST, _NOISE_TENSOR, _NOISE_RANDOM = 0, 1, 2


def _pow2(n: int, what: str) -> None:
    if n < 2 or n & (n - 1):
        raise ValueError(f"The Triton kernels need {what} to be a power of two >= 2, got {n}.")


@functools.lru_cache(maxsize=1)
def _kernels() -> Any:
    require("triton", feature="the SDP4Bit Triton kernels")
    from lightning_sdp.kernels import _triton_kernels as k

    return {
        "encode": k.encode_kernel,
        "dequant_add": k.dequant_add_kernel,
        "dequant_sum_requant": k.dequant_sum_requant_kernel,
        "dequant_sum_hadamard": k.dequant_sum_hadamard_kernel,
    }


def _noise_args(
    numel: int, rounding: Rounding, noise: Tensor | None, device: torch.device
) -> tuple[int, Tensor]:
    if noise is not None:
        if noise.numel() != numel:
            raise ValueError(f"noise has {noise.numel()} values, expected {numel}.")
        return _NOISE_TENSOR, noise.reshape(-1).float().contiguous()
    dummy = torch.empty(1, device=device, dtype=torch.float32)
    if rounding == "stochastic":
        return _NOISE_RANDOM, dummy
    if rounding == "nearest":
        return _NOISE_NEAREST, dummy
    raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}.")


def _wire_view(payload: Tensor, bits: int) -> Tensor:
    return payload if bits == 4 else payload.view(torch.int8)


def encode(
    x: Tensor,
    bits: int,
    group_size: int,
    rounding: Rounding = "stochastic",
    seed: int = 0,
    noise: Tensor | None = None,
    reference: Tensor | None = None,
    hadamard_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused (subtract) (Hadamard) quantise (pack): returns ``(payload uint8, scales fp32)`` like the reference.

    Args:
        x: contiguous 1-D float tensor (fp32/bf16/fp16), a whole number of groups.
        bits: 4 or 8.
        group_size: values per scale, a power of two.
        rounding: ``"stochastic"`` (offsets from ``tl.rand(seed, index)``) or ``"nearest"``.
        seed: seed of the in-kernel random stream for stochastic rounding.
        noise: explicit rounding offsets (overrides ``rounding``), for bit-exact tests against the reference.
        reference: when given, quantise ``x - reference`` (qWD).
        hadamard_size: when given, apply the block Hadamard transform before quantising (TLq-HS).
    """
    kernels = _kernels()
    _pow2(group_size, "group_size")
    x = x.reshape(-1).contiguous()
    n = x.numel()
    if n % group_size:
        raise ValueError(f"{n} values are not a whole number of groups of {group_size}; pad with zeros.")
    hb = hadamard_size or 2
    if hadamard_size is not None:
        _pow2(hadamard_size, "hadamard_size")
        if group_size % hadamard_size:
            raise ValueError(
                f"group_size ({group_size}) must be a multiple of hadamard_size ({hadamard_size})."
            )
    h = hadamard_matrix(hb, device=x.device)
    if reference is not None:
        reference = reference.reshape(-1).contiguous()
        if reference.numel() != n:
            raise ValueError(f"reference has {reference.numel()} values, x has {n}.")
    mode, noise_t = _noise_args(n, rounding, noise, x.device)
    payload = torch.empty(payload_bytes(n, bits), dtype=torch.uint8, device=x.device)
    scales = torch.empty(n // group_size, dtype=torch.float32, device=x.device)
    grid = (n // group_size,)
    kernels["encode"][grid](
        x, reference if reference is not None else x, h, noise_t, _wire_view(payload, bits), scales, seed,
        GROUP=group_size, HB=hb, QMAX=qmax(bits), HAS_REF=reference is not None,
        HADAMARD=hadamard_size is not None, NOISE=mode, PACK=bits == 4,
    )  # fmt: skip
    return payload, scales


def dequantize_add_(target: Tensor, payload: Tensor, scales: Tensor, bits: int, group_size: int) -> Tensor:
    """Fused unpack + dequantise + ``target += delta`` (in place, fp32 arithmetic). Returns ``target``.

    Args:
        target: contiguous 1-D weights (fp32/bf16/fp16).
        payload: ``uint8`` wire bytes.
        scales: fp32 scales.
        bits: 4 or 8.
        group_size: values per scale, a power of two.
    """
    kernels = _kernels()
    _pow2(group_size, "group_size")
    if not target.is_contiguous() or target.dim() != 1:
        raise ValueError("dequantize_add_ needs a contiguous 1-D target.")
    n = target.numel()
    if payload.numel() != payload_bytes(n, bits) or scales.numel() * group_size != n:
        raise ValueError(f"payload/scales do not describe {n} values at {bits} bits, group {group_size}.")
    kernels["dequant_add"][(n // group_size,)](
        _wire_view(payload.contiguous(), bits),
        scales.contiguous(),
        target,
        GROUP=group_size,
        PACK=bits == 4,
        BF16=target.dtype == torch.bfloat16,
    )
    return target


def _check_rows(payloads: Tensor, scales: Tensor, bits: int, group_in: int) -> tuple[int, int]:
    if payloads.dim() != 2 or scales.dim() != 2 or payloads.shape[0] != scales.shape[0]:
        raise ValueError("payloads and scales must be (K, ...) tensors with the same K.")
    n = payloads.shape[1] * (2 if bits == 4 else 1)
    if scales.shape[1] * group_in != n:
        raise ValueError(f"{scales.shape[1]} scales per row do not cover {n} values with group {group_in}.")
    return payloads.shape[0], n


def dequantize_sum_requantize(
    payloads: Tensor,
    scales: Tensor,
    bits_in: int,
    group_in: int,
    bits_out: int,
    group_out: int,
    rounding: Rounding = "stochastic",
    seed: int = 0,
    noise: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused dequantise ``K`` contributions + sum + re-quantise (the TLq intra->inter step).

    Args:
        payloads: ``(K, nbytes)`` ``uint8``.
        scales: ``(K, ngroups)`` fp32.
        bits_in: bits of the inputs.
        group_in: group size of the inputs.
        bits_out: bits of the output.
        group_out: group size of the output, a power of two.
        rounding: ``"stochastic"`` or ``"nearest"``.
        seed: seed for in-kernel stochastic rounding.
        noise: explicit rounding offsets.
    """
    kernels = _kernels()
    _pow2(group_out, "group_size")
    k, n = _check_rows(payloads, scales, bits_in, group_in)
    if n % group_out:
        raise ValueError(f"{n} values are not a whole number of output groups of {group_out}.")
    device = payloads.device
    mode, noise_t = _noise_args(n, rounding, noise, device)
    payload = torch.empty(payload_bytes(n, bits_out), dtype=torch.uint8, device=device)
    out_scales = torch.empty(n // group_out, dtype=torch.float32, device=device)
    kernels["dequant_sum_requant"][(n // group_out,)](
        _wire_view(payloads.contiguous(), bits_in), scales.contiguous(), noise_t, _wire_view(payload, bits_out),
        out_scales, seed, k, payloads.shape[1], scales.shape[1],
        GROUP=group_out, GROUP_IN=group_in, PACK_IN=bits_in == 4, QMAX=qmax(bits_out), NOISE=mode,
        PACK=bits_out == 4,
    )  # fmt: skip
    return payload, out_scales


def dequantize_sum_hadamard(
    payloads: Tensor, scales: Tensor, bits: int, group_size: int, hadamard_size: int | None = 32
) -> Tensor:
    """Fused dequantise ``K`` contributions + sum (+ ``H`` and ``/ hadamard_size``): the last TLq(-HS) step.

    Args:
        payloads: ``(K, nbytes)`` ``uint8``.
        scales: ``(K, ngroups)`` fp32.
        bits: bits of the inputs.
        group_size: group size of the inputs, a power of two (also the tile of the output).
        hadamard_size: Hadamard block, or ``None`` for dequantise + sum only.
    """
    kernels = _kernels()
    _pow2(group_size, "group_size")
    k, n = _check_rows(payloads, scales, bits, group_size)
    hb = hadamard_size or 2
    if hadamard_size is not None:
        _pow2(hadamard_size, "hadamard_size")
        if group_size % hadamard_size:
            raise ValueError(
                f"group_size ({group_size}) must be a multiple of hadamard_size ({hadamard_size})."
            )
    out = torch.empty(n, dtype=torch.float32, device=payloads.device)
    kernels["dequant_sum_hadamard"][(n // group_size,)](
        _wire_view(payloads.contiguous(), bits), scales.contiguous(), hadamard_matrix(hb, device=payloads.device),
        out, k, payloads.shape[1], scales.shape[1], 1.0 / hb,
        GROUP=group_size, GROUP_IN=group_size, PACK_IN=bits == 4, HB=hb, HADAMARD=hadamard_size is not None,
    )  # fmt: skip
    return out
