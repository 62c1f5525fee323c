"""Engine categories: which engine an operator or a CUDA kernel name stands for.

Categories (``CATEGORIES``):

- ``matrix``: work for the matrix engine (Gaudi MME, tensor cores): ``mm``, ``addmm``, ``bmm``, ``baddbmm``,
  convolutions and their backward, ``_scaled_mm``... Composite operators (``linear``, ``matmul``, ``einsum``,
  ``scaled_dot_product_attention`` when it falls back to the math path) have no category of their own: their self
  time inherits the category of their most expensive child that computes (views such as ``aten::t`` are passed
  over; :func:`classify_op` returns ``None`` for composites).
- ``attention_fused``: fused attention kernels (flash / memory-efficient / cuDNN SDPA, CPU flash attention).
- ``vector``: everything elementwise or reducing (softmax, norms, activations, arithmetic, optimizer math): the
  vector engines (Gaudi TPC, CUDA cores).
- ``memory``: data movement (copies, ``cat``, index/gather/scatter, embedding lookups, fills, allocation).
- ``communication``: collectives (NCCL, gloo, HCCL).
- ``host_other``: framework work on the host (autograd engine, Python scopes, view/metadata operators) and the
  part of the measured step time that no operator covers.

This module holds only the name tables and the classification of one name; summing a profile's events into these
categories is :mod:`~lightning_sdp.profiling.breakdown`, the per-module view's groups are
:mod:`~lightning_sdp.profiling.module_groups`.
"""

from __future__ import annotations

import re

from lightning_sdp.profiling.module_groups import MODULE_SCOPE_PREFIX

CATEGORIES: tuple[str, ...] = ("matrix", "attention_fused", "vector", "memory", "communication", "host_other")

_MATRIX_OPS = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "mv",
    "addmv",
    "dot",
    "vdot",
    "_scaled_mm",
    "_int_mm",
    "_addmm_activation",
    "_weight_int8pack_mm",
    "_weight_int4pack_mm",
    "convolution",
    "_convolution",
    "convolution_backward",
    "convolution_overrideable",
    "convolution_backward_overrideable",
    "mkldnn_convolution",
    "mkldnn_linear",
    "mkldnn_linear_backward",
    "mkldnn_linear_backward_input",
    "mkldnn_linear_backward_weights",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
    "miopen_convolution",
    "_mkldnn_convolution",
    "_slow_conv2d_forward",
    "_slow_conv2d_backward",
    "slow_conv3d_forward",
    "thnn_conv2d",
    "_nnpack_spatial_convolution",
}

# Composite operators: their self time takes the category of their most expensive child.
_COMPOSITE_OPS = {
    "linear",
    "matmul",
    "einsum",
    "tensordot",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "bilinear",
    "chain_matmul",
    "linalg_multi_dot",
    "scaled_dot_product_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_attention_math_for_mps",
    "multi_head_attention_forward",
    "_native_multi_head_attention",
    "bmm_out",
}

_ATTENTION_FUSED_RE = re.compile(
    r"^(_scaled_dot_product_(flash|efficient|cudnn|fused)_attention|_flash_attention|_efficient_attention|"
    r"_fused_sdp|_cudnn_attention|_flash_attention_forward|_flash_attention_backward|flex_attention|"
    r"_scaled_dot_product_flash_attention_for_cpu)"
)

_MEMORY_OPS = {
    "copy_",
    "_to_copy",
    "to",
    "clone",
    "contiguous",
    "cat",
    "_cat",
    "stack",
    "index",
    "index_select",
    "index_put_",
    "_index_put_impl_",
    "index_add_",
    "index_copy_",
    "index_fill_",
    "gather",
    "scatter",
    "scatter_",
    "scatter_add",
    "scatter_add_",
    "scatter_reduce",
    "embedding",
    "embedding_dense_backward",
    "embedding_backward",
    "_embedding_bag",
    "embedding_bag",
    "fill_",
    "zero_",
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "full",
    "full_like",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "new_zeros",
    "resize_",
    "set_",
    "constant_pad_nd",
    "pad",
    "repeat",
    "roll",
    "flip",
    "narrow_copy",
    "_unsafe_index",
    "masked_select",
    "nonzero",
    "take",
    "_foreach_copy_",
    "lift_fresh",
}

# Metadata-only operators: no data is touched, their (small) cost is host framework work.
_VIEW_OPS = {
    "view",
    "_unsafe_view",
    "reshape",
    "_reshape_alias",
    "transpose",
    "t",
    "permute",
    "as_strided",
    "expand",
    "expand_as",
    "unsqueeze",
    "squeeze",
    "select",
    "slice",
    "narrow",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "detach",
    "detach_",
    "alias",
    "view_as",
    "flatten",
    "unflatten",
    "movedim",
    "swapaxes",
    "numpy_T",
    "mT",
    "item",
    "_local_scalar_dense",
    "is_nonzero",
    "result_type",
    "size",
    "stride",
    "requires_grad_",
    "_has_compatible_shallow_copy_type",
    "resolve_conj",
    "resolve_neg",
    "lift",
    "record_stream",
    "set_grad_enabled",
}

