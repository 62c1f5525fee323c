import dataclasses

import pytest
import torch

from lightning_sdp.kernels import quantization as q
from lightning_sdp.kernels.hadamard import hadamard_transform
from lightning_sdp.kernels.quantization import QuantFormat, RoundingSource


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_levels_and_error_bound(bits, rounding):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64 * 16, generator=g) * torch.logspace(-3, 2, 16).repeat_interleave(64)
    fmt = QuantFormat(bits, 64)
    codes, scales = q.quantize(x, fmt, RoundingSource(rounding, generator=g))
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert int(codes.abs().max()) == q.qmax(bits)  # the absmax element maps to the top level, never beyond
    assert int(codes.abs().max()) <= (7 if bits == 4 else 127)
    torch.testing.assert_close(scales, x.view(16, 64).abs().amax(1) / q.qmax(bits))
    err = (q.dequantize(codes, scales, fmt) - x).view(16, 64).abs()
    bound = scales[:, None] * (1.0 if rounding == "stochastic" else 0.5)
    assert torch.all(err <= bound * (1 + 1e-6))


@pytest.mark.parametrize("bits", [4, 8])
def test_stochastic_rounding_is_unbiased(bits):
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(2)
    reps, fmt = 2000, QuantFormat(bits, 128)
    acc = torch.zeros_like(x)
    for _ in range(reps):
        acc += q.decode(*q.encode(x, fmt, RoundingSource("stochastic", generator=g)), fmt)
    mean = acc / reps
    step = x.view(2, 128).abs().amax(1).repeat_interleave(128) / q.qmax(bits)
    # the mean of Bernoulli rounding has std <= step / (2 sqrt(reps)); 6 sigma
    assert torch.all((mean - x).abs() <= 6 * step / (2 * reps**0.5))
    # nearest rounding is biased on the same data: its error does not average out
    nearest = q.decode(*q.encode(x, fmt, "nearest"), fmt)
    assert (nearest - x).abs().mean() > 5 * (mean - x).abs().mean()


def test_zero_groups_stay_zero():
    x = torch.zeros(256)
    x[128:] = torch.randn(128)
    codes, scales = q.quantize(x, QuantFormat(4, 128), "stochastic")
    assert scales[0] == 1.0 and torch.all(codes[:128] == 0)
    assert torch.all(q.dequantize(codes, scales, QuantFormat(4, 128))[:128] == 0)


def test_pack_roundtrip_and_layout():
    codes = torch.randint(-8, 8, (1000,), dtype=torch.int8)
    packed = q.pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == 500
    assert torch.equal(q.unpack_int4(packed), codes)
    assert q.pack_int4(torch.tensor([1, -1], dtype=torch.int8)).item() == 0xF1  # low nibble = even index
    for bits in (4, 8):
        x, fmt = torch.randn(512), QuantFormat(bits, 128)
        payload, scales = q.encode(x, fmt, "nearest")
        assert payload.numel() == fmt.payload_bytes(512) == (256 if bits == 4 else 512)
        torch.testing.assert_close(q.decode(payload, scales, fmt), q.dequantize(*q.quantize(x, fmt, "nearest"), fmt))


def test_explicit_noise_equals_generator_noise():
    x = torch.randn(256)
    fmt = QuantFormat(4, 64)
    noise = RoundingSource("stochastic", generator=torch.Generator().manual_seed(5)).offsets(256)
    a = q.quantize(x, fmt, RoundingSource(noise=noise))
    b = q.quantize(x, fmt, RoundingSource("stochastic", generator=torch.Generator().manual_seed(5)))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_fused_references_compose_the_plain_steps():
    g4, g8 = QuantFormat(4, 128), QuantFormat(8, 128)
    x, r = torch.randn(512), torch.randn(512)
    u = RoundingSource(noise=torch.rand(512))
    assert all(
        torch.equal(a, b) for a, b in zip(q.quantize_difference(x, r, g4, u), q.encode(x - r, g4, u), strict=True)
    )
    target = r.clone()
    payload, scales = q.encode(x - r, g8, u)
    q.dequantize_add_(target, payload, scales, g8)
    torch.testing.assert_close(target, r + q.decode(payload, scales, g8))
    ph, sh = q.hadamard_quantize(x, g8, 32, u)
    rows = torch.stack([ph, q.encode(r, g8, u)[0]])
    srows = torch.stack([sh, q.encode(r, g8, u)[1]])
    total = q.decode(rows[0], srows[0], g8) + q.decode(rows[1], srows[1], g8)
    torch.testing.assert_close(q.dequantize_sum_hadamard(rows, srows, g8, 32), hadamard_transform(total, 32) / 32)
    p4, s4 = q.dequantize_sum_requantize(rows, srows, g8, g4, u)
    assert all(torch.equal(a, b) for a, b in zip((p4, s4), q.encode(total, g4, u), strict=True))
    # Hadamard smoothing round trip: quantise in the transformed domain, invert, close to x
    back = q.dequantize_sum_hadamard(ph[None], sh[None], g8, 32)
    assert (back - x).norm() / x.norm() < 0.02


def test_bad_input_messages():
    with pytest.raises(ValueError, match="whole number of quantisation groups"):
        q.quantize(torch.zeros(100), QuantFormat(4, 64))
    with pytest.raises(ValueError, match="rounding"):
        q.quantize(torch.zeros(128), QuantFormat(4, 64), "up")
    with pytest.raises(ValueError, match="noise has 64 values, expected 128"):
        q.quantize(torch.zeros(128), QuantFormat(4, 64), RoundingSource(noise=torch.rand(64)))
    with pytest.raises(ValueError, match="need 2 scales"):
        q.decode(torch.zeros(64, dtype=torch.uint8), torch.ones(3), QuantFormat(4, 64))
    with pytest.raises(ValueError, match="even number"):
        q.pack_int4(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of hadamard_size"):
        q.hadamard_quantize(torch.zeros(96), QuantFormat(8, 48), 32)


@pytest.mark.parametrize(
    "bits,group_size,message",
    [
        (3, 64, "supports \\(4, 8\\) bits, got bits=3"),
        (True, 64, "bits=True"),
        (4, 0, "positive integer, got 0"),
        (8, 2.0, "positive integer, got 2.0"),
        (4, 33, "packed two per byte, so group_size must be even, got 33"),
    ],
)
def test_quant_format_validates_itself(bits, group_size, message):
    with pytest.raises(ValueError, match=message):
        QuantFormat(bits, group_size)


def test_quant_format_sizes():
    fmt = QuantFormat(4, 128)
    assert (fmt.qmax, QuantFormat(8, 33).qmax) == (7, 127)  # odd groups are fine at 8 bits (no packing)
    assert fmt.bits_per_value == 4.25 and QuantFormat(8, 2048).bits_per_value == 8 + 32 / 2048
    assert fmt.payload_bytes(256) == 128 and fmt.num_groups(256) == 2
    with pytest.raises(ValueError, match="whole bytes"):
        fmt.payload_bytes(7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fmt.bits = 8  # type: ignore[misc]
