import pytest
import torch

from lightning_sdp.kernels import quantization as q
from lightning_sdp.kernels.hadamard import hadamard_transform


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_levels_and_error_bound(bits, rounding):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64 * 16, generator=g) * torch.logspace(-3, 2, 16).repeat_interleave(64)
    codes, scales = q.quantize(x, bits, 64, rounding, generator=g)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert int(codes.abs().max()) == q.qmax(bits)  # the absmax element maps to the top level, never beyond
    assert int(codes.abs().max()) <= (7 if bits == 4 else 127)
    torch.testing.assert_close(scales, x.view(16, 64).abs().amax(1) / q.qmax(bits))
    err = (q.dequantize(codes, scales, 64) - x).view(16, 64).abs()
    bound = scales[:, None] * (1.0 if rounding == "stochastic" else 0.5)
    assert torch.all(err <= bound * (1 + 1e-6))


@pytest.mark.parametrize("bits", [4, 8])
def test_stochastic_rounding_is_unbiased(bits):
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(2)
    reps = 2000
    acc = torch.zeros_like(x)
    for _ in range(reps):
        acc += q.decode(*q.encode(x, bits, 128, "stochastic", generator=g), bits, 128)
    mean = acc / reps
    step = x.view(2, 128).abs().amax(1).repeat_interleave(128) / q.qmax(bits)
    # the mean of Bernoulli rounding has std <= step / (2 sqrt(reps)); 6 sigma
    assert torch.all((mean - x).abs() <= 6 * step / (2 * reps**0.5))
    # nearest rounding is biased on the same data: its error does not average out
    nearest = q.decode(*q.encode(x, bits, 128, "nearest"), bits, 128)
    assert (nearest - x).abs().mean() > 5 * (mean - x).abs().mean()


def test_zero_groups_stay_zero():
    x = torch.zeros(256)
    x[128:] = torch.randn(128)
    codes, scales = q.quantize(x, 4, 128, "stochastic")
    assert scales[0] == 1.0 and torch.all(codes[:128] == 0)
    assert torch.all(q.dequantize(codes, scales, 128)[:128] == 0)


def test_pack_roundtrip_and_layout():
    codes = torch.randint(-8, 8, (1000,), dtype=torch.int8)
    packed = q.pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == 500
    assert torch.equal(q.unpack_int4(packed), codes)
    assert q.pack_int4(torch.tensor([1, -1], dtype=torch.int8)).item() == 0xF1  # low nibble = even index
    for bits in (4, 8):
        x = torch.randn(512)
        payload, scales = q.encode(x, bits, 128, "nearest")
        assert payload.numel() == q.payload_bytes(512, bits)
        torch.testing.assert_close(
            q.decode(payload, scales, bits, 128), q.dequantize(*q.quantize(x, bits, 128, "nearest"), 128)
        )


def test_explicit_noise_equals_generator_noise():
    x = torch.randn(256)
    noise = q.rounding_noise(256, "stochastic", torch.Generator().manual_seed(5))
    a = q.quantize(x, 4, 64, noise=noise)
    b = q.quantize(x, 4, 64, "stochastic", generator=torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_fused_references_compose_the_plain_steps():
    g = 128
    x, r = torch.randn(512), torch.randn(512)
    noise = torch.rand(512)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            q.quantize_difference(x, r, 4, g, noise=noise), q.encode(x - r, 4, g, noise=noise), strict=True
        )
    )
    target = r.clone()
    payload, scales = q.encode(x - r, 8, g, noise=noise)
    q.dequantize_add_(target, payload, scales, 8, g)
    torch.testing.assert_close(target, r + q.decode(payload, scales, 8, g))
    ph, sh = q.hadamard_quantize(x, 8, g, 32, noise=noise)
    rows = torch.stack([ph, q.encode(r, 8, g, noise=noise)[0]])
    srows = torch.stack([sh, q.encode(r, 8, g, noise=noise)[1]])
    total = q.decode(rows[0], srows[0], 8, g) + q.decode(rows[1], srows[1], 8, g)
    torch.testing.assert_close(
        q.dequantize_sum_hadamard(rows, srows, 8, g, 32), hadamard_transform(total, 32) / 32
    )
    p4, s4 = q.dequantize_sum_requantize(rows, srows, 8, g, 4, g, noise=noise)
    assert all(torch.equal(a, b) for a, b in zip((p4, s4), q.encode(total, 4, g, noise=noise), strict=True))
    # Hadamard smoothing round trip: quantise in the transformed domain, invert, close to x
    back = q.dequantize_sum_hadamard(ph[None], sh[None], 8, g, 32)
    assert (back - x).norm() / x.norm() < 0.02


def test_bad_input_messages():
    with pytest.raises(ValueError, match="whole number of quantisation groups"):
        q.quantize(torch.zeros(100), 4, 64)
    with pytest.raises(ValueError, match="bits"):
        q.quantize(torch.zeros(128), 3, 64)
    with pytest.raises(ValueError, match="rounding"):
        q.quantize(torch.zeros(128), 4, 64, "up")
    with pytest.raises(ValueError, match="even number"):
        q.pack_int4(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of hadamard_size"):
        q.hadamard_quantize(torch.zeros(96), 8, 48, 32)
