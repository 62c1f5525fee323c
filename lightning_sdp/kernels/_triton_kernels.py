"""Triton kernels behind :mod:`lightning_sdp.kernels.triton_quant` (imports ``triton`` at module level).

Import this module only through ``triton_quant._kernels()``, which first checks that the ``triton`` extra is
installed. The wrappers and the documentation of every kernel live in :mod:`lightning_sdp.kernels.triton_quant`.
"""

# Triton's constexpr arguments are upper case by convention.

import triton
import triton.language as tl


@triton.jit
def _load_codes(ptr, base, GROUP: tl.constexpr, PACK: tl.constexpr):
    if PACK:
        b = tl.load(ptr + base // 2 + tl.arange(0, GROUP // 2)).to(tl.int32)
        lo = ((b & 0xF) ^ 8) - 8
        hi = (((b >> 4) & 0xF) ^ 8) - 8
        q = tl.reshape(tl.join(lo, hi), (GROUP,))
    else:
        q = tl.load(ptr + base + tl.arange(0, GROUP)).to(tl.int32)
    return q.to(tl.float32)


@triton.jit
def _quantize_store(
    v, g, base, noise_ptr, seed, out_ptr, scale_ptr,
    GROUP: tl.constexpr, QMAX: tl.constexpr, NOISE: tl.constexpr, PACK: tl.constexpr,
):  # fmt: skip
    absmax = tl.max(tl.abs(v), axis=0)
    scale = tl.where(absmax > 0, tl.math.div_rn(absmax, tl.full((), QMAX, tl.float32)), 1.0)
    offs = base + tl.arange(0, GROUP)
    if NOISE == 0:
        u = 0.5
    elif NOISE == 1:
        u = tl.load(noise_ptr + offs)
    else:
        u = tl.rand(seed, offs.to(tl.int32))
    q = tl.floor(tl.math.div_rn(v, tl.zeros_like(v) + scale) + u)
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX).to(tl.int32)
    tl.store(scale_ptr + g, scale)
    if PACK:
        lo, hi = tl.split(tl.reshape(q, (GROUP // 2, 2)))
        byte = (lo & 0xF) | ((hi & 0xF) << 4)
        tl.store(out_ptr + base // 2 + tl.arange(0, GROUP // 2), byte.to(tl.uint8))
    else:
        tl.store(out_ptr + offs, q.to(tl.int8))


@triton.jit
def _hadamard_rows(v, h_ptr, GROUP: tl.constexpr, HB: tl.constexpr):
    # y[r, j] = sum_k x[r, k] H[k, j] on every block of HB values of the group (exact ±1 products).
    k = tl.arange(0, HB)
    h = tl.load(h_ptr + k[:, None] * HB + k[None, :])
    x = tl.reshape(v, (GROUP // HB, HB))
    y = tl.sum(x[:, :, None] * h[None, :, :], axis=1)
    return tl.reshape(y, (GROUP,))


@triton.jit
def encode_kernel(
    x_ptr, ref_ptr, h_ptr, noise_ptr, out_ptr, scale_ptr, seed,
    GROUP: tl.constexpr, HB: tl.constexpr, QMAX: tl.constexpr, HAS_REF: tl.constexpr,
    HADAMARD: tl.constexpr, NOISE: tl.constexpr, PACK: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    base = g.to(tl.int64) * GROUP
    offs = base + tl.arange(0, GROUP)
    v = tl.load(x_ptr + offs).to(tl.float32)
    if HAS_REF:
        v = v - tl.load(ref_ptr + offs).to(tl.float32)
    if HADAMARD:
        v = _hadamard_rows(v, h_ptr, GROUP, HB)
    _quantize_store(v, g, base, noise_ptr, seed, out_ptr, scale_ptr, GROUP, QMAX, NOISE, PACK)


@triton.jit
def dequant_add_kernel(payload_ptr, scale_ptr, target_ptr, GROUP: tl.constexpr, PACK: tl.constexpr,
                       BF16: tl.constexpr):  # fmt: skip
    g = tl.program_id(0)
    base = g.to(tl.int64) * GROUP
    offs = base + tl.arange(0, GROUP)
    delta = _load_codes(payload_ptr, base, GROUP, PACK) * tl.load(scale_ptr + g)
    t = tl.load(target_ptr + offs).to(tl.float32)
    out = t + delta
    if BF16:
        # fp32 -> bf16 with round-to-nearest-even done on the bits, as torch does (the CPU interpreter truncates).
        bits = out.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(target_ptr.to(tl.pointer_type(tl.uint16)) + offs, bits.to(tl.uint16))
    else:
        tl.store(target_ptr + offs, out.to(target_ptr.dtype.element_ty))


@triton.jit
def _dequant_sum(payload_ptr, scale_ptr, base, K, row_bytes, row_groups, GROUP: tl.constexpr,
                 GROUP_IN: tl.constexpr, PACK_IN: tl.constexpr):  # fmt: skip
    offs = base + tl.arange(0, GROUP)
    acc = tl.zeros((GROUP,), dtype=tl.float32)
    for k in range(K):
        q = _load_codes(payload_ptr + k * row_bytes, base, GROUP, PACK_IN)
        s = tl.load(scale_ptr + k * row_groups + offs // GROUP_IN)
        acc += q * s
    return acc


@triton.jit
def dequant_sum_requant_kernel(
    payload_ptr, scale_ptr, noise_ptr, out_ptr, out_scale_ptr, seed, K, row_bytes, row_groups,
    GROUP: tl.constexpr, GROUP_IN: tl.constexpr, PACK_IN: tl.constexpr, QMAX: tl.constexpr,
    NOISE: tl.constexpr, PACK: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    base = g.to(tl.int64) * GROUP
    acc = _dequant_sum(payload_ptr, scale_ptr, base, K, row_bytes, row_groups, GROUP, GROUP_IN, PACK_IN)
    _quantize_store(acc, g, base, noise_ptr, seed, out_ptr, out_scale_ptr, GROUP, QMAX, NOISE, PACK)


@triton.jit
def dequant_sum_hadamard_kernel(
    payload_ptr, scale_ptr, h_ptr, out_ptr, K, row_bytes, row_groups, inv_n,
    GROUP: tl.constexpr, GROUP_IN: tl.constexpr, PACK_IN: tl.constexpr, HB: tl.constexpr,
    HADAMARD: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    base = g.to(tl.int64) * GROUP
    acc = _dequant_sum(payload_ptr, scale_ptr, base, K, row_bytes, row_groups, GROUP, GROUP_IN, PACK_IN)
    if HADAMARD:
        acc = _hadamard_rows(acc, h_ptr, GROUP, HB) * inv_n
    tl.store(out_ptr + base + tl.arange(0, GROUP), acc)
