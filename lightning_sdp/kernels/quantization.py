"""Group-wise symmetric quantisation for SDP4Bit communication: the plain-torch reference.

SDP4Bit (Jia et al., "SDP4Bit: Toward 4-bit Communication Quantization in Sharded Data Parallelism for LLM
Training", NeurIPS 2024, arXiv 2410.15526) sends weights and gradients as low-bit integer codes plus one fp32
scale per group of ``G`` contiguous values:

* ``scale = absmax(group) / (2^(b-1) - 1)`` (an all-zero group gets scale 1 and codes 0),
* ``code = floor(x / scale + u)`` clamped to ``±(2^(b-1) - 1)`` (±7 for 4 bits, ±127 for 8 bits), where ``u`` is
  uniform in ``[0, 1)`` for stochastic rounding (unbiased: ``E[code * scale] = x``) or ``0.5`` for
  round-to-nearest,
* two 4-bit codes share one byte: byte ``i`` holds code ``2i`` in its low nibble and code ``2i + 1`` in its high
  nibble.

Every function here is the reference for a Triton kernel in :mod:`lightning_sdp.kernels.triton_quant`; the fused
steps of the paper (subtract + quantise, dequantise + add, Hadamard + quantise, dequantise + sum + re-quantise,
dequantise + sum + inverse Hadamard) have a reference each so the kernels can be compared on random inputs.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lightning_sdp.kernels.hadamard import hadamard_transform

Rounding = Literal["stochastic", "nearest"]
SUPPORTED_BITS = (4, 8)


def qmax(bits: int) -> int:
    """Largest code magnitude for ``bits``-bit symmetric quantisation (7 for 4 bits, 127 for 8 bits)."""
    _check_bits(bits)
    return 2 ** (bits - 1) - 1


def payload_bytes(numel: int, bits: int) -> int:
    """Bytes taken by the codes of ``numel`` values at ``bits`` bits (4-bit codes are packed two per byte)."""
    _check_bits(bits)
    return numel // 2 if bits == 4 else numel


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"Quantisation supports {SUPPORTED_BITS} bits, got bits={bits}.")


def _check_groups(numel: int, group_size: int, what: str = "input") -> None:
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}.")
    if numel % group_size != 0:
        raise ValueError(
            f"The {what} has {numel} elements, which is not a whole number of quantisation groups of {group_size}. "
            "Pad the buffer with zeros to a multiple of the group size."
        )


def rounding_noise(
    numel: int,
    rounding: Rounding,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """The ``u`` added before ``floor``: uniform ``[0, 1)`` for stochastic rounding, 0.5 for nearest.

    Args:
        numel: number of values.
        rounding: ``"stochastic"`` or ``"nearest"``.
        generator: seeded generator for stochastic rounding (reproducible runs); the global one when ``None``.
        device: device of the result.
    """
    if rounding == "stochastic":
        return torch.rand(numel, generator=generator, device=device, dtype=torch.float32)
    if rounding == "nearest":
        return torch.full((numel,), 0.5, device=device, dtype=torch.float32)
    raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}.")


def quantize(
    x: Tensor,
    bits: int,
    group_size: int,
    rounding: Rounding = "stochastic",
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Quantise a flat tensor group-wise to ``bits``-bit integer codes.

    Args:
        x: 1-D floating tensor whose length is a multiple of ``group_size``.
        bits: 4 or 8.
        group_size: number of contiguous values sharing one fp32 scale.
        rounding: ``"stochastic"`` (default, unbiased) or ``"nearest"``.
        generator: generator for the stochastic rounding noise.
        noise: explicit rounding offsets in ``[0, 1)`` (overrides ``rounding``/``generator``; used to compare
            kernels bit for bit).

    Returns:
        ``(codes, scales)``: ``int8`` codes of ``x``'s length and ``float32`` scales, one per group.
    """
    _check_bits(bits)
    x = x.reshape(-1)
    _check_groups(x.numel(), group_size)
    level = float(qmax(bits))
    groups = x.float().view(-1, group_size)
    # absmax without an |x| temporary: one pass for the min and the max of each group
    low, high = torch.aminmax(groups, dim=1)
    absmax = torch.maximum(high, low.neg())
    scales = torch.where(absmax > 0, absmax / level, torch.ones_like(absmax))
    scaled = groups / scales[:, None]  # the only float temporary; what follows works in place
    if noise is not None:
        scaled.add_(noise.view(-1, group_size))
    elif rounding == "stochastic":
        scaled.add_(rounding_noise(x.numel(), rounding, generator, x.device).view(-1, group_size))
    elif rounding == "nearest":
        scaled.add_(0.5)
    else:
        raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}.")
    codes = scaled.floor_().clamp_(-level, level)
    return codes.to(torch.int8).view(-1), scales


