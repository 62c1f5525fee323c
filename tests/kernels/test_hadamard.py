import pytest
import torch

from lightning_sdp.kernels.hadamard import fast_walsh_hadamard, hadamard_matrix, hadamard_transform


@pytest.mark.parametrize("n", [1, 2, 8, 32, 64])
def test_hadamard_matrix_identities(n):
    h = hadamard_matrix(n)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    torch.testing.assert_close(h, h.T)
    torch.testing.assert_close(h @ h, n * torch.eye(n))
    # Sylvester ordering: H[i, j] = (-1)^popcount(i & j)
    i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    popcount = torch.zeros_like(i)
    v = i & j
    while bool(v.any()):
        popcount += v & 1
        v = v >> 1
    torch.testing.assert_close(h, (1 - 2 * (popcount % 2)).float())


def test_transform_matches_butterfly_and_inverts():
    x = torch.randn(7 * 32, dtype=torch.float64)
    y = hadamard_transform(x, 32)
    torch.testing.assert_close(y, fast_walsh_hadamard(x, 32))
    torch.testing.assert_close(hadamard_transform(y, 32) / 32, x)
    # blocks are independent and the transform is linear
    x2 = torch.randn_like(x)
    torch.testing.assert_close(hadamard_transform(2 * x + x2, 32), 2 * y + hadamard_transform(x2, 32))
    z = x.clone()
    z[32:] = 0
    assert torch.all(hadamard_transform(z, 32)[32:] == 0)


def test_hadamard_spreads_an_outlier():
    x = torch.zeros(32)
    x[5] = 32.0
    y = hadamard_transform(x, 32)
    assert torch.all(y.abs() == 32.0)  # an outlier becomes a flat block: absmax / rms drops from sqrt(32) to 1
    torch.testing.assert_close(y.norm(), (32**0.5) * x.norm())


def test_hadamard_bad_sizes():
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(24)
    with pytest.raises(ValueError, match="whole number of blocks"):
        hadamard_transform(torch.zeros(33), 32)
