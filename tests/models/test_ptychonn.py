import math

import pytest
import torch

from lightning_sdp.models.ptychonn import PtychoNN


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _model(**kw):
    return PtychoNN(image_size=16, base_channels=4, depth=2, **kw)


def test_output_shape_and_ranges():
    m = _model()
    out = m(torch.randn(3, 1, 16, 16) * 10)
    assert out.shape == (3, 2, 16, 16)
    assert out[:, 0].min() >= 0 and out[:, 0].max() <= 1
    assert out[:, 1].abs().max() <= math.pi


def test_per_sample_loss_matches_reference():
    m = _model(phase_weight=0.5)
    pred, target = torch.rand(4, 2, 16, 16), torch.rand(4, 2, 16, 16)
    ref = torch.stack(
        [
            torch.nn.functional.mse_loss(pred[i, 0], target[i, 0])
            + 0.5 * torch.nn.functional.mse_loss(pred[i, 1], target[i, 1])
            for i in range(4)
        ]
    )
    torch.testing.assert_close(m.per_sample_loss(pred, target), ref)


def test_loss_scale_sum_equals_mean_and_tuple_batches():
    m = _model()
    x, y = torch.randn(5, 1, 16, 16), torch.rand(5, 2, 16, 16)
    scaled, n = m._loss({"input": x, "target": y, "loss_scale": torch.tensor(1 / 5)})
    plain, _ = m._loss((x, y))
    mean = m.per_sample_loss(m(x), y).mean()
    assert n == 5
    torch.testing.assert_close(scaled, mean)
    torch.testing.assert_close(plain, mean)
    doubled, _ = m._loss({"input": x, "target": y, "loss_scale": torch.tensor(2 / 5)})
    torch.testing.assert_close(doubled, 2 * mean)


def test_empty_local_batch_still_backpropagates_zero():
    m = _model()
    loss, n = m._loss(
        {
            "input": torch.zeros(0, 1, 16, 16),
            "target": torch.zeros(0, 2, 16, 16),
            "loss_scale": torch.tensor(4.0),
        }
    )
    assert n == 0 and float(loss) == 0.0
    loss.backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.count_nonzero(g) == 0 for g in grads)


def test_bad_shapes_say_what_was_expected():
    m = _model()
    with pytest.raises(ValueError, match=r"expects inputs of shape \(batch, 1, 16, 16\).*got \(2, 3, 16, 16\)"):
        m(torch.zeros(2, 3, 16, 16))
    with pytest.raises(ValueError, match=r"expects targets of shape \(2, 2, 16, 16\)"):
        m._loss((torch.zeros(2, 1, 16, 16), torch.zeros(2, 1, 16, 16)))
    with pytest.raises(ValueError, match="divisible"):
        PtychoNN(image_size=20, depth=3)
    with pytest.raises(ValueError, match="optimizer"):
        PtychoNN(optimizer="lbfgs")


def test_learns_on_a_fixed_batch():
    torch.manual_seed(0)
    m = _model(learning_rate=3e-3)
    opt = m.configure_optimizers()
    x = torch.rand(8, 1, 16, 16)
    y = torch.cat([0.6 + 0.4 * x, x - 0.5], dim=1)
    first = None
    for _ in range(60):
        opt.zero_grad()
        loss, _ = m._loss((x, y))
        loss.backward()
        opt.step()
        first = first if first is not None else float(loss)
    assert float(loss) < 0.5 * first
