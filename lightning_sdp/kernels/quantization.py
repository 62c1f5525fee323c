"""Group-wise symmetric quantisation for SDP4Bit communication: the plain-torch reference.

SDP4Bit (Jia et al., "SDP4Bit: Toward 4-bit Communication Quantization in Sharded Data Parallelism for LLM
Training", NeurIPS 2024, arXiv 2410.15526) sends weights and gradients as low-bit integer codes plus one fp32
scale per group of ``G`` contiguous values:

* ``scale = absmax(group) / (2^(b-1) - 1)`` (an all-zero group gets scale 1 and codes 0; a group holding NaN or
  Inf gets a non-finite scale, which is how callers detect it),
* ``code = floor(x / scale + u)`` clamped to ``±(2^(b-1) - 1)`` (±7 for 4 bits, ±127 for 8 bits), where ``u`` is
  uniform in ``[0, 1)`` for stochastic rounding (unbiased: ``E[code * scale] = x``) or ``0.5`` for
  round-to-nearest,
* two 4-bit codes share one byte: byte ``i`` holds code ``2i`` in its low nibble and code ``2i + 1`` in its high
  nibble.

Every function here is the reference for a Triton kernel in :mod:`lightning_sdp.kernels.triton_quant`; the fused
steps of the paper (subtract + quantise, dequantise + add, Hadamard + quantise, dequantise + sum + re-quantise,
dequantise + sum + inverse Hadamard) have a reference each so the kernels can be compared on random inputs.

Every function takes the wire format as one :class:`QuantFormat` (bits and group size, validated once) and the
rounding as one :class:`RoundingSource` (or just its mode, ``"stochastic"`` / ``"nearest"``): the offsets ``u``
come from that one place for the reference and the Triton kernels alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from lightning_sdp.kernels.hadamard import hadamard_transform

Rounding = Literal["stochastic", "nearest"]
SUPPORTED_BITS = (4, 8)
ROUNDING_MODES: tuple[Rounding, ...] = ("stochastic", "nearest")


def qmax(bits: int) -> int:
    """Largest code magnitude of ``bits``-bit symmetric codes (7 for 4 bits, 127 for 8 bits)."""
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"Quantisation supports {SUPPORTED_BITS} bits, got bits={bits!r}.")
    return 2 ** (bits - 1) - 1


@dataclass(frozen=True)
class QuantFormat:
    """A group-wise symmetric integer format: ``bits``-bit codes, one fp32 scale per ``group_size`` values.

    Args:
        bits: 4 (two codes packed per byte) or 8.
        group_size: contiguous values sharing one scale; even for 4 bits, so that a group is whole bytes.

    Raises:
        ValueError: when ``bits`` is not supported or ``group_size`` is not a positive (even, for 4 bits) integer.
    """

    bits: int
    group_size: int

    def __post_init__(self) -> None:
        qmax(self.bits)  # validates the bits
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {self.group_size!r}.")
        if self.bits == 4 and self.group_size % 2:
            raise ValueError(
                f"4-bit codes are packed two per byte, so group_size must be even, got {self.group_size}. "
                "Use an even group size (the paper uses 128 for gradients and 2048 for weights)."
            )

    @property
    def qmax(self) -> int:
        """Largest code magnitude (7 for 4 bits, 127 for 8 bits)."""
        return qmax(self.bits)

    @property
    def bits_per_value(self) -> float:
        """Bits on the wire per value, the codes and the group's share of its fp32 scale."""
        return self.bits + 32.0 / self.group_size

    def payload_bytes(self, numel: int) -> int:
        """Bytes taken by the codes of ``numel`` values (4-bit codes are packed two per byte)."""
        if self.bits == 8:
            return numel
        if numel % 2:
            raise ValueError(f"{numel} 4-bit codes do not fill whole bytes; pass an even number of values.")
        return numel // 2

    def num_groups(self, numel: int, what: str = "input") -> int:
        """Number of groups in ``numel`` values; raises when ``numel`` is not a whole number of groups."""
        if numel % self.group_size:
            raise ValueError(
                f"The {what} has {numel} elements, which is not a whole number of quantisation groups of "
                f"{self.group_size}. Pad the buffer with zeros to a multiple of the group size."
            )
        return numel // self.group_size

    def check_scales(self, numel: int, scales: Tensor) -> None:
        """Raise unless ``scales`` holds one scale per group of ``numel`` code values."""
        groups = self.num_groups(numel, "code tensor")
        if scales.numel() != groups:
            raise ValueError(
                f"{numel} codes need {groups} scales for group_size={self.group_size}, got {scales.numel()}."
            )

    def check_rows(self, payloads: Tensor, scales: Tensor) -> tuple[int, int]:
        """Raise unless ``payloads`` ``(K, nbytes)`` and ``scales`` ``(K, ngroups)`` are ``K >= 1`` matching wire rows;
        return ``(K, values per row)`` (the fused codecs' receive steps take such rows)."""
        if payloads.dim() != 2 or scales.dim() != 2 or payloads.shape[0] != scales.shape[0] or payloads.shape[0] < 1:
            raise ValueError(
                f"payloads and scales must be (K, ...) with the same K >= 1, got {tuple(payloads.shape)} and "
                f"{tuple(scales.shape)}."
            )
        numel = 2 * payloads.shape[1] if self.bits == 4 else payloads.shape[1]
        self.check_scales(numel, scales[0])
        return payloads.shape[0], numel


