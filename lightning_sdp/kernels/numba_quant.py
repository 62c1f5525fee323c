"""SDP4Bit's codec as fused, multi-threaded numba kernels (the CPU fast path).

Each public function computes the same thing as its plain-torch reference in
:mod:`lightning_sdp.kernels.quantization` (and takes the same arguments as the Triton kernels of
:mod:`lightning_sdp.kernels.triton_quant`), in one pass over memory and without temporaries:

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

Stochastic rounding draws its offsets from a counter-based stream: offset ``i`` of a call is a hash of the call's
seed and of ``i`` (:func:`~lightning_sdp.kernels.quantization.counter_uniforms`), so the draws need no serial
generator, any thread can make any of them, and the result does not depend on the number of threads. Given the
same offsets (explicit ``noise``, or the counter stream handed to the reference as ``noise``) the kernels match
the reference bit for bit; the Hadamard transform is a butterfly here and a matrix product there, so the steps that
contain it agree to float rounding (a code may differ by one where a value sits on a rounding boundary).

The kernels release the GIL (the exchange runs them on worker threads) and use as many threads as torch does
(``torch.get_num_threads()``, capped by ``NUMBA_NUM_THREADS``). This module imports numba at import time: import it
only when the numba backend is used.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic
from torch import Tensor

from lightning_sdp._imports import require
from lightning_sdp.kernels.quantization import (
    _LOWBIAS1,
    _LOWBIAS2,
    _UNIT24,
    _WEYL32,
    QuantFormat,
    Rounding,
    RoundingSource,
    counter_key,
)

require("numba", feature="the SDP4Bit numba codec")

# How a kernel gets its rounding offsets.
_NEAREST, _EXPLICIT, _COUNTER = 0, 1, 2
# Groups per parallel chunk at least: a chunk allocates one scratch group, so tiny chunks would cost more than work.
_MIN_GROUPS_PER_CHUNK = 8


@intrinsic
def _uniform(typingctx: Any, key: Any, index: Any) -> Any:
    """Offset ``index`` of the counter stream of ``key`` (:func:`counter_uniforms`), as float32 in [0, 1).

    Written as LLVM IR in 32-bit integers: numba widens integer arithmetic to 64 bits, and AVX2 has no vector 64-bit
    multiply, so the same hash in Python syntax runs one value at a time; in i32 a loop draws 8 offsets per
    instruction.
    """
    i32 = ir.IntType(32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        key_value, index_value = (builder.trunc(v, i32) if v.type.width > 32 else v for v in args)
        z = builder.xor(builder.mul(index_value, ir.Constant(i32, _WEYL32)), key_value)
        for shift, multiplier in ((16, _LOWBIAS1), (15, _LOWBIAS2)):
            z = builder.mul(builder.xor(z, builder.lshr(z, ir.Constant(i32, shift))), ir.Constant(i32, multiplier))
        z = builder.xor(z, builder.lshr(z, ir.Constant(i32, 16)))
        top24 = builder.sitofp(builder.lshr(z, ir.Constant(i32, 8)), ir.FloatType())
        return builder.fmul(top24, ir.Constant(ir.FloatType(), _UNIT24))

    return types.float32(key, index), codegen


# Hot loops index with unsigned integers (``_u``): numba checks a signed index for wrap-around (a negative index
# counts from the end), a branch per access that keeps LLVM from vectorising the loop; an unsigned one cannot wrap.


@njit(inline="always")
def _u(i: int) -> np.uint64:
    return np.uint64(i)


@njit(inline="always")
def _fwht(buf: np.ndarray, block: int) -> None:
    """Unnormalised Walsh-Hadamard butterfly on every ``block`` values of ``buf`` (in place, float32).

    The first two stages (pairs, then pairs of pairs) run as one radix-4 butterfly per 4 values; the later stages'
    inner loops are long enough to vectorise.
    """
    n = buf.shape[0]
    h = 1
    if block >= 4:
        for q in range(0, n, 4):
            a, b, c, d = buf[_u(q)], buf[_u(q + 1)], buf[_u(q + 2)], buf[_u(q + 3)]
            s0, s1, s2, s3 = a + b, a - b, c + d, c - d
            buf[_u(q)], buf[_u(q + 1)], buf[_u(q + 2)], buf[_u(q + 3)] = s0 + s2, s1 + s3, s0 - s2, s1 - s3
        h = 4
    while h < block:
        for start in range(0, n, 2 * h):
            for j in range(start, start + h):
                a = buf[_u(j)]
                b = buf[_u(j + h)]
                buf[_u(j)] = a + b
                buf[_u(j + h)] = a - b
        h *= 2


@njit(inline="always")
def _decode_add(
    payload: np.ndarray, base: int, group: int, bits: int, scale: np.float32, out: np.ndarray, at: int
) -> None:
    """``out[at + j] += code(base + j) * scale`` for the ``group`` codes from value ``base`` of a wire payload.

    Branch-free sign extension (``b - 256 * (b >> 7)`` for a byte, ``n - 16 * (n >> 3)`` for a nibble) keeps the
    loops vectorisable.
    """
    if bits == 8:
        for j in range(group):
            b = np.int64(payload[_u(base + j)])
            out[_u(at + j)] = out[_u(at + j)] + np.float32(b - ((b >> 7) << 8)) * scale
        return
    first = base >> 1
    for j in range(group >> 1):
        b = np.int64(payload[_u(first + j)])
        low = b & 15
        high = b >> 4
        out[_u(at + 2 * j)] = out[_u(at + 2 * j)] + np.float32(low - ((low >> 3) << 4)) * scale
        out[_u(at + 2 * j + 1)] = out[_u(at + 2 * j + 1)] + np.float32(high - ((high >> 3) << 4)) * scale


@njit(inline="always")
def _quantize_group(
    src: np.ndarray,
    src_bits: np.ndarray,
    off: int,
    base: int,
    group: int,
    g: int,
    level: np.float32,
    bits: int,
    mode: int,
    noise: np.ndarray,
    key: int,
    payload: np.ndarray,
    scales: np.ndarray,
    scratch: np.ndarray,
) -> None:
    """Quantise ``src[off : off + group]`` (values ``base ..`` of the input) into ``payload`` and ``scales[g]``.

    One simple loop per stage, each of which LLVM vectorises (a fused loop with a branch per element it does not):
    the absmax on the bit patterns (``src_bits``, the int32 view of ``src``) with the sign cleared (for non-negative
    floats integer order is float order, and a NaN's pattern exceeds every number's, so a NaN makes the scale NaN,
    which the caller's overflow check sees), the division, the offsets, then floor, clamp and store.
    ``scratch`` is a float32 buffer of ``group + 2`` values (an even count, so that it has an int64 view).
    """
    top = 0
    for j in range(group):
        b = src_bits[_u(off + j)] & 0x7FFFFFFF
        top = b if b > top else top
    scratch_bits = scratch.view(np.int32)
    scratch_bits[_u(group)] = top
    absmax = scratch[_u(group)]
    scale = np.float32(1.0) if absmax == 0 else absmax / level
    scales[_u(g)] = scale
    for j in range(group):
        scratch[_u(j)] = src[_u(off + j)] / scale
    if mode == _EXPLICIT:
        for j in range(group):
            scratch[_u(j)] = scratch[_u(j)] + noise[_u(base + j)]
    elif mode == _COUNTER:
        for j in range(group):
            scratch[_u(j)] = scratch[_u(j)] + _uniform(key, base + j)  # type: ignore[call-arg]  # typed by numba
    else:
        half = np.float32(0.5)
        for j in range(group):
            scratch[_u(j)] = scratch[_u(j)] + half
    low = -level
    for j in range(group):  # a NaN value makes its group's scale NaN, refused by the caller: its code is never used
        f = np.floor(scratch[_u(j)])
        f = low if f < low else f
        f = level if f > level else f
        scratch_bits[_u(j)] = np.int32(f)
    if bits == 8:
        for j in range(group):
            payload[_u(base + j)] = np.uint8(scratch_bits[_u(j)] & 255)
        return
    # Two codes per byte, read as one int64 (little-endian: the even code in the low half) so the loop is not
    # strided and vectorises.
    pairs = scratch.view(np.int64)
    first = base >> 1
    for j in range(group >> 1):
        v = pairs[_u(j)]
        payload[_u(first + j)] = np.uint8((v & 15) | ((v >> 28) & 240))


def _threads() -> int:
    """Threads the kernels may use: torch's intra-op threads, capped by ``NUMBA_NUM_THREADS``."""
    return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]