_COMM_RE = re.compile(
    r"(nccl|gloo|hccl|c10d::|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_to_all|"
    r"alltoall|barrier|ProcessGroup)",
    re.IGNORECASE,
)

# CUDA kernel names.
_KERNEL_ATTENTION_RE = re.compile(r"(flash|fmha|attention|attn_fwd|attn_bwd|mha_fwd|mha_bwd)", re.IGNORECASE)
_KERNEL_MATRIX_RE = re.compile(
    r"(gemm|gemv|cublas|cutlass|xmma|hmma|wgmma|gmma|sm\d+_.*(s\d{4,5}|h\d{4,5}|i\d{4,5})|"
    r"_(s|h|i|bf16)?\d{3,5}gemm|ampere_|volta_|turing_|hopper_|sgemm|dgemm|conv|implicit_convolve|"
    r"winograd|magma|nvjet|cutensor|matmul)",
    re.IGNORECASE,
)
_KERNEL_MEMORY_RE = re.compile(
    r"(memcpy|memset|copy_kernel|cat_array|catarray|index_select|gather|scatter|"
    r"embedding|fill_kernel|vectorized_elementwise_kernel<\d+, at::native::FillFunctor)",
    re.IGNORECASE,
)
_KERNEL_COMM_RE = re.compile(r"(nccl|hccl|allreduce|allgather|reducescatter|sendrecv)", re.IGNORECASE)
# Tensor-core (matrix-engine) kernels: MMA instruction shapes and the families that always use them.
_TENSOR_CORE_RE = re.compile(
    r"(hmma|xmma|wgmma|gmma|imma|tensorop|tensor_op|s16816|h16816|i16832|s1688|h1688|i8816|884|"
    r"sm80_xmma|sm90_xmma|sm90_gemm|sm100|bf16gemm|tf32|16x8x16|64x64x16|nvjet|flash|fmha|mma)",
    re.IGNORECASE,
)


def op_base_name(name: str) -> str:
    """``"aten::addmm"`` -> ``"addmm"``; ``"aten::add_.Tensor"`` -> ``"add_"``; other names unchanged."""
    if "::" in name:
        ns, rest = name.split("::", 1)
        if ns in ("aten", "prims", "quantized", "xformers", "flash_attn", "hpu", "torch_npu", "inductor"):
            return rest.split(".", 1)[0]
    return name


def is_annotation(name: str) -> bool:
    """True for events that are scopes rather than operators (``record_function``, autograd engine, steps)."""
    return (
        name.startswith(MODULE_SCOPE_PREFIX)
        or name.startswith("autograd::")
        or name.startswith("Optimizer.")
        or name.startswith("ProfilerStep")
        or name.startswith("[pl]")
        or name.startswith("## ")
        or name.startswith("EngineProfiler")
        or "::" not in name
    )


def classify_op(name: str) -> str | None:
    """Engine category of one operator name, or ``None`` for composite operators that inherit from children.

    Args:
        name: profiler event name such as ``"aten::bmm"`` or ``"nccl:all_reduce"``.

    Returns:
        One of :data:`CATEGORIES`, or ``None`` when the operator is composite (``linear``, ``matmul``...).
    """
    if _COMM_RE.search(name):
        return "communication"
    base = op_base_name(name)
    if base in _COMPOSITE_OPS:
        return None
    if _ATTENTION_FUSED_RE.match(base):
        return "attention_fused"
    if base in _MATRIX_OPS:
        return "matrix"
    if base in _MEMORY_OPS:
        return "memory"
    if base in _VIEW_OPS:
        return "host_other"
    if is_annotation(name):
        return "host_other"
    # Every other operator (arithmetic, activations, norms, softmax, reductions, optimizer math) is vector work.
    return "vector"


def classify_kernel(name: str) -> str | None:
    """Category implied by a CUDA kernel name alone, or ``None`` when the launching operator should decide."""
    if _KERNEL_COMM_RE.search(name):
        return "communication"
    if _KERNEL_ATTENTION_RE.search(name):
        return "attention_fused"
    if _KERNEL_MEMORY_RE.search(name):
        return "memory"
    if _KERNEL_MATRIX_RE.search(name):
        return "matrix"
    return None


def is_tensor_core_kernel(name: str) -> bool:
    """True when a CUDA kernel name says it runs on tensor cores (MMA shapes, ``xmma``/``wgmma``, flash kernels)."""
    return bool(_TENSOR_CORE_RE.search(name))