@dataclass(frozen=True, eq=False)
class RoundingSource:
    """Where the offsets ``u`` added before ``floor`` come from: the one home of stochastic and nearest rounding.

    Args:
        mode: ``"stochastic"`` (``u`` uniform in ``[0, 1)``, unbiased) or ``"nearest"`` (``u = 0.5``).
        generator: torch generator of the stochastic offsets of the reference path (the global one when ``None``).
        seed: seed of the in-kernel random stream of the Triton path (``tl.rand(seed, index)``).
        noise: explicit offsets in ``[0, 1)``, one per value; they override ``mode`` (bit-exact comparisons of the
            reference with the kernels).
    """

    mode: Rounding = "stochastic"
    generator: torch.Generator | None = None
    seed: int = 0
    noise: Tensor | None = None

    def __post_init__(self) -> None:
        if self.mode not in ROUNDING_MODES:
            raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {self.mode!r}.")

    @classmethod
    def of(cls, rounding: RoundingSource | Rounding) -> RoundingSource:
        """``rounding`` itself, or a source of the mode ``rounding`` names (global generator, seed 0)."""
        return rounding if isinstance(rounding, RoundingSource) else cls(rounding)

    def explicit_noise(self, numel: int) -> Tensor | None:
        """The explicit offsets as a flat fp32 tensor of ``numel`` values, or ``None`` when there are none."""
        if self.noise is None:
            return None
        if self.noise.numel() != numel:
            raise ValueError(f"noise has {self.noise.numel()} values, expected {numel}.")
        return self.noise.reshape(-1).float()

    def offsets(self, numel: int, device: torch.device | str | None = None) -> Tensor:
        """The ``numel`` offsets ``u`` as an fp32 tensor (explicit noise, uniform draws, or 0.5)."""
        noise = self.explicit_noise(numel)
        if noise is not None:
            return noise.to(device) if device is not None else noise
        if self.mode == "stochastic":
            return torch.rand(numel, generator=self.generator, device=device, dtype=torch.float32)
        return torch.full((numel,), 0.5, device=device, dtype=torch.float32)

    def add_(self, scaled: Tensor) -> Tensor:
        """Add the offsets to ``scaled`` (fp32, any shape) in place and return it."""
        if self.noise is None and self.mode == "nearest":
            return scaled.add_(0.5)  # no offsets tensor for the deterministic mode
        return scaled.add_(self.offsets(scaled.numel(), scaled.device).view(scaled.shape))


_MASK64 = 2**64 - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix64_int(z: int) -> int:
    """The splitmix64 finaliser (Steele et al.) on a Python int taken modulo 2**64."""
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


# The per-offset hash: a Weyl step then Wellons' "lowbias32" mixer, all in 32-bit arithmetic so that the numba
# kernels' loops vectorise (AVX2 has 8-lane 32-bit multiplies and no 64-bit ones).
_MASK32 = 2**32 - 1
_WEYL32, _LOWBIAS1, _LOWBIAS2 = 0x9E3779B9, 0x7FEB352D, 0x846CA68B
_UNIT24 = 2.0**-24  # an offset keeps the top 24 bits of its hash: exact in float32


def counter_key(seed: int) -> int:
    """The 32-bit key of the counter stream of ``seed``: the top half of ``splitmix64`` of the seed."""
    return _splitmix64_int((int(seed) * _GOLDEN + 1) & _MASK64) >> 32