def _chunks(n_groups: int, threads: int) -> int:
    """Parallel chunks of groups: a few per thread, each at least a few groups (a chunk allocates its scratch)."""
    return max(1, min(4 * threads, n_groups // _MIN_GROUPS_PER_CHUNK))


def _encode_py(
    x: np.ndarray,
    reference: np.ndarray,
    subtract: bool,
    hadamard: int,
    bits: int,
    level: np.float32,
    mode: int,
    noise: np.ndarray,
    key: int,
    payload: np.ndarray,
    scales: np.ndarray,
    chunks: int,
) -> None:
    n_groups = scales.shape[0]
    group = x.shape[0] // n_groups
    per = (n_groups + chunks - 1) // chunks
    x_bits = x.view(np.int32)
    for c in prange(chunks):
        buf = np.empty(group, np.float32)
        buf_bits = buf.view(np.int32)
        scratch = np.empty(group + 2, np.float32)
        for g in range(c * per, min(n_groups, (c + 1) * per)):
            base = g * group
            if not subtract and hadamard <= 1:  # quantise straight from the input: no copy
                _quantize_group(
                    x, x_bits, base, base, group, g, level, bits, mode, noise, key, payload, scales, scratch
                )
                continue
            if subtract:
                for j in range(group):
                    buf[j] = x[_u(base + j)] - reference[_u(base + j)]
            else:
                for j in range(group):
                    buf[j] = x[_u(base + j)]
            if hadamard > 1:
                _fwht(buf, hadamard)
            _quantize_group(buf, buf_bits, 0, base, group, g, level, bits, mode, noise, key, payload, scales, scratch)


def _sum_py(
    payloads: np.ndarray,
    scales_in: np.ndarray,
    bits_in: int,
    hadamard: int,
    requantize: bool,
    bits_out: int,
    level: np.float32,
    mode: int,
    noise: np.ndarray,
    key: int,
    group: int,
    total: np.ndarray,
    payload: np.ndarray,
    scales: np.ndarray,
    chunks: int,
) -> None:
    """Decode and sum ``K`` rows group by group; then re-quantise into ``payload``/``scales`` or write ``total``
    (after the inverse Hadamard transform)."""
    k_rows, n_groups = scales_in.shape
    per = (n_groups + chunks - 1) // chunks
    inv = np.float32(hadamard)
    for c in prange(chunks):
        buf = np.empty(group, np.float32)
        buf_bits = buf.view(np.int32)
        scratch = np.empty(group + 2, np.float32)
        for g in range(c * per, min(n_groups, (c + 1) * per)):
            base = g * group
            for j in range(group):
                buf[j] = np.float32(0.0)  # 0 + the first row's values is those values: the reference's order
            for k in range(k_rows):
                _decode_add(payloads[k], base, group, bits_in, scales_in[k, g], buf, 0)
            if requantize:
                _quantize_group(
                    buf,
                    buf_bits,
                    0,
                    base,
                    group,
                    g,
                    level,
                    bits_out,
                    mode,
                    noise,
                    key,
                    payload,
                    scales,
                    scratch,
                )
                continue
            if hadamard > 1:
                _fwht(buf, hadamard)
                for j in range(group):
                    buf[j] = buf[j] / inv
            for j in range(group):
                total[_u(base + j)] = buf[j]


def _add_py(target: np.ndarray, payload: np.ndarray, scales: np.ndarray, bits: int, chunks: int) -> None:
    n_groups = scales.shape[0]
    group = target.shape[0] // n_groups
    per = (n_groups + chunks - 1) // chunks
    for c in prange(chunks):
        for g in range(c * per, min(n_groups, (c + 1) * per)):
            base = g * group
            _decode_add(payload, base, group, bits, scales[g], target, base)


# Each kernel twice: a serial build for one thread (no thread pool to wake or to spin, which costs more than the
# work when several processes share the cores) and a parallel one (prange over chunks of groups).
_KERNELS = {
    name: (
        njit(cache=True, nogil=True, error_model="numpy")(fn),
        njit(parallel=True, cache=True, nogil=True, error_model="numpy")(fn),
    )
    for name, fn in (("encode", _encode_py), ("sum", _sum_py), ("add", _add_py))
}


def _kernel(name: str, n_groups: int) -> tuple[Any, int]:
    """The build of kernel ``name`` for the current thread count, and its number of chunks."""
    threads = _threads()
    serial, parallel = _KERNELS[name]
    if threads == 1:
        return serial, 1
    numba.set_num_threads(threads)
    return parallel, _chunks(n_groups, threads)


# ----------------------------------------------------------------------------------------------------------------
# Public functions: the reference's signatures
# ----------------------------------------------------------------------------------------------------------------

_NO_NOISE = np.zeros(1, np.float32)


def _rounding_args(numel: int, rounding: RoundingSource | Rounding) -> tuple[int, np.ndarray, int]:
    """``(mode, explicit offsets or a dummy, counter key)`` of one kernel call."""
    source = RoundingSource.of(rounding)
    noise = source.explicit_noise(numel)
    if noise is not None:
        return _EXPLICIT, noise.detach().cpu().contiguous().numpy(), 0
    if source.mode == "nearest":
        return _NEAREST, _NO_NOISE, 0
    return _COUNTER, _NO_NOISE, counter_key(source.seed)


def _fp32_numpy(t: Tensor) -> np.ndarray:
    if t.device.type != "cpu":
        raise ValueError(f"The numba codec runs on CPU tensors; got one on {t.device}. Use the Triton or torch ops.")
    return t.detach().reshape(-1).to(torch.float32).contiguous().numpy()


def _check_hadamard(fmt: QuantFormat, hadamard_size: int | None) -> int:
    if hadamard_size is None:
        return 0
    if hadamard_size < 1 or hadamard_size & (hadamard_size - 1):
        raise ValueError(f"The Hadamard size must be a power of two, got {hadamard_size}.")
    if fmt.group_size % hadamard_size:
        raise ValueError(f"group_size ({fmt.group_size}) must be a multiple of hadamard_size ({hadamard_size}).")
    return hadamard_size


def encode(
    x: Tensor,
    fmt: QuantFormat,
    rounding: RoundingSource | Rounding = "stochastic",
    reference: Tensor | None = None,
    hadamard_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``encode(x - reference)`` or ``encode(H x)`` or ``encode(x)`` in one pass: ``(payload uint8, scales fp32)``.

    Args:
        x: CPU floating tensor (flattened), a whole number of groups.
        fmt: bits and group size.
        rounding: a :class:`RoundingSource` (stochastic offsets from the counter stream of its ``seed``, or its
            explicit ``noise``) or its mode.
        reference: subtract this first (qWD); same number of elements as ``x``.
        hadamard_size: apply the unnormalised Hadamard transform on blocks of this size first (TLq-HS).
    """
    h = _check_hadamard(fmt, hadamard_size)
    if reference is not None and h:
        raise ValueError("encode takes either a reference (qWD) or a Hadamard size (TLq-HS), not both.")
    xs = _fp32_numpy(x)
    n_groups = fmt.num_groups(xs.size)
    ref_np = xs
    if reference is not None:
        if reference.numel() != xs.size:
            raise ValueError(f"x ({xs.size}) and reference ({reference.numel()}) differ in size.")
        ref_np = _fp32_numpy(reference)
    payload = torch.empty(fmt.payload_bytes(xs.size), dtype=torch.uint8)
    scales = torch.empty(n_groups, dtype=torch.float32)
    mode, noise, key = _rounding_args(xs.size, rounding)
    kernel, chunks = _kernel("encode", n_groups)
    kernel(
        xs,
        ref_np,
        reference is not None,
        h,
        fmt.bits,
        np.float32(fmt.qmax),
        mode,
        noise,
        key,
        payload.numpy(),
        scales.numpy(),
        chunks,
    )
    return payload, scales


def dequantize_add_(target: Tensor, payload: Tensor, scales: Tensor, fmt: QuantFormat) -> Tensor:
    """``target += decode(payload)`` in fp32 (other dtypes go through an fp32 copy). Returns ``target``.

    Args:
        target: 1-D CPU weights to update in place.
        payload: wire bytes.
        scales: fp32 scales.
        fmt: the format of the payload.
    """
    numel = target.numel()
    codes = 2 * payload.numel() if fmt.bits == 4 else payload.numel()
    if codes != numel:
        raise ValueError(f"payload decodes to {codes} values, target has {numel}.")
    fmt.check_scales(numel, scales)
    exact = target.dtype == torch.float32 and target.is_contiguous() and target.device.type == "cpu"
    work = target.view(-1) if exact else target.detach().reshape(-1).float()
    sc = scales.detach().reshape(-1).float().contiguous()
    kernel, chunks = _kernel("add", sc.numel())
    kernel(work.numpy(), payload.reshape(-1).contiguous().numpy(), sc.numpy(), fmt.bits, chunks)
    if not exact:
        target.copy_(work.view(target.shape))
    return target


def _rows(payloads: Tensor, scales: Tensor, fmt: QuantFormat) -> tuple[np.ndarray, np.ndarray, int]:
    _, numel = fmt.check_rows(payloads, scales)
    return payloads.contiguous().numpy(), scales.float().contiguous().numpy(), numel


def dequantize_sum_requantize(
    payloads: Tensor,
    scales: Tensor,
    fmt_in: QuantFormat,
    fmt_out: QuantFormat,
    rounding: RoundingSource | Rounding = "stochastic",
) -> tuple[Tensor, Tensor]:
    """Decode ``K`` contributions, sum them in fp32 (in order ``k = 0 .. K-1``) and encode the sum in ``fmt_out``.

    Args:
        payloads: ``(K, nbytes)`` ``uint8``.
        scales: ``(K, ngroups)`` fp32.
        fmt_in: format of the received codes.
        fmt_out: format of the output codes (same group size).
        rounding: a :class:`RoundingSource` or its mode.
    """
    if fmt_in.group_size != fmt_out.group_size:
        raise ValueError(f"Re-quantisation keeps the group size: {fmt_in.group_size} in, {fmt_out.group_size} out.")
    p, s, numel = _rows(payloads, scales, fmt_in)
    n_groups = s.shape[1]
    payload = torch.empty(fmt_out.payload_bytes(numel), dtype=torch.uint8)
    out_scales = torch.empty(n_groups, dtype=torch.float32)
    mode, noise, key = _rounding_args(numel, rounding)
    kernel, chunks = _kernel("sum", n_groups)
    kernel(
        p,
        s,
        fmt_in.bits,
        0,
        True,
        fmt_out.bits,
        np.float32(fmt_out.qmax),
        mode,
        noise,
        key,
        fmt_in.group_size,
        _NO_NOISE,
        payload.numpy(),
        out_scales.numpy(),
        chunks,
    )
    return payload, out_scales


def dequantize_sum_hadamard(
    payloads: Tensor, scales: Tensor, fmt: QuantFormat, hadamard_size: int | None = 32
) -> Tensor:
    """Decode and sum ``K`` contributions, then apply ``H / hadamard_size`` (``None``: plain sum), as fp32.

    Args:
        payloads: ``(K, nbytes)`` ``uint8``.
        scales: ``(K, ngroups)`` fp32.
        fmt: the format of the payloads.
        hadamard_size: Hadamard block, or ``None`` for plain dequantise + sum.
    """
    h = _check_hadamard(fmt, hadamard_size)
    p, s, numel = _rows(payloads, scales, fmt)
    total = torch.empty(numel, dtype=torch.float32)
    kernel, chunks = _kernel("sum", s.shape[1])
    kernel(
        p,
        s,
        fmt.bits,
        h,
        False,
        fmt.bits,
        np.float32(fmt.qmax),
        _NEAREST,
        _NO_NOISE,
        0,
        fmt.group_size,
        total.numpy(),
        np.zeros(1, np.uint8),
        np.zeros(1, np.float32),
        chunks,
    )
    return total
