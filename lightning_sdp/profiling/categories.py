"""Classify profiler events into engine categories and sum their self times.

Categories (``CATEGORIES``):

- ``matrix``: work for the matrix engine (Gaudi MME, tensor cores): ``mm``, ``addmm``, ``bmm``, ``baddbmm``,
  convolutions and their backward, ``_scaled_mm``... Composite operators (``linear``, ``matmul``, ``einsum``,
  ``scaled_dot_product_attention`` when it falls back to the math path) have no category of their own: their self
  time inherits the category of their most expensive child.
- ``attention_fused``: fused attention kernels (flash / memory-efficient / cuDNN SDPA, CPU flash attention).
- ``vector``: everything elementwise or reducing (softmax, norms, activations, arithmetic, optimizer math): the
  vector engines (Gaudi TPC, CUDA cores).
- ``memory``: data movement (copies, ``cat``, index/gather/scatter, embedding lookups, fills, allocation).
- ``communication``: collectives (NCCL, gloo, HCCL).
- ``host_other``: framework work on the host (autograd engine, Python scopes, view/metadata operators) and the
  part of the measured step time that no operator covers.

On the CPU an event's cost is its *self* CPU time, so nothing is counted twice and the categories plus the
uncovered remainder sum to the measured wall time. On CUDA the cost is the device time of the kernels each operator
launched (``FunctionEvent.kernels``); a kernel whose name is decisive (GEMM, flash attention, NCCL, memcpy) keeps
its own category, otherwise it takes the launching operator's.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

CATEGORIES: tuple[str, ...] = ("matrix", "attention_fused", "vector", "memory", "communication", "host_other")

# Module groups of the per-module view.
MODULE_GROUPS: tuple[str, ...] = (
    "attention",
    "mlp",
    "norm",
    "embedding",
    "head",
    "loss",
    "optimizer",
    "other",
)

MODULE_SCOPE_PREFIX = "module::"

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


def module_group(path: str, module_types: Mapping[str, str] | None = None) -> str:
    """Group of a module path for the per-module view.

    The module's own type decides first (``LayerNorm`` -> ``norm``, ``Embedding`` -> ``embedding``,
    ``MultiheadAttention`` -> ``attention``, loss modules -> ``loss``); otherwise the path components are read from
    the innermost outwards for keywords (``attn``, ``mlp``/``ffn``, ``ln``/``norm``, ``wte``/``emb``,
    ``head``).

    Args:
        path: dotted module path, e.g. ``"transformer.h.0.attn.c_proj"``.
        module_types: map ``path -> class name`` of the model's modules.
    """
    types = module_types or {}
    parts = path.split(".") if path else []
    for i in range(len(parts), 0, -1):
        sub = ".".join(parts[:i])
        tname = types.get(sub, "").lower()
        if tname:
            if "norm" in tname:
                return "norm"
            if "embedding" in tname:
                return "embedding"
            if "attention" in tname:
                return "attention"
            if tname.endswith("loss"):
                return "loss"
            if tname in ("mlp", "feedforward", "ffn"):
                return "mlp"
        comp = parts[i - 1].lower()
        if "attn" in comp or "attention" in comp:
            return "attention"
        if comp in _MLP_NAMES or "mlp" in comp or "ffn" in comp:
            return "mlp"
        if comp.startswith("ln") or "norm" in comp:
            return "norm"
        if comp in ("wte", "wpe", "tok_emb", "pos_emb") or "emb" in comp:
            return "embedding"
        if "head" in comp or comp in ("classifier", "output", "out_proj_vocab"):
            return "head"
        if "loss" in comp or "criterion" in comp:
            return "loss"
    return "other"


_MLP_NAMES = {
    "ff",
    "fc",
    "fc1",
    "fc2",
    "c_fc",
    "feed_forward",
    "feedforward",
    "linear1",
    "linear2",
    "intermediate",
    "up_proj",
    "down_proj",
    "gate_proj",
    "dense_h_to_4h",
    "dense_4h_to_h",
    "w1",
    "w2",
    "w3",
}

_LOSS_OPS = re.compile(
    r"(cross_entropy|nll_loss|log_softmax|_log_softmax|mse_loss|l1_loss|binary_cross_entropy|"
    r"smooth_l1|kl_div|ctc_loss|huber_loss)"
)


@dataclass
class CategoryBreakdown:
    """Times (microseconds) per category over a measured span, plus per-op and per-module detail.

    Attributes:
        span_us: measured wall time of the window (all active steps).
        times_us: time per category; ``host_other`` includes the span no event covers.
        op_times_us: time and category per operator name.
        module_times_us: time per module group, then per category.
        covered_us: sum of the event times before adding the uncovered remainder.
        overlap_scale: factor (<= 1) applied when events overlapped (several threads or streams) so that the
            categories still sum to the span.
        tensor_core_us: CUDA matrix-kernel time on tensor cores; ``None`` off CUDA.
        matrix_kernel_us: CUDA matrix-kernel time in total; ``None`` off CUDA.
        host_busy_us: host time inside operators (CUDA: to judge host-bound steps).
    """

    span_us: float
    times_us: dict[str, float]
    op_times_us: dict[str, tuple[str, float]] = field(default_factory=dict)
    module_times_us: dict[str, dict[str, float]] = field(default_factory=dict)
    covered_us: float = 0.0
    overlap_scale: float = 1.0
    tensor_core_us: float | None = None
    matrix_kernel_us: float | None = None
    host_busy_us: float = 0.0

    def fractions(self) -> dict[str, float]:
        """Share of the span per category (sums to 1)."""
        total = sum(self.times_us.values())
        if total <= 0:
            return {c: 0.0 for c in CATEGORIES}
        return {c: self.times_us.get(c, 0.0) / total for c in CATEGORIES}


def _resolve_category(event: Any, cache: dict[int, str]) -> str:
    key = id(event)
    if key in cache:
        return cache[key]
    cat = classify_op(event.name)
    if cat is None:
        children = [c for c in getattr(event, "cpu_children", []) or [] if not is_annotation(c.name)]
        if children:
            best = max(children, key=lambda c: c.cpu_time_total)
            cat = _resolve_category(best, cache)
        else:
            base = op_base_name(event.name)
            cat = "attention_fused" if "attention" in base and "math" not in base else "vector"
    cache[key] = cat
    return cat


def _enclosing_scope(event: Any) -> tuple[str | None, Any, Any]:
    """(innermost module path, enclosing ``Optimizer.step`` event, enclosing autograd backward node) of an event.

    Scopes are read from the innermost outwards and only the innermost of module / backward node counts (a backward
    node inside a module scope cannot happen, a module inside the optimizer step can: Lightning runs the whole
    training closure inside ``optimizer.step``).
    """
    module = None
    optimizer = None
    backward = None
    node = event
    while node is not None:
        name = node.name
        if module is None and backward is None and name.startswith(MODULE_SCOPE_PREFIX):
            module = name[len(MODULE_SCOPE_PREFIX) :]
        if optimizer is None and (
            name.startswith("Optimizer.step") or name.startswith("Optimizer.zero_grad")
        ):
            optimizer = node
        if backward is None and module is None and name.startswith("autograd::engine::evaluate_function"):
            backward = node
        node = getattr(node, "cpu_parent", None)
    return module, optimizer, backward


def _closure_ends(events: list[Any]) -> dict[int, float]:
    """For each ``Optimizer.step`` event: end time of the last backward node that ran during it (the closure).

    Operators inside the optimizer step that start after this are the optimizer's own math; the ones before belong
    to the forward/backward closure that Lightning runs inside ``optimizer.step(closure)``. Backward nodes are
    matched by time, not by parent, because on CUDA the autograd engine runs them on its own device thread.
    """
    steps = [e for e in events if e.name.startswith("Optimizer.step")]
    ends: dict[int, float] = {}
    if not steps:
        return ends
    for e in events:
        if not e.name.startswith("autograd::engine::evaluate_function"):
            continue
        start, end = float(e.time_range.start), float(e.time_range.end)
        for opt in steps:
            if float(opt.time_range.start) <= start <= float(opt.time_range.end):
                ends[id(opt)] = max(ends.get(id(opt), float("-inf")), end)
    return ends


def categorize_events(
    events: Iterable[Any],
    span_us: float,
    device: str = "cpu",
    module_types: Mapping[str, str] | None = None,
) -> CategoryBreakdown:
    """Sum profiler events into engine categories and module groups over a measured span.

    Args:
        events: ``torch.profiler`` ``FunctionEvent`` objects (``prof.events()``) or anything with the same
            attributes (``name``, ``self_cpu_time_total``, ``cpu_time_total``, ``cpu_children``, ``cpu_parent``,
            ``sequence_nr``, ``kernels``, ``device_type``).
        span_us: the measured wall time the events cover, in microseconds.
        device: ``"cpu"`` (self CPU times) or ``"cuda"`` (kernel device times attributed to their operators).
        module_types: map ``module path -> class name`` for :func:`module_group`.

    Returns:
        A :class:`CategoryBreakdown` whose ``times_us`` sum to ``span_us``.
    """
    if span_us < 0:
        raise ValueError(f"span_us must be >= 0, got {span_us}")
    cpu_events = [e for e in events if _is_cpu_event(e)]
    cache: dict[int, str] = {}
    times: dict[str, float] = defaultdict(float)
    op_times: dict[str, list] = {}
    # Forward autograd sequence numbers -> module group, to attribute backward nodes to the forward module.
    seq_group: dict[int, str] = {}
    event_group: dict[int, str] = {}
    closure_end = _closure_ends(cpu_events)
    for e in cpu_events:
        module, optimizer, backward = _enclosing_scope(e)
        in_optimizer_math = (
            optimizer is not None
            and module is None
            and backward is None
            and (
                optimizer.name.startswith("Optimizer.zero_grad")
                or float(e.time_range.start) >= closure_end.get(id(optimizer), float("-inf"))
            )
        )
        if in_optimizer_math:
            group = "optimizer"
        elif backward is not None:
            group = ""  # resolved below from the forward sequence number
        elif module is not None:
            group = module_group(module, module_types)
        elif _LOSS_OPS.search(op_base_name(e.name)):
            group = "loss"
        else:
            group = "other"
        event_group[id(e)] = group
        seq = getattr(e, "sequence_nr", -1)
        if group and seq is not None and seq >= 0 and backward is None and seq not in seq_group:
            seq_group[seq] = group
    modules: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    host_busy = 0.0
    tc_us = 0.0
    mat_k_us = 0.0
    for e in cpu_events:
        group = event_group[id(e)]
        if group == "":
            _, _, backward = _enclosing_scope(e)
            group = seq_group.get(getattr(backward, "sequence_nr", -1), "other")
        cat = _resolve_category(e, cache)
        self_cpu = float(e.self_cpu_time_total)
        if cat != "host_other" and not is_annotation(e.name):
            host_busy += self_cpu
        contributions: list[tuple[str, float]]
        if device == "cuda":
            contributions = []
            for k in getattr(e, "kernels", []) or []:
                kcat = classify_kernel(k.name) or (cat if cat != "host_other" else "vector")
                contributions.append((kcat, float(k.duration)))
                if kcat == "matrix":
                    mat_k_us += float(k.duration)
                    if is_tensor_core_kernel(k.name):
                        tc_us += float(k.duration)
        else:
            contributions = [(cat, self_cpu)]
        for kcat, t in contributions:
            if t <= 0:
                continue
            times[kcat] += t
            modules[group][kcat] += t
            entry = op_times.setdefault(e.name, [kcat, 0.0])
            entry[1] += t
    covered = sum(times.values())
    scale = 1.0
    if covered > span_us > 0:
        # Events overlapped (several host threads, or kernels on several streams): scale to the span.
        scale = span_us / covered
        for c in list(times):
            times[c] *= scale
        for g in modules.values():
            for c in list(g):
                g[c] *= scale
    times["host_other"] += max(0.0, span_us - covered * scale)
    result = {c: float(times.get(c, 0.0)) for c in CATEGORIES}
    return CategoryBreakdown(
        span_us=float(span_us),
        times_us=result,
        op_times_us={k: (v[0], v[1] * scale) for k, v in op_times.items()},
        module_times_us={g: dict(v) for g, v in modules.items()},
        covered_us=covered,
        overlap_scale=scale,
        tensor_core_us=tc_us if device == "cuda" else None,
        matrix_kernel_us=mat_k_us if device == "cuda" else None,
        host_busy_us=host_busy,
    )


def _is_cpu_event(e: Any) -> bool:
    dt = getattr(e, "device_type", None)
    if dt is None:
        return True
    return str(dt).endswith("CPU")