def dequantize(codes: Tensor, scales: Tensor, group_size: int) -> Tensor:
    """Inverse of :func:`quantize`: ``codes * scale`` per group, as ``float32``.

    Args:
        codes: ``int8`` codes (one per value).
        scales: ``float32`` scales, one per group.
        group_size: values per group.
    """
    codes = codes.reshape(-1)
    _check_groups(codes.numel(), group_size, "code tensor")
    if scales.numel() * group_size != codes.numel():
        raise ValueError(
            f"{codes.numel()} codes need {codes.numel() // group_size} scales for group_size={group_size}, "
            f"got {scales.numel()}."
        )
    return (codes.view(-1, group_size).float() * scales.float().view(-1, 1)).view(-1)


def pack_int4(codes: Tensor) -> Tensor:
    """Pack signed 4-bit codes (``int8`` in ``[-8, 7]``) two per byte: low nibble = even index, high = odd index.

    Args:
        codes: ``int8`` tensor with an even number of elements.
    """
    codes = codes.reshape(-1)
    if codes.numel() % 2:
        raise ValueError(f"pack_int4 needs an even number of codes, got {codes.numel()}.")
    pairs = codes.view(torch.uint8).view(-1, 2)
    return (pairs[:, 0] & 0xF) | (pairs[:, 1] << 4)  # uint8 arithmetic: the shift drops the high nibble


