"""FLOP and vector-work counting against analytic values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_sdp.profiling.flops import WorkCounter, causal_fraction, count_work


def test_linear_forward_flops_equal_analytic():
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64)
    wc = count_work(lambda: lin(x))
    assert wc.matrix_flops == 2 * 8 * 64 * 32 == 32_768
    assert wc.attention_flops == 0


def test_linear_forward_backward_with_input_grad():
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64, requires_grad=True)
    wc = count_work(lambda: lin(x).sum().backward())
    assert wc.matrix_flops == 98_304  # forward + grad input + grad weight
    # Without an input gradient the backward only computes the weight gradient.
    x2 = torch.randn(8, 64)
    wc2 = count_work(lambda: lin(x2).sum().backward())
    assert wc2.matrix_flops == 2 * 32_768


def test_mlp_flops_match_reference_formula():
    torch.manual_seed(0)
    b, d, h = 4, 24, 40
    mlp = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.GELU(), torch.nn.Linear(h, d))
    x = torch.randn(b, d, requires_grad=True)
    wc = count_work(lambda: mlp(x).square().mean().backward())
    reference = 3 * (2 * b * d * h + 2 * b * h * d)
    assert wc.matrix_flops == reference
    assert wc.flops_by_module  # per-module split from FlopCounterMode
    assert wc.dtypes == {"float32": 6}


def test_cpu_fused_sdpa_counted():
    b, h, n, e = 2, 3, 16, 8
    q = torch.randn(b, h, n, e, requires_grad=True)
    k = torch.randn(b, h, n, e, requires_grad=True)
    v = torch.randn(b, h, n, e, requires_grad=True)
    fwd = count_work(lambda: F.scaled_dot_product_attention(q, k, v))
    assert fwd.attention_flops == 4 * b * h * n * n * e
    both = count_work(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward())
    assert both.attention_flops == 4 * b * h * n * n * e + 10 * b * h * n * n * e
    assert both.matrix_flops == 0


@pytest.mark.parametrize(("n_q", "n_k"), [(16, 16), (8, 16)])
def test_causal_sdpa_counts_the_unmasked_scores_only(n_q, n_k):
    b, h, e = 2, 3, 8
    q = torch.randn(b, h, n_q, e, requires_grad=True)
    k, v = (torch.randn(b, h, n_k, e, requires_grad=True) for _ in range(2))
    full = count_work(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward()).attention_flops
    causal = count_work(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())
    # top-left aligned mask: row i sees keys 0..i
    kept = sum(min(i + 1, n_k) for i in range(n_q))
    assert causal_fraction(n_q, n_k) == kept / (n_q * n_k)
    assert full == 14 * b * h * n_q * n_k * e  # forward 4 + backward 10, as above
    assert causal.attention_flops == pytest.approx(full * kept / (n_q * n_k), rel=1e-6)
    assert causal.attention_flops < full


def test_causal_fraction_of_a_longer_query():
    assert causal_fraction(4, 2) == (1 + 2 + 2 + 2) / 8
    assert causal_fraction(1, 1) == 1.0


def test_explicit_attention_flops_are_matrix_and_softmax_is_vector_work():
    b, h, n, e = 2, 3, 16, 8
    q = torch.randn(b, h, n, e)
    wc = count_work(lambda: torch.softmax(q @ q.transpose(-2, -1), dim=-1) @ q)
    assert wc.matrix_flops == 4 * b * h * n * n * e
    assert wc.elements["vector"] == b * h * n * n  # softmax output
    assert wc.bytes["vector"] == 2 * b * h * n * n * 4  # read + write fp32


def test_elementwise_elements_and_bytes():
    x = torch.randn(1000)
    wc = count_work(lambda: (x * 2.0).exp())
    assert wc.elements["vector"] == 2000
    assert wc.bytes["vector"] == 4 * (1000 + 1000) * 2
    assert wc.matrix_flops == 0


def test_host_fallback_flagged_when_model_is_on_an_accelerator():
    x = torch.randn(100)
    wc = count_work(lambda: x.exp(), accelerator="hpu")
    assert wc.host_fallback_ops == {"aten::exp": 1}
    assert not count_work(lambda: x.exp()).host_fallback_ops


def test_counter_exits_cleanly_on_exception():
    with pytest.raises(RuntimeError, match="boom"), WorkCounter():
        torch.ones(3).exp()
        raise RuntimeError("boom")
    # No dispatch mode left on the stack: a later counter works from scratch.
    lin = torch.nn.Linear(64, 32)
    assert count_work(lambda: lin(torch.randn(8, 64))).matrix_flops == 32_768