def counter_uniforms(seed: int, numel: int) -> Tensor:
    """Offsets ``0 .. numel-1`` of the counter-based stream of ``seed``: fp32 in ``[0, 1)``, 24 random bits each.

    Offset ``i`` is the top 24 bits of ``lowbias32((i * 0x9E3779B9 mod 2**32) XOR key)`` (``key`` from
    :func:`counter_key`), a hash of the seed and the index: any offset can be made on its own, by any thread, in
    any order, and distinct indices below ``2**32`` get distinct hashes. The key enters by XOR, not by addition,
    so that two seeds' streams are not shifted copies of one sequence. The numba codec draws its stochastic-rounding
    offsets this way; passing these as ``RoundingSource(noise=...)`` makes the reference compute the same codes.

    Args:
        seed: the call's seed (``RoundingSource.seed``).
        numel: number of offsets.
    """
    return _keyed_uniforms(counter_key(seed), numel)


def _keyed_uniforms(key: int, numel: int) -> Tensor:
    mask = np.uint64(_MASK32)
    z = ((np.arange(numel, dtype=np.uint64) * np.uint64(_WEYL32)) & mask) ^ np.uint64(key)
    z ^= z >> np.uint64(16)
    z = (z * np.uint64(_LOWBIAS1)) & mask
    z ^= z >> np.uint64(15)
    z = (z * np.uint64(_LOWBIAS2)) & mask
    z ^= z >> np.uint64(16)
    return torch.from_numpy((z >> np.uint64(8)).astype(np.float32) * np.float32(_UNIT24))


def quantize(x: Tensor, fmt: QuantFormat, rounding: RoundingSource | Rounding = "stochastic") -> tuple[Tensor, Tensor]:
    """Quantise a flat tensor group-wise to integer codes.

    Args:
        x: floating tensor (flattened), a whole number of groups.
        fmt: bits and group size.
        rounding: a :class:`RoundingSource`, or its mode (``"stochastic"``, the default, or ``"nearest"``).

    Returns:
        ``(codes, scales)``: ``int8`` codes of ``x``'s length and ``float32`` scales, one per group.
    """
    x = x.reshape(-1)
    fmt.num_groups(x.numel())
    level = float(fmt.qmax)
    groups = x.float().view(-1, fmt.group_size)
    # |x| then a row max: 1.2 ms for 3.2M values on one core, where aminmax(dim=1) without the temporary takes 6.5
    absmax = groups.abs().amax(dim=1)
    # a divisor on the device, not a Python number: CUDA divides by a host scalar as a multiply by its reciprocal,
    # which can differ from the division (here and in the fused kernels) in the last bit
    divisor = torch.full((), level, dtype=absmax.dtype, device=absmax.device)
    # an all-zero group gets scale 1; one holding NaN (or an overflow) keeps a non-finite scale the caller can see
    scales = torch.where(absmax == 0, torch.ones_like(absmax), absmax / divisor)
    scaled = groups / scales[:, None]  # the only float temporary; what follows works in place
    codes = RoundingSource.of(rounding).add_(scaled).floor_().clamp_(-level, level)
    return codes.to(torch.int8).view(-1), scales


def dequantize(codes: Tensor, scales: Tensor, fmt: QuantFormat) -> Tensor:
    """Inverse of :func:`quantize`: ``codes * scale`` per group, as ``float32``.

    Args:
        codes: ``int8`` codes (one per value).
        scales: ``float32`` scales, one per group.
        fmt: the format the codes were made with.
    """
    codes = codes.reshape(-1)
    fmt.check_scales(codes.numel(), scales)
    return (codes.view(-1, fmt.group_size).float() * scales.float().view(-1, 1)).view(-1)


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


def encode(x: Tensor, fmt: QuantFormat, rounding: RoundingSource | Rounding = "stochastic") -> tuple[Tensor, Tensor]:
    """Quantise and lay out for the wire: ``(payload uint8, scales fp32)``; 4-bit codes are packed.

    Args:
        x: floating tensor (flattened), a whole number of groups.
        fmt: bits and group size.
        rounding: a :class:`RoundingSource` or its mode.
    """
    codes, scales = quantize(x, fmt, rounding)
    payload = pack_int4(codes) if fmt.bits == 4 else codes.view(torch.uint8)
    return payload, scales


def decode(payload: Tensor, scales: Tensor, fmt: QuantFormat) -> Tensor:
    """Inverse of :func:`encode`, as ``float32``.

    Args:
        payload: ``uint8`` bytes from :func:`encode`.
        scales: ``float32`` scales.
        fmt: the format of the payload.
    """
    payload = payload.reshape(-1)
    codes = unpack_int4(payload) if fmt.bits == 4 else payload.view(torch.int8)
    fmt.check_scales(codes.numel(), scales)
    out = codes.view(-1, fmt.group_size).to(torch.float32)
    return out.mul_(scales.float().view(-1, 1)).view(-1)


# ----------------------------------------------------------------------------------------------------------------
# References of the fused steps
# ----------------------------------------------------------------------------------------------------------------


