"""Operator classification and category sums, on the real CPU profiler and on synthetic (CUDA-like) events."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from lightning_sdp.profiling.breakdown import categorize_events
from lightning_sdp.profiling.categories import CATEGORIES, classify_kernel, classify_op, is_tensor_core_kernel
from lightning_sdp.profiling.module_groups import module_group


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("aten::mm", "matrix"),
        ("aten::addmm", "matrix"),
        ("aten::bmm", "matrix"),
        ("aten::baddbmm", "matrix"),
        ("aten::convolution_backward", "matrix"),
        ("aten::_scaled_mm", "matrix"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention_fused"),
        ("aten::_scaled_dot_product_efficient_attention_backward", "attention_fused"),
        ("aten::_flash_attention_forward", "attention_fused"),
        ("aten::_softmax", "vector"),
        ("aten::native_layer_norm", "vector"),
        ("aten::gelu_backward", "vector"),
        ("aten::_foreach_mul_", "vector"),
        ("aten::add_.Tensor", "vector"),
        ("aten::copy_", "memory"),
        ("aten::cat", "memory"),
        ("aten::index_select", "memory"),
        ("aten::embedding_dense_backward", "memory"),
        ("nccl:all_reduce", "communication"),
        ("c10d::allreduce_", "communication"),
        ("gloo:broadcast", "communication"),
        ("aten::view", "host_other"),
        ("aten::transpose", "host_other"),
        ("autograd::engine::evaluate_function: MmBackward0", "host_other"),
        ("Optimizer.step#AdamW.step", "host_other"),
        ("aten::linear", None),
        ("aten::matmul", None),
        ("aten::einsum", None),
        ("aten::scaled_dot_product_attention", None),
    ],
)
def test_classify_op(name, category):
    assert classify_op(name) == category


def test_kernel_names():
    assert classify_kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matrix"
    assert classify_kernel("ampere_sgemm_128x64_tn") == "matrix"
    assert classify_kernel("flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>") == "attention_fused"
    assert classify_kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert classify_kernel("Memcpy HtoD (Pageable -> Device)") == "memory"
    assert classify_kernel("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>") is None
    assert is_tensor_core_kernel("sm80_xmma_gemm_f16f16_f16f32_f32_nn_n_tilesize96x128x32_stage4")
    assert is_tensor_core_kernel("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn")
    assert not is_tensor_core_kernel("ampere_sgemm_128x64_tn")
    assert not is_tensor_core_kernel("volta_sgemm_64x32_sliced1x4_nn")


def test_module_groups():
    types = {"transformer.h.0.ln_1": "LayerNorm", "transformer.wte": "Embedding", "crit": "CrossEntropyLoss"}
    assert module_group("transformer.h.0.attn.c_attn", types) == "attention"
    assert module_group("transformer.h.0.mlp.c_fc", types) == "mlp"
    assert module_group("transformer.h.0.ln_1", types) == "norm"
    assert module_group("transformer.wte", types) == "embedding"
    assert module_group("lm_head", types) == "head"
    assert module_group("crit", types) == "loss"
    assert module_group("encoder.block3", types) == "other"
    # torch.nn.TransformerEncoderLayer and LLaMA-style names.
    assert module_group("layers.0.linear1", {}) == "mlp"
    assert module_group("layers.0.self_attn.out_proj", {}) == "attention"
    assert module_group("model.layers.3.mlp.down_proj", {}) == "mlp"
    assert module_group("layers.0.norm2", {}) == "norm"


def _profile(fn, steps=3):
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        span = (time.perf_counter() - t0) * 1e6
    return prof.events(), span


def test_matmul_model_is_mostly_matrix_and_categories_sum_to_span():
    a = torch.randn(8, 128, 128)
    b = torch.randn(8, 128, 128)
    w = torch.randn(256, 256)
    x = torch.randn(256, 256)

    def fn():
        torch.bmm(a, b)
        for _ in range(4):
            torch.mm(x, w)

    events, span = _profile(fn)
    br = categorize_events(events, span)
    assert sum(br.times_us.values()) == pytest.approx(span, rel=1e-9)
    assert br.covered_us <= span * 1.001
    fr = br.fractions()
    assert set(fr) == set(CATEGORIES)
    assert fr["matrix"] > 0.5, fr
    assert fr["matrix"] == max(fr.values())


def test_elementwise_model_is_mostly_vector():
    x = torch.randn(1 << 18)

    def fn():
        y = torch.exp(x)
        y = y * 1.5 + x
        torch.tanh(y).sum()

    events, span = _profile(fn)
    br = categorize_events(events, span)
    assert sum(br.times_us.values()) == pytest.approx(span, rel=1e-9)
    fr = br.fractions()
    assert fr["vector"] > 0.5, fr
    assert fr["matrix"] == 0.0


def test_composite_linear_inherits_matrix_and_fused_sdpa_is_attention():
    lin = torch.nn.Linear(128, 128)
    x = torch.randn(64, 128)
    q = torch.randn(2, 2, 64, 16)

    def fn():
        F.linear(x, lin.weight, lin.bias)
        F.scaled_dot_product_attention(q, q, q)

    events, span = _profile(fn, steps=2)
    br = categorize_events(events, span)
    assert br.op_times_us["aten::linear"][0] == "matrix"
    assert br.times_us["attention_fused"] > 0
    # The composite SDPA entry inherits the fused kernel's category.
    assert br.op_times_us["aten::scaled_dot_product_attention"][0] == "attention_fused"


# ---- synthetic events (the CUDA path cannot run here: no GPU in CI)


def _ev(name, self_us, start, end, parent=None, seq=-1, kernels=()):
    e = SimpleNamespace(
        name=name,
        self_cpu_time_total=self_us,
        cpu_time_total=end - start,
        cpu_children=[],
        cpu_parent=parent,
        sequence_nr=seq,
        kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels],
        device_type=None,
        time_range=SimpleNamespace(start=start, end=end),
    )
    if parent is not None:
        parent.cpu_children.append(e)
    return e


def test_cuda_kernel_attribution_and_tensor_cores():
    scope = _ev("module::transformer.h.0.attn.c_attn", 1, 0, 50)
    lin = _ev("aten::linear", 1, 1, 40, scope, seq=3)
    mm = _ev("aten::addmm", 5, 2, 30, lin, seq=4, kernels=[("sm80_xmma_gemm_bf16_tn", 300.0)])
    soft = _ev("aten::_softmax", 3, 41, 45, scope, seq=5, kernels=[("softmax_warp_forward", 100.0)])
    slow = _ev("aten::mm", 2, 46, 49, None, seq=6, kernels=[("ampere_sgemm_128x64_tn", 100.0)])
    bwd = _ev("autograd::engine::evaluate_function: AddmmBackward0", 1, 60, 80, seq=4)
    mmb = _ev("aten::mm", 2, 61, 70, bwd, kernels=[("sm80_xmma_gemm_bf16_nt", 200.0)])
    events = [scope, lin, mm, soft, slow, bwd, mmb]
    br = categorize_events(events, span_us=1000.0, device="cuda", module_types={})
    assert br.times_us["matrix"] == pytest.approx(600.0)
    assert br.times_us["vector"] == pytest.approx(100.0)
    assert br.times_us["host_other"] == pytest.approx(300.0)  # device idle
    assert sum(br.times_us.values()) == pytest.approx(1000.0)
    assert br.matrix_kernel_us == pytest.approx(600.0)
    assert br.tensor_core_us == pytest.approx(500.0)
    # The backward GEMM is attributed to the forward module through the autograd sequence number.
    assert br.module_times_us["attention"]["matrix"] == pytest.approx(500.0)
    assert br.module_times_us["other"]["matrix"] == pytest.approx(100.0)


def test_composite_takes_its_compute_child_even_when_a_view_is_slower():
    # On a loaded CI host the ``aten::t`` view under a tiny ``linear`` once outlasted its ``addmm``.
    lin = _ev("aten::linear", 2, 0, 100)
    _ev("aten::t", 60, 1, 61, lin)
    _ev("aten::addmm", 30, 62, 92, lin)
    br = categorize_events([lin, *lin.cpu_children], span_us=100.0)
    assert br.op_times_us["aten::linear"][0] == "matrix"
    assert br.times_us["matrix"] == pytest.approx(32.0)


def test_overlapping_streams_are_scaled_to_the_span():
    a = _ev("aten::mm", 1, 0, 10, kernels=[("cutlass_80_tensorop_gemm", 800.0)])
    b = _ev("nccl:all_reduce", 1, 0, 10, kernels=[("ncclDevKernel_AllReduce", 600.0)])
    br = categorize_events([a, b], span_us=1000.0, device="cuda")
    assert br.overlap_scale == pytest.approx(1000 / 1400)
    assert sum(br.times_us.values()) == pytest.approx(1000.0)
    assert br.times_us["matrix"] / br.times_us["communication"] == pytest.approx(800 / 600)


def test_optimizer_math_separated_from_training_closure():
    opt = _ev("Optimizer.step#AdamW.step", 5, 0, 100)
    fwd = _ev("aten::mul", 10, 1, 20, opt, seq=1)
    bwd = _ev("autograd::engine::evaluate_function: MulBackward0", 1, 20, 40, opt, seq=1)
    _ev("aten::mul", 10, 21, 39, bwd)
    _ev("aten::_foreach_add_", 30, 50, 90, opt)
    events = [opt, fwd, bwd, *bwd.cpu_children, *opt.cpu_children[2:]]
    br = categorize_events(events, span_us=100.0)
    assert br.module_times_us["optimizer"]["vector"] == pytest.approx(30.0)
    assert br.module_times_us["other"]["vector"] == pytest.approx(20.0)


def test_negative_span_rejected():
    with pytest.raises(ValueError, match="span_us"):
        categorize_events([], -1.0)


def test_backward_on_another_thread_still_ends_the_closure():
    # CUDA: the autograd engine runs backward nodes on a device thread, outside the Optimizer.step parent chain.
    opt = _ev("Optimizer.step#AdamW.step", 5, 0, 100)
    loss = _ev("aten::cross_entropy_loss", 10, 1, 20, opt, seq=1)
    bwd = _ev("autograd::engine::evaluate_function: NllLossBackward0", 1, 20, 40, None, seq=1)
    inner = _ev("aten::nll_loss_backward", 10, 21, 39, bwd)
    step = _ev("aten::_foreach_add_", 30, 50, 90, opt)
    br = categorize_events([opt, loss, bwd, inner, step], span_us=100.0)
    assert br.module_times_us["optimizer"]["vector"] == pytest.approx(30.0)
    assert br.module_times_us["loss"]["vector"] == pytest.approx(20.0)