def unpack_int4(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_int4`: ``uint8`` bytes to twice as many sign-extended ``int8`` codes."""
    b = packed.reshape(-1).view(torch.int8)
    out = torch.empty(b.numel(), 2, dtype=torch.int8, device=b.device)
    torch.bitwise_left_shift(b, 4, out=out[:, 0]).bitwise_right_shift_(4)  # arithmetic shift: sign-extended
    torch.bitwise_right_shift(b, 4, out=out[:, 1])
    return out.view(-1)


def encode(
    x: Tensor,
    bits: int,
    group_size: int,
    rounding: Rounding = "stochastic",
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Quantise and lay out for the wire: ``(payload uint8, scales fp32)``; 4-bit codes are packed.

    Args:
        x: 1-D floating tensor, a whole number of groups.
        bits: 4 or 8.
        group_size: values per scale.
        rounding: ``"stochastic"`` or ``"nearest"``.
        generator: generator for stochastic rounding.
        noise: explicit rounding offsets (see :func:`quantize`).
    """
    codes, scales = quantize(x, bits, group_size, rounding, generator, noise)
    payload = pack_int4(codes) if bits == 4 else codes.view(torch.uint8)
    return payload, scales


def decode(payload: Tensor, scales: Tensor, bits: int, group_size: int) -> Tensor:
    """Inverse of :func:`encode`, as ``float32``.

    Args:
        payload: ``uint8`` bytes from :func:`encode`.
        scales: ``float32`` scales.
        bits: 4 or 8.
        group_size: values per scale.
    """
    _check_bits(bits)
    payload = payload.reshape(-1)
    codes = unpack_int4(payload) if bits == 4 else payload.view(torch.int8)
    _check_groups(codes.numel(), group_size, "code tensor")
    if scales.numel() * group_size != codes.numel():
        raise ValueError(
            f"{codes.numel()} codes need {codes.numel() // group_size} scales for group_size={group_size}, "
            f"got {scales.numel()}."
        )
    out = codes.view(-1, group_size).to(torch.float32)
    return out.mul_(scales.float().view(-1, 1)).view(-1)


# ----------------------------------------------------------------------------------------------------------------
# References of the fused steps
# ----------------------------------------------------------------------------------------------------------------


def quantize_difference(
    master: Tensor,
    reference: Tensor,
    bits: int,
    group_size: int,
    rounding: Rounding = "stochastic",
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """qWD encode: ``encode(master - reference)`` with the difference taken in fp32.

    Args:
        master: exact (fp32) weights of this rank's shard.
        reference: the reconstructed weights every rank already holds (any float dtype).
        bits: 4 or 8.
        group_size: values per scale.
        rounding: ``"stochastic"`` or ``"nearest"``.
        generator: generator for stochastic rounding.
        noise: explicit rounding offsets.
    """
    if master.numel() != reference.numel():
        raise ValueError(f"master ({master.numel()}) and reference ({reference.numel()}) differ in size.")
    diff = master.reshape(-1).float() - reference.reshape(-1).float()
    return encode(diff, bits, group_size, rounding, generator, noise)


def dequantize_add_(target: Tensor, payload: Tensor, scales: Tensor, bits: int, group_size: int) -> Tensor:
    """qWD decode: ``target += decode(payload)`` (sum in fp32, stored in ``target``'s dtype). Returns ``target``.

    Args:
        target: 1-D weights to update in place.
        payload: wire bytes.
        scales: fp32 scales.
        bits: 4 or 8.
        group_size: values per scale.
    """
    delta = decode(payload, scales, bits, group_size)
    if delta.numel() != target.numel():
        raise ValueError(f"payload decodes to {delta.numel()} values, target has {target.numel()}.")
    if target.dtype == torch.float32:
        target.add_(delta)
    else:
        target.copy_(target.float() + delta)
    return target


def hadamard_quantize(
    x: Tensor,
    bits: int,
    group_size: int,
    hadamard_size: int = 32,
    rounding: Rounding = "stochastic",
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """TLq-HS first step: ``encode(H x)`` with the unnormalised ±1 Hadamard transform on blocks of ``hadamard_size``.

    Args:
        x: 1-D gradient buffer, a whole number of groups; ``group_size`` must be a multiple of ``hadamard_size``.
        bits: 4 or 8.
        group_size: values per scale.
        hadamard_size: Hadamard block (power of two).
        rounding: ``"stochastic"`` or ``"nearest"``.
        generator: generator for stochastic rounding.
        noise: explicit rounding offsets.
    """
    if group_size % hadamard_size:
        raise ValueError(f"group_size ({group_size}) must be a multiple of hadamard_size ({hadamard_size}).")
    return encode(hadamard_transform(x.float(), hadamard_size), bits, group_size, rounding, generator, noise)


def dequantize_sum(payloads: Tensor, scales: Tensor, bits: int, group_size: int) -> Tensor:
    """Sum of ``K`` decoded contributions, in fp32 and in order ``k = 0 .. K-1``.

    Args:
        payloads: ``(K, nbytes)`` ``uint8``.
        scales: ``(K, ngroups)`` fp32.
        bits: 4 or 8.
        group_size: values per scale.
    """
    total: Tensor | None = None
    for k in range(payloads.shape[0]):
        part = decode(payloads[k], scales[k], bits, group_size)
        total = part if total is None else total.add_(part)
    if total is None:
        raise ValueError("dequantize_sum needs at least one contribution.")
    return total


def dequantize_sum_requantize(
    payloads: Tensor,
    scales: Tensor,
    bits_in: int,
    group_in: int,
    bits_out: int,
    group_out: int,
    rounding: Rounding = "stochastic",
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """TLq middle step: decode ``K`` contributions, sum them and encode the sum again (e.g. 8 bits in, 4 bits out).

    Args:
        payloads: ``(K, nbytes)`` ``uint8`` received from ``K`` peers.
        scales: ``(K, ngroups)`` fp32.
        bits_in: bits of the received codes.
        group_in: group size of the received codes.
        bits_out: bits of the output codes.
        group_out: group size of the output codes.
        rounding: ``"stochastic"`` or ``"nearest"``.
        generator: generator for stochastic rounding.
        noise: explicit rounding offsets.
    """
    total = dequantize_sum(payloads, scales, bits_in, group_in)
    return encode(total, bits_out, group_out, rounding, generator, noise)


def dequantize_sum_hadamard(
    payloads: Tensor, scales: Tensor, bits: int, group_size: int, hadamard_size: int | None = 32
) -> Tensor:
    """TLq-HS last step: decode and sum ``K`` contributions, then apply ``H`` and divide by ``hadamard_size``.

    Since ``H H = n I`` this undoes the forward transform applied before the first quantisation; sums commute with
    ``H`` so the inverse is applied once, to the total. With ``hadamard_size=None`` no transform is applied.

    Args:
        payloads: ``(K, nbytes)`` ``uint8``.
        scales: ``(K, ngroups)`` fp32.
        bits: 4 or 8.
        group_size: values per scale.
        hadamard_size: Hadamard block, or ``None`` for plain dequantise + sum.
    """
    total = dequantize_sum(payloads, scales, bits, group_size)
    if hadamard_size is None:
        return total
    return hadamard_transform(total, hadamard_size).div_(hadamard_size)
