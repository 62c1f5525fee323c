"""Triton kernels behind :mod:`lightning_sdp.kernels.triton_quant` (imports ``triton`` at module level).

Import this module only through ``triton_quant._kernels()``, which first checks that the ``triton`` extra is
installed. The wrappers and the documentation of every kernel live in :mod:`lightning_sdp.kernels.triton_quant`.

Every program works on a tile of ``ROWS`` quantisation groups (``ROWS x GROUP`` values, masked past the last group):
one program per group of 128 values left the GPU at 4-7 % of its copy bandwidth (H200, 64M values), since each
program did too little to hide its launch and its reduction's synchronisation.
"""

# Triton's constexpr arguments are upper case by convention.

import triton
import triton.language as tl


@triton.jit
def _tile(pid, n_groups, ROWS: tl.constexpr, GROUP: tl.constexpr):
    """Group indices ``(ROWS,)``, their validity, and flat value offsets ``(ROWS, GROUP)`` of program ``pid``."""
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    valid = rows < n_groups
    offs = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    return rows, valid, offs


@triton.jit
def _load_codes(ptr, rows, valid, ROWS: tl.constexpr, GROUP: tl.constexpr, PACK: tl.constexpr):
    """The integer codes of a tile of groups as float32 ``(ROWS, GROUP)`` (4-bit codes unpacked)."""
    if PACK:
        byte_offs = rows[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
        b = tl.load(ptr + byte_offs, mask=valid[:, None], other=0).to(tl.int32)
        lo = ((b & 0xF) ^ 8) - 8
        hi = (((b >> 4) & 0xF) ^ 8) - 8
        q = tl.reshape(tl.join(lo, hi), (ROWS, GROUP))
    else:
        q = tl.load(ptr + rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :], mask=valid[:, None], other=0)
        q = q.to(tl.int32)
    return q.to(tl.float32)


