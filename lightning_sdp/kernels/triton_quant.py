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

The functions take the same :class:`~lightning_sdp.kernels.quantization.QuantFormat` and
:class:`~lightning_sdp.kernels.quantization.RoundingSource` as the reference. One program handles one quantisation
group (a power of two, e.g. 128 or 2048 values). Stochastic rounding either reads the source's explicit offsets
(``noise``, for bit-exact comparisons with the reference) or draws them in the kernel with
``tl.rand(source.seed, offset)`` (no extra memory traffic). The kernels run on CUDA tensors, and on CPU tensors under
``TRITON_INTERPRET=1`` (how the test suite checks them). ``triton`` is imported lazily.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from lightning_sdp._imports import require
from lightning_sdp.kernels.hadamard import hadamard_matrix
from lightning_sdp.kernels.quantization import QuantFormat, Rounding, RoundingSource

# How the kernels get their rounding offsets (the ``NOISE`` constexpr of ``_quantize_store``).
_NOISE_NEAREST, _NOISE_TENSOR, _NOISE_RANDOM = 0, 1, 2
# Compile without fusing a * b + c into one FMA: the fused form rounds once, torch's reference (and the CPU
# interpreter) twice, so ``target + code * scale`` would differ in the last bit on a GPU (the kernels are memory-bound:
# an FMA saves nothing measurable). The interpreter ignores the option.
_EXACT = {"enable_fp_fusion": False}
# Values per program: each program quantises TILE // group_size whole groups (at least one).
_TILE = 4096


