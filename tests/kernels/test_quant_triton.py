"""The fused Triton kernels against the torch reference.

On the CPU they run in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest). With a CUDA device and
``TRITON_INTERPRET=0`` the same tests run the compiled kernels on the GPU (``benchmarks/gpu_checks.py`` does this).
"""

import os

import pytest
import torch

from lightning_sdp.kernels import quantization as q
from lightning_sdp.kernels.quantization import QuantFormat, RoundingSource

pytestmark = pytest.mark.triton

#: Compiled kernels on the GPU when one is present and the interpreter is off; the interpreter on the CPU otherwise.
DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "1") == "0" else "cpu")


@pytest.fixture(scope="module")
def tq():
    from lightning_sdp.kernels import triton_quant

    return triton_quant


def _inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3
    x[: n // 8] = 0  # a zero group
    x[-1] = 40.0  # an outlier
    return x.to(DEVICE), torch.rand(n, generator=g).to(DEVICE)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,group", [(64, 64), (6 * 32, 32), (5 * 128, 128)])
def test_encode_equals_reference(tq, bits, n, group):
    x, noise = _inputs(n, n + bits)
    ref, fmt, u = torch.randn(n, device=DEVICE), QuantFormat(bits, group), RoundingSource(noise=noise)
    for kwargs, expected in (
        ({}, q.encode(x, fmt, u)),
        ({"reference": ref}, q.quantize_difference(x, ref, fmt, u)),
    ):
        payload, scales = tq.encode(x, fmt, u, **kwargs)
        assert torch.equal(payload, expected[0]) and torch.equal(scales, expected[1])
    nearest = tq.encode(x, fmt, "nearest")
    assert all(torch.equal(a, b) for a, b in zip(nearest, q.encode(x, fmt, "nearest"), strict=True))


@pytest.mark.parametrize("bits", [4, 8])
def test_hadamard_encode_equals_reference(tq, bits):
    x, noise = _inputs(3 * 64, 7)
    fmt, u = QuantFormat(bits, 64), RoundingSource(noise=noise)
    payload, scales = tq.encode(x, fmt, u, hadamard_size=32)
    ep, es = q.hadamard_quantize(x, fmt, 32, u)
    torch.testing.assert_close(scales, es)
    # sums of ±1 products in another order: codes agree up to rare ties at a rounding boundary
    codes, ecodes = (q.unpack_int4(p) if bits == 4 else p.view(torch.int8) for p in (payload, ep))
    assert (codes.int() - ecodes.int()).abs().max() <= 1
    assert (codes != ecodes).float().mean() < 0.01


def _seeded(seed):
    return RoundingSource("stochastic", seed=seed)


def test_in_kernel_stochastic_rounding(tq):
    x, fmt = torch.randn(4 * 64, device=DEVICE), QuantFormat(4, 64)
    a = tq.encode(x, fmt, _seeded(3))
    assert all(torch.equal(u, v) for u, v in zip(a, tq.encode(x, fmt, _seeded(3)), strict=True))  # reproducible
    assert not torch.equal(a[0], tq.encode(x, fmt, _seeded(4))[0])
    err = q.decode(*a, fmt) - x
    assert torch.all(err.abs() <= a[1].repeat_interleave(64) * (1 + 1e-6))
    # unbiased: averaging many seeds converges to x
    mean = torch.stack([q.decode(*tq.encode(x, fmt, _seeded(s)), fmt) for s in range(100)]).mean(0)
    assert (mean - x).abs().mean() < 0.35 * (q.decode(*tq.encode(x, fmt, "nearest"), fmt) - x).abs().mean()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_add_equals_reference(tq, bits, dtype):
    x, noise = _inputs(256, 3)
    fmt = QuantFormat(bits, 64)
    payload, scales = q.encode(x, fmt, RoundingSource(noise=noise))
    target = torch.randn(256, device=DEVICE).to(dtype)
    expected = q.dequantize_add_(target.clone(), payload, scales, fmt)
    got = tq.dequantize_add_(target.clone(), payload, scales, fmt)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("bits_in,bits_out", [(8, 4), (4, 4), (8, 8)])
def test_dequantize_sum_requantize_equals_reference(tq, bits_in, bits_out):
    k, n, g = 3, 2 * 64, 64
    fmt_in, fmt_out = QuantFormat(bits_in, g), QuantFormat(bits_out, g)
    rows = [q.encode(_inputs(n, s)[0], fmt_in) for s in range(k)]
    payloads, scales = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    u = RoundingSource(noise=torch.rand(n, device=DEVICE))
    got = tq.dequantize_sum_requantize(payloads, scales, fmt_in, fmt_out, u)
    expected = q.dequantize_sum_requantize(payloads, scales, fmt_in, fmt_out, u)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("hadamard", [32, None])
def test_dequantize_sum_hadamard_equals_reference(tq, hadamard):
    k, n, fmt = 2, 3 * 64, QuantFormat(4, 64)
    rows = [q.encode(_inputs(n, s)[0], fmt) for s in range(k)]
    payloads, scales = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    got = tq.dequantize_sum_hadamard(payloads, scales, fmt, hadamard)
    expected = q.dequantize_sum_hadamard(payloads, scales, fmt, hadamard)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_triton_bad_sizes(tq):
    with pytest.raises(ValueError, match="power of two"):
        tq.encode(torch.zeros(96, device=DEVICE), QuantFormat(4, 48))
    with pytest.raises(ValueError, match="whole number of quantisation groups"):
        tq.encode(torch.zeros(100, device=DEVICE), QuantFormat(4, 64))
    with pytest.raises(ValueError, match="noise has 3 values"):
        tq.encode(
            torch.zeros(128, device=DEVICE), QuantFormat(4, 64), RoundingSource(noise=torch.rand(3, device=DEVICE))
        )