@triton.jit
def _quantize_store(
    v,
    rows,
    valid,
    offs,
    noise_ptr,
    seed,
    out_ptr,
    scale_ptr,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    QMAX: tl.constexpr,
    NOISE: tl.constexpr,
    PACK: tl.constexpr,
):
    absmax = tl.max(tl.abs(v), axis=1)
    scale = tl.where(absmax == 0, 1.0, tl.math.div_rn(absmax, tl.full((ROWS,), QMAX, tl.float32)))
    if NOISE == 0:
        u = 0.5
    elif NOISE == 1:
        u = tl.load(noise_ptr + offs, mask=valid[:, None], other=0.0)
    else:
        u = tl.rand(seed, offs.to(tl.int32))
    q = tl.floor(tl.math.div_rn(v, tl.zeros_like(v) + scale[:, None]) + u)
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX).to(tl.int32)
    tl.store(scale_ptr + rows, scale, mask=valid)
    if PACK:
        lo, hi = tl.split(tl.reshape(q, (ROWS, GROUP // 2, 2)))
        byte = (lo & 0xF) | ((hi & 0xF) << 4)
        byte_offs = rows[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
        tl.store(out_ptr + byte_offs, byte.to(tl.uint8), mask=valid[:, None])
    else:
        tl.store(out_ptr + offs, q.to(tl.int8), mask=valid[:, None])


@triton.jit
def _hadamard_rows(v, h_ptr, ROWS: tl.constexpr, GROUP: tl.constexpr, HB: tl.constexpr):
    # y[r, j] = sum_k x[r, k] H[k, j] on every block of HB values (exact ±1 products; fp32 "ieee" dot, no TF32).
    k = tl.arange(0, HB)
    h = tl.load(h_ptr + k[:, None] * HB + k[None, :])
    x = tl.reshape(v, (ROWS * GROUP // HB, HB))
    if HB >= 16:
        y = tl.dot(x, h, input_precision="ieee")
    else:  # tl.dot needs every dimension >= 16
        y = tl.sum(x[:, :, None] * h[None, :, :], axis=1)
    return tl.reshape(y, (ROWS, GROUP))


@triton.jit
def encode_kernel(
    x_ptr,
    ref_ptr,
    h_ptr,
    noise_ptr,
    out_ptr,
    scale_ptr,
    seed,
    n_groups,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HB: tl.constexpr,
    QMAX: tl.constexpr,
    HAS_REF: tl.constexpr,
    HADAMARD: tl.constexpr,
    NOISE: tl.constexpr,
    PACK: tl.constexpr,
):
    rows, valid, offs = _tile(tl.program_id(0), n_groups, ROWS, GROUP)
    v = tl.load(x_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
    if HAS_REF:
        v = v - tl.load(ref_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
    if HADAMARD:
        v = _hadamard_rows(v, h_ptr, ROWS, GROUP, HB)
    _quantize_store(v, rows, valid, offs, noise_ptr, seed, out_ptr, scale_ptr, ROWS, GROUP, QMAX, NOISE, PACK)


@triton.jit
def dequant_add_kernel(
    payload_ptr,
    scale_ptr,
    target_ptr,
    n_groups,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    PACK: tl.constexpr,
    BF16: tl.constexpr,
):
    rows, valid, offs = _tile(tl.program_id(0), n_groups, ROWS, GROUP)
    scale = tl.load(scale_ptr + rows, mask=valid, other=0.0)
    delta = _load_codes(payload_ptr, rows, valid, ROWS, GROUP, PACK) * scale[:, None]
    t = tl.load(target_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
    out = t + delta
    if BF16:
        # fp32 -> bf16 with round-to-nearest-even done on the bits, as torch does (the CPU interpreter truncates).
        bits = out.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(target_ptr.to(tl.pointer_type(tl.uint16)) + offs, bits.to(tl.uint16), mask=valid[:, None])
    else:
        tl.store(target_ptr + offs, out.to(target_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _dequant_sum(
    payload_ptr,
    scale_ptr,
    rows,
    valid,
    offs,
    K,
    row_bytes,
    row_groups,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_IN: tl.constexpr,
    PACK_IN: tl.constexpr,
):
    acc = tl.zeros((ROWS, GROUP), dtype=tl.float32)
    for k in range(K):
        q = _load_codes(payload_ptr + k * row_bytes, rows, valid, ROWS, GROUP, PACK_IN)
        s = tl.load(scale_ptr + k * row_groups + offs // GROUP_IN, mask=valid[:, None], other=0.0)
        acc += q * s
    return acc


@triton.jit
def dequant_sum_requant_kernel(
    payload_ptr,
    scale_ptr,
    noise_ptr,
    out_ptr,
    out_scale_ptr,
    seed,
    K,
    row_bytes,
    row_groups,
    n_groups,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    GROUP_IN: tl.constexpr,
    PACK_IN: tl.constexpr,
    QMAX: tl.constexpr,
    NOISE: tl.constexpr,
    PACK: tl.constexpr,
):
    rows, valid, offs = _tile(tl.program_id(0), n_groups, ROWS, GROUP)
    acc = _dequant_sum(
        payload_ptr, scale_ptr, rows, valid, offs, K, row_bytes, row_groups, ROWS, GROUP, GROUP_IN, PACK_IN
    )
    _quantize_store(acc, rows, valid, offs, noise_ptr, seed, out_ptr, out_scale_ptr, ROWS, GROUP, QMAX, NOISE, PACK)


@triton.jit
def dequant_sum_hadamard_kernel(
    payload_ptr,
    scale_ptr,
    h_ptr,
    out_ptr,
    K,
    row_bytes,
    row_groups,
    inv_n,
    n_groups,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    GROUP_IN: tl.constexpr,
    PACK_IN: tl.constexpr,
    HB: tl.constexpr,
    HADAMARD: tl.constexpr,
):
    rows, valid, offs = _tile(tl.program_id(0), n_groups, ROWS, GROUP)
    acc = _dequant_sum(
        payload_ptr, scale_ptr, rows, valid, offs, K, row_bytes, row_groups, ROWS, GROUP, GROUP_IN, PACK_IN
    )
    if HADAMARD:
        acc = _hadamard_rows(acc, h_ptr, ROWS, GROUP, HB) * inv_n
    tl.store(out_ptr + offs, acc, mask=valid[:, None])