def quantize_difference(
    master: Tensor, reference: Tensor, fmt: QuantFormat, rounding: RoundingSource | Rounding = "stochastic"
) -> tuple[Tensor, Tensor]:
    """qWD encode: ``encode(master - reference)`` with the difference taken in fp32.

    Args:
        master: exact (fp32) weights of this rank's shard.
        reference: the reconstructed weights every rank already holds (any float dtype).
        fmt: bits and group size.
        rounding: a :class:`RoundingSource` or its mode.
    """
    if master.numel() != reference.numel():
        raise ValueError(f"master ({master.numel()}) and reference ({reference.numel()}) differ in size.")
    diff = master.reshape(-1).float() - reference.reshape(-1).float()
    return encode(diff, fmt, rounding)


def dequantize_add_(target: Tensor, payload: Tensor, scales: Tensor, fmt: QuantFormat) -> Tensor:
    """qWD decode: ``target += decode(payload)`` (sum in fp32, stored in ``target``'s dtype). Returns ``target``.

    Args:
        target: 1-D weights to update in place.
        payload: wire bytes.
        scales: fp32 scales.
        fmt: the format of the payload.
    """
    delta = decode(payload, scales, fmt)
    if delta.numel() != target.numel():
        raise ValueError(f"payload decodes to {delta.numel()} values, target has {target.numel()}.")
    if target.dtype == torch.float32:
        target.add_(delta)
    else:
        target.copy_(target.float() + delta)
    return target


def hadamard_quantize(
    x: Tensor, fmt: QuantFormat, hadamard_size: int = 32, rounding: RoundingSource | Rounding = "stochastic"
) -> tuple[Tensor, Tensor]:
    """TLq-HS first step: ``encode(H x)`` with the unnormalised ±1 Hadamard transform on blocks of ``hadamard_size``.

    Args:
        x: gradient buffer (flattened), a whole number of groups; the group size must be a multiple of
            ``hadamard_size``.
        fmt: bits and group size.
        hadamard_size: Hadamard block (power of two).
        rounding: a :class:`RoundingSource` or its mode.
    """
    if fmt.group_size % hadamard_size:
        raise ValueError(f"group_size ({fmt.group_size}) must be a multiple of hadamard_size ({hadamard_size}).")
    return encode(hadamard_transform(x.float(), hadamard_size), fmt, rounding)


def dequantize_sum(payloads: Tensor, scales: Tensor, fmt: QuantFormat) -> Tensor:
    """Sum of ``K`` decoded contributions, in fp32 and in order ``k = 0 .. K-1``.

    Args:
        payloads: ``(K, nbytes)`` ``uint8``.
        scales: ``(K, ngroups)`` fp32.
        fmt: the format of the payloads.
    """
    total: Tensor | None = None
    for k in range(payloads.shape[0]):
        part = decode(payloads[k], scales[k], fmt)
        total = part if total is None else total.add_(part)
    if total is None:
        raise ValueError("dequantize_sum needs at least one contribution.")
    return total


def dequantize_sum_requantize(
    payloads: Tensor,
    scales: Tensor,
    fmt_in: QuantFormat,
    fmt_out: QuantFormat,
    rounding: RoundingSource | Rounding = "stochastic",
) -> tuple[Tensor, Tensor]:
    """TLq middle step: decode ``K`` contributions, sum them and encode the sum again (e.g. 8 bits in, 4 bits out).

    Args:
        payloads: ``(K, nbytes)`` ``uint8`` received from ``K`` peers.
        scales: ``(K, ngroups)`` fp32.
        fmt_in: format of the received codes.
        fmt_out: format of the output codes.
        rounding: a :class:`RoundingSource` or its mode.
    """
    return encode(dequantize_sum(payloads, scales, fmt_in), fmt_out, rounding)


def dequantize_sum_hadamard(
    payloads: Tensor, scales: Tensor, fmt: QuantFormat, hadamard_size: int | None = 32
) -> Tensor:
    """TLq-HS last step: decode and sum ``K`` contributions, then apply ``H`` and divide by ``hadamard_size``.

    Since ``H H = n I`` this undoes the forward transform applied before the first quantisation; sums commute with
    ``H`` so the inverse is applied once, to the total. With ``hadamard_size=None`` no transform is applied.

    Args:
        payloads: ``(K, nbytes)`` ``uint8``.
        scales: ``(K, ngroups)`` fp32.
        fmt: the format of the payloads.
        hadamard_size: Hadamard block, or ``None`` for plain dequantise + sum.
    """
    total = dequantize_sum(payloads, scales, fmt)
    if hadamard_size is None:
        return total
    return hadamard_transform(total, hadamard_size).div_(hadamard_size)