def _rows(group_size: int) -> int:
    return max(1, _TILE // group_size)


def _grid(n_groups: int, group_size: int) -> tuple[int]:
    return (-(-n_groups // _rows(group_size)),)


def _pow2(n: int, what: str) -> None:
    if n < 2 or n & (n - 1):
        raise ValueError(f"The Triton kernels need {what} to be a power of two >= 2, got {n}.")


def _hadamard_block(group_size: int, hadamard_size: int | None) -> int:
    """The Hadamard block the kernel tiles with (2, unused, when there is no transform), validated."""
    if hadamard_size is None:
        return 2
    _pow2(hadamard_size, "hadamard_size")
    if group_size % hadamard_size:
        raise ValueError(f"group_size ({group_size}) must be a multiple of hadamard_size ({hadamard_size}).")
    return hadamard_size


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


def _noise_args(numel: int, rounding: RoundingSource | Rounding, device: torch.device) -> tuple[int, Tensor, int]:
    """``(NOISE mode, offsets tensor or a dummy, seed)`` of the kernel call for ``rounding``."""
    source = RoundingSource.of(rounding)
    noise = source.explicit_noise(numel)
    if noise is not None:
        return _NOISE_TENSOR, noise.contiguous(), source.seed
    dummy = torch.empty(1, device=device, dtype=torch.float32)
    return (_NOISE_RANDOM if source.mode == "stochastic" else _NOISE_NEAREST), dummy, source.seed


def _wire_view(payload: Tensor, fmt: QuantFormat) -> Tensor:
    return payload if fmt.bits == 4 else payload.view(torch.int8)


def encode(
    x: Tensor,
    fmt: QuantFormat,
    rounding: RoundingSource | Rounding = "stochastic",
    reference: Tensor | None = None,
    hadamard_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused (subtract) (Hadamard) quantise (pack): returns ``(payload uint8, scales fp32)`` like the reference.

    Args:
        x: contiguous 1-D float tensor (fp32/bf16/fp16), a whole number of groups.
        fmt: bits and group size (a power of two).
        rounding: a :class:`RoundingSource` (stochastic offsets from ``tl.rand(seed, index)``, or its explicit
            ``noise``) or its mode.
        reference: when given, quantise ``x - reference`` (qWD).
        hadamard_size: when given, apply the block Hadamard transform before quantising (TLq-HS).
    """
    kernels = _kernels()
    _pow2(fmt.group_size, "group_size")
    x = x.reshape(-1).contiguous()
    n = x.numel()
    fmt.num_groups(n)
    hb = _hadamard_block(fmt.group_size, hadamard_size)
    h = hadamard_matrix(hb, device=x.device)
    if reference is not None:
        reference = reference.reshape(-1).contiguous()
        if reference.numel() != n:
            raise ValueError(f"reference has {reference.numel()} values, x has {n}.")
    mode, noise_t, seed = _noise_args(n, rounding, x.device)
    payload = torch.empty(fmt.payload_bytes(n), dtype=torch.uint8, device=x.device)
    scales = torch.empty(n // fmt.group_size, dtype=torch.float32, device=x.device)
    n_groups = n // fmt.group_size
    kernels["encode"][_grid(n_groups, fmt.group_size)](
        x,
        reference if reference is not None else x,
        h,
        noise_t,
        _wire_view(payload, fmt),
        scales,
        seed,
        n_groups,
        GROUP=fmt.group_size,
        ROWS=_rows(fmt.group_size),
        HB=hb,
        QMAX=fmt.qmax,
        HAS_REF=reference is not None,
        HADAMARD=hadamard_size is not None,
        NOISE=mode,
        PACK=fmt.bits == 4,
        **_EXACT,
    )
    return payload, scales


def dequantize_add_(target: Tensor, payload: Tensor, scales: Tensor, fmt: QuantFormat) -> Tensor:
    """Fused unpack + dequantise + ``target += delta`` (in place, fp32 arithmetic). Returns ``target``.

    Args:
        target: contiguous 1-D weights (fp32/bf16/fp16).
        payload: ``uint8`` wire bytes.
        scales: fp32 scales.
        fmt: the format of the payload (group size a power of two).
    """
    kernels = _kernels()
    _pow2(fmt.group_size, "group_size")
    if not target.is_contiguous() or target.dim() != 1:
        raise ValueError("dequantize_add_ needs a contiguous 1-D target.")
    n = target.numel()
    if payload.numel() != fmt.payload_bytes(n) or scales.numel() * fmt.group_size != n:
        raise ValueError(f"payload/scales do not describe {n} values at {fmt.bits} bits, group {fmt.group_size}.")
    kernels["dequant_add"][_grid(n // fmt.group_size, fmt.group_size)](
        _wire_view(payload.contiguous(), fmt),
        scales.contiguous(),
        target,
        n // fmt.group_size,
        GROUP=fmt.group_size,
        ROWS=_rows(fmt.group_size),
        PACK=fmt.bits == 4,
        BF16=target.dtype == torch.bfloat16,
        **_EXACT,
    )
    return target


def dequantize_sum_requantize(
    payloads: Tensor,
    scales: Tensor,
    fmt_in: QuantFormat,
    fmt_out: QuantFormat,
    rounding: RoundingSource | Rounding = "stochastic",
) -> tuple[Tensor, Tensor]:
    """Fused dequantise ``K`` contributions + sum + re-quantise (the TLq intra->inter step).

    Args:
        payloads: ``(K, nbytes)`` ``uint8``.
        scales: ``(K, ngroups)`` fp32.
        fmt_in: format of the inputs.
        fmt_out: format of the output (group size a power of two).
        rounding: a :class:`RoundingSource` or its mode.
    """
    kernels = _kernels()
    _pow2(fmt_out.group_size, "group_size")
    k, n = fmt_in.check_rows(payloads, scales)
    fmt_out.num_groups(n, "sum")
    device = payloads.device
    mode, noise_t, seed = _noise_args(n, rounding, device)
    payload = torch.empty(fmt_out.payload_bytes(n), dtype=torch.uint8, device=device)
    out_scales = torch.empty(n // fmt_out.group_size, dtype=torch.float32, device=device)
    kernels["dequant_sum_requant"][_grid(n // fmt_out.group_size, fmt_out.group_size)](
        _wire_view(payloads.contiguous(), fmt_in),
        scales.contiguous(),
        noise_t,
        _wire_view(payload, fmt_out),
        out_scales,
        seed,
        k,
        payloads.shape[1],
        scales.shape[1],
        n // fmt_out.group_size,
        GROUP=fmt_out.group_size,
        ROWS=_rows(fmt_out.group_size),
        GROUP_IN=fmt_in.group_size,
        PACK_IN=fmt_in.bits == 4,
        QMAX=fmt_out.qmax,
        NOISE=mode,
        PACK=fmt_out.bits == 4,
        **_EXACT,
    )
    return payload, out_scales


def dequantize_sum_hadamard(
    payloads: Tensor, scales: Tensor, fmt: QuantFormat, hadamard_size: int | None = 32
) -> Tensor:
    """Fused dequantise ``K`` contributions + sum (+ ``H`` and ``/ hadamard_size``): the last TLq(-HS) step.

    Args:
        payloads: ``(K, nbytes)`` ``uint8``.
        scales: ``(K, ngroups)`` fp32.
        fmt: format of the inputs (group size a power of two, also the tile of the output).
        hadamard_size: Hadamard block, or ``None`` for dequantise + sum only.
    """
    kernels = _kernels()
    _pow2(fmt.group_size, "group_size")
    k, n = fmt.check_rows(payloads, scales)
    hb = _hadamard_block(fmt.group_size, hadamard_size)
    out = torch.empty(n, dtype=torch.float32, device=payloads.device)
    kernels["dequant_sum_hadamard"][_grid(n // fmt.group_size, fmt.group_size)](
        _wire_view(payloads.contiguous(), fmt),
        scales.contiguous(),
        hadamard_matrix(hb, device=payloads.device),
        out,
        k,
        payloads.shape[1],
        scales.shape[1],
        1.0 / hb,
        n // fmt.group_size,
        GROUP=fmt.group_size,
        ROWS=_rows(fmt.group_size),
        GROUP_IN=fmt.group_size,
        PACK_IN=fmt.bits == 4,
        HB=hb,
        HADAMARD=hadamard_size is not None,
        **_EXACT,
    )
    return out
