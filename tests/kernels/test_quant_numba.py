"""The numba codec against the torch reference, on fresh random inputs, and its counter-based random stream."""

import pytest
import torch

from lightning_sdp.kernels import quantization as q
from lightning_sdp.kernels.quantization import (
    QuantFormat,
    RoundingSource,
    _keyed_uniforms,
    counter_key,
    counter_uniforms,
)

pytestmark = pytest.mark.numba


@pytest.fixture(scope="module")
def nq():
    pytest.importorskip("numba")
    from lightning_sdp.kernels import numba_quant

    return numba_quant


def _inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3
    x[: n // 8] = 0  # a zero group
    x[-1] = 40.0  # an outlier
    return x, torch.rand(n, generator=g)


def _codes(payload, bits):
    return q.unpack_int4(payload) if bits == 4 else payload.view(torch.int8)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,group", [(64, 64), (6 * 32, 32), (5 * 128, 128), (7 * 48, 48)])
def test_encode_equals_reference(nq, bits, n, group):
    x, noise = _inputs(n, n + bits)
    ref, fmt, u = torch.randn(n), QuantFormat(bits, group), RoundingSource(noise=noise)
    for kwargs, expected in (
        ({}, q.encode(x, fmt, u)),
        ({"reference": ref}, q.quantize_difference(x, ref, fmt, u)),
        ({"reference": ref.bfloat16()}, q.quantize_difference(x, ref.bfloat16(), fmt, u)),
    ):
        payload, scales = nq.encode(x, fmt, u, **kwargs)
        assert torch.equal(payload, expected[0]) and torch.equal(scales, expected[1])
    nearest = nq.encode(x, fmt, "nearest")
    assert all(torch.equal(a, b) for a, b in zip(nearest, q.encode(x, fmt, "nearest"), strict=True))


def test_odd_group_size_for_8_bits(nq):
    x, noise = _inputs(5 * 9, 1)
    fmt, u = QuantFormat(8, 9), RoundingSource(noise=noise)
    assert all(torch.equal(a, b) for a, b in zip(nq.encode(x, fmt, u), q.encode(x, fmt, u), strict=True))


@pytest.mark.parametrize("seed", [0, 12345, 2**31 - 1])
@pytest.mark.parametrize("bits", [4, 8])
def test_counter_stream_equals_reference_given_the_same_offsets(nq, seed, bits):
    x, _ = _inputs(6 * 128, seed % 1000)
    fmt = QuantFormat(bits, 128)
    got = nq.encode(x, fmt, RoundingSource("stochastic", seed=seed))
    expected = q.encode(x, fmt, RoundingSource(noise=counter_uniforms(seed, x.numel())))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_counter_stream_statistics():
    u = counter_uniforms(7, 200_000)
    assert u.dtype == torch.float32 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    assert float(((counts - counts.mean()) ** 2 / counts.mean()).sum()) < 45  # chi-square, 15 dof, p ~ 1e-4
    lag = torch.corrcoef(torch.stack((u[:-1], u[1:])))[0, 1]
    assert abs(float(lag)) < 0.01  # neighbouring indices are unrelated
    assert not torch.equal(counter_uniforms(8, 1000), u[:1000])
    assert torch.equal(counter_uniforms(7, 1000), u[:1000])  # a prefix: offset i depends on (seed, i) only


def test_stochastic_rounding_is_unbiased_and_thread_independent(nq):
    x, fmt = torch.randn(16 * 64), QuantFormat(4, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = nq.encode(x, fmt, RoundingSource("stochastic", seed=3))
        torch.set_num_threads(2)
        two = nq.encode(x, fmt, RoundingSource("stochastic", seed=3))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert not torch.equal(one[0], nq.encode(x, fmt, RoundingSource("stochastic", seed=4))[0])
    err = q.decode(*one, fmt) - x
    assert torch.all(err.abs() <= one[1].repeat_interleave(64) * (1 + 1e-6))
    mean = torch.stack([q.decode(*nq.encode(x, fmt, RoundingSource(seed=s)), fmt) for s in range(200)]).mean(0)
    nearest_err = (q.decode(*nq.encode(x, fmt, "nearest"), fmt) - x).abs().mean()
    assert (mean - x).abs().mean() < 0.3 * nearest_err


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,hadamard", [(64, 32), (128, 32), (48, 16)])
def test_hadamard_encode_equals_reference(nq, bits, group, hadamard):
    x, noise = _inputs(5 * group, group + bits)
    fmt, u = QuantFormat(bits, group), RoundingSource(noise=noise)
    payload, scales = nq.encode(x, fmt, u, hadamard_size=hadamard)
    ep, es = q.hadamard_quantize(x, fmt, hadamard, u)
    torch.testing.assert_close(scales, es)
    # sums of ±1 products in another order: codes agree up to rare ties at a rounding boundary
    codes, ecodes = _codes(payload, bits), _codes(ep, bits)
    assert (codes.int() - ecodes.int()).abs().max() <= 1
    assert (codes != ecodes).float().mean() < 0.01


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_add_equals_reference(nq, bits, dtype):
    x, noise = _inputs(512, bits)
    fmt = QuantFormat(bits, 64)
    payload, scales = q.encode(x, fmt, RoundingSource(noise=noise))
    target = torch.randn(512).to(dtype)
    expected = q.dequantize_add_(target.clone(), payload, scales, fmt)
    got = target.clone()
    assert nq.dequantize_add_(got, payload, scales, fmt) is got
    assert torch.equal(got, expected)


@pytest.mark.parametrize("bits_in,bits_out", [(8, 4), (4, 4), (8, 8)])
@pytest.mark.parametrize("k", [1, 3])
def test_dequantize_sum_requantize_equals_reference(nq, bits_in, bits_out, k):
    n, g = 4 * 64, 64
    fmt_in, fmt_out = QuantFormat(bits_in, g), QuantFormat(bits_out, g)
    rows = [q.encode(_inputs(n, 10 * k + s)[0], fmt_in) for s in range(k)]
    payloads, scales = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    u = RoundingSource(noise=torch.rand(n))
    got = nq.dequantize_sum_requantize(payloads, scales, fmt_in, fmt_out, u)
    expected = q.dequantize_sum_requantize(payloads, scales, fmt_in, fmt_out, u)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("hadamard", [32, None])
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_sum_hadamard_equals_reference(nq, hadamard, bits):
    k, n, fmt = 2, 3 * 64, QuantFormat(bits, 64)
    rows = [q.encode(_inputs(n, 20 + s)[0], fmt) for s in range(k)]
    payloads, scales = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    got = nq.dequantize_sum_hadamard(payloads, scales, fmt, hadamard)
    expected = q.dequantize_sum_hadamard(payloads, scales, fmt, hadamard)
    if hadamard is None:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)


def test_non_finite_groups_get_non_finite_scales(nq):
    x = torch.randn(8 * 32)
    x[40], x[100] = float("nan"), float("inf")
    x[160:192] = 1e38  # finite, but the Hadamard sums of 32 of them are not
    fmt = QuantFormat(8, 32)
    expected = torch.tensor([True, False, True, False, True, False, True, True])
    for kwargs in ({}, {"hadamard_size": 32}):
        _, scales = nq.encode(x, fmt, "nearest", **kwargs)
        _, ref_scales = q.hadamard_quantize(x, fmt, 32, "nearest") if kwargs else q.encode(x, fmt, "nearest")
        assert torch.equal(scales.isfinite(), ref_scales.isfinite())
        assert torch.equal(scales.isfinite(), expected if kwargs else expected | (torch.arange(8) == 5))


def test_bad_inputs(nq):
    with pytest.raises(ValueError, match="whole number of quantisation groups"):
        nq.encode(torch.zeros(100), QuantFormat(4, 64))
    with pytest.raises(ValueError, match="noise has 3 values"):
        nq.encode(torch.zeros(128), QuantFormat(4, 64), RoundingSource(noise=torch.rand(3)))
    with pytest.raises(ValueError, match="multiple of hadamard_size"):
        nq.encode(torch.zeros(96), QuantFormat(8, 48), hadamard_size=32)
    with pytest.raises(ValueError, match="differ in size"):
        nq.encode(torch.zeros(128), QuantFormat(8, 64), reference=torch.zeros(64))
    with pytest.raises(ValueError, match="target has 64"):
        nq.dequantize_add_(torch.zeros(64), torch.zeros(64, dtype=torch.uint8), torch.ones(2), QuantFormat(4, 64))
    with pytest.raises(ValueError, match="same K"):
        nq.dequantize_sum_hadamard(torch.zeros(2, 32, dtype=torch.uint8), torch.ones(3, 1), QuantFormat(4, 64))


def test_select_ops_picks_the_codec_for_the_device():
    pytest.importorskip("numba")
    from lightning_sdp.plugins.sdp4bit.exchange import NumbaOps, TorchOps, select_ops

    cpu = torch.device("cpu")
    assert isinstance(select_ops("auto", cpu, 2048, 128), NumbaOps)
    assert isinstance(select_ops("numba", cpu, 2048, 100), NumbaOps)  # any group size
    assert type(select_ops("torch", cpu, 2048, 128)) is TorchOps
    with pytest.raises(ValueError, match="runs on CPU tensors"):
        select_ops("numba", torch.device("cuda", 0), 2048, 128)
    with pytest.raises(ValueError, match="power-of-two group sizes|needs CUDA tensors"):
        select_ops("triton", cpu, 2048, 96)


def test_counter_streams_of_two_keys_are_not_shifted_copies():
    # With the key added to the Weyl step, a key larger by 5 * 0x9E3779B9 would give the stream shifted by 5.
    key = counter_key(11)
    u = _keyed_uniforms(key, 4096)
    shifted_key = _keyed_uniforms((key + 5 * 0x9E3779B9) % 2**32, 4096)
    assert (u[5:] == shifted_key[:-5]).float().mean() < 0.01
    assert abs(float(torch.corrcoef(torch.stack((u[5:], shifted_key[:-5])))[0, 1])) < 0.1
