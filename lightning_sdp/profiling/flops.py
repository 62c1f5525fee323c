"""Matrix FLOPs and vector work of a training step.

Matrix FLOPs come from :class:`torch.utils.flop_counter.FlopCounterMode` (forward and backward), extended with the
CPU flash-attention operators it does not know (``_scaled_dot_product_flash_attention_for_cpu`` and its backward)
and with causal SDPA counted over the unmasked half of the scores (torch counts the whole matrix).
Vector work is counted by a small dispatch mode beside it: for every non-matrix operator, the elements it writes
and the bytes it reads and writes, split by engine category. The same mode notes operators that ran on CPU tensors
while the model lives on an accelerator (host fallback).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

from lightning_sdp.profiling.categories import classify_op

aten = torch.ops.aten


def _cpu_sdpa_flop(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(
    grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def causal_fraction(s_q: int, s_k: int) -> float:
    """Share of the ``s_q x s_k`` score matrix a causal mask keeps (SDPA aligns it top-left: row ``i`` sees ``j <= i``)."""
    if s_q <= 0 or s_k <= 0:
        return 1.0
    kept = s_q * (s_q + 1) // 2 if s_q <= s_k else s_k * (s_k + 1) // 2 + (s_q - s_k) * s_k
    return kept / (s_q * s_k)


def _argument_names(op: Any) -> list[str]:
    """Argument names of an operator's default overload (``[]`` when it has no schema)."""
    schema = getattr(getattr(op, "default", op), "_schema", None)
    return [a.name for a in schema.arguments] if schema is not None else []


def _causal_aware(op: Any, formula: Any) -> Any:
    """``formula`` (raw arguments, as ``FlopCounterMode`` calls it) scaled by :func:`causal_fraction` when causal.

    torch's SDPA formulas count the full score matrix whatever ``is_causal`` says, which makes causal attention look
    up to twice as fast as it is; the fused kernels skip the masked blocks.
    """
    names = _argument_names(op)
    where: dict[str, int] = {name: names.index(name) for name in ("is_causal", "query", "key") if name in names}

    def arg(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, default: Any = None) -> Any:
        if name in kwargs:
            return kwargs[name]
        i = where.get(name)
        return args[i] if i is not None and i < len(args) else default

    def counted(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        flops = formula(*args, out_val=out_val, **kwargs)
        query, key = arg(args, kwargs, "query"), arg(args, kwargs, "key")
        if not arg(args, kwargs, "is_causal", False) or query is None or key is None:
            return flops
        return int(flops * causal_fraction(int(query.shape[-2]), int(key.shape[-2])))

    counted._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode passes raw arguments, not shapes
    return counted


def extra_flop_formulas() -> dict[Any, Any]:
    """FLOP formulas ``FlopCounterMode`` lacks or gets wrong.

    Adds the CPU fused SDPA forward and backward, which it does not know, and counts every SDPA operator that takes
    ``is_causal`` (CPU, flash, memory-efficient, cuDNN) over the unmasked part of the score matrix only.
    """
    mapping: dict[Any, Any] = {}
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None:
        mapping[fwd] = shape_wrapper(_cpu_sdpa_flop)
    if bwd is not None:
        mapping[bwd] = shape_wrapper(_cpu_sdpa_backward_flop)
    for op, formula in {**flop_registry, **mapping}.items():
        # the SDPA-level operators take (batch, heads, sequence, dim); the lower _flash/_efficient ones another layout
        if str(op).startswith("aten._scaled_dot_product_") and "is_causal" in _argument_names(op):
            mapping[op] = _causal_aware(op, formula)
    return mapping


# Operators that run no arithmetic on their own (views, metadata, allocation): no vector work.
_NO_WORK = {"host_other"}


@dataclass
class WorkCount:
    """Work of the counted region.

    Attributes:
        matrix_flops: FLOPs of matrix operators (mm, bmm, convolutions...), forward + backward.
        attention_flops: FLOPs of fused attention operators (SDPA kernels), forward + backward.
        flops_by_module: ``FlopCounterMode``'s per-module totals (module path -> FLOPs).
        elements: elements written per category (``vector``, ``memory``).
        bytes: bytes read + written per category (matrix and fused attention too, for the roofline).
        op_calls: number of operator calls per category.
        host_fallback_ops: operators that ran on CPU tensors while the model is on an accelerator (name -> calls).
        dtypes: element types seen by matrix operators (name -> calls).
    """

    matrix_flops: int = 0
    attention_flops: int = 0
    flops_by_module: dict[str, int] = field(default_factory=dict)
    elements: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    op_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    host_fallback_ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dtypes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def total_flops(self) -> int:
        return self.matrix_flops + self.attention_flops

    def to_dict(self) -> dict[str, Any]:
        return {
            "matrix_flops": int(self.matrix_flops),
            "attention_flops": int(self.attention_flops),
            "elements": dict(self.elements),
            "bytes": dict(self.bytes),
            "op_calls": dict(self.op_calls),
            "host_fallback_ops": dict(self.host_fallback_ops),
            "matrix_dtypes": dict(self.dtypes),
            "flops_by_module": dict(self.flops_by_module),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkCount:
        """Rebuild a count from :meth:`to_dict` output (``matrix_dtypes`` is the JSON name of ``dtypes``)."""
        return cls(
            matrix_flops=int(data["matrix_flops"]),
            attention_flops=int(data["attention_flops"]),
            flops_by_module={k: int(v) for k, v in (data.get("flops_by_module") or {}).items()},
            elements=defaultdict(int, data.get("elements") or {}),
            bytes=defaultdict(int, data.get("bytes") or {}),
            op_calls=defaultdict(int, data.get("op_calls") or {}),
            host_fallback_ops=defaultdict(int, data.get("host_fallback_ops") or {}),
            dtypes=defaultdict(int, data.get("matrix_dtypes") or {}),
        )


def _tensors(obj: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(obj)
    return [t for t in flat if isinstance(t, torch.Tensor)]


class _VectorWorkMode(TorchDispatchMode):
    """Counts elements and bytes of non-matrix operators; notes host-fallback operators."""

    def __init__(self, count: WorkCount, accelerator: str | None) -> None:
        super().__init__()
        self.count = count
        self.accelerator = accelerator

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = f"aten::{func.__name__.split('.')[0]}"
        cat = classify_op(name) or "vector"
        inputs = _tensors((args, kwargs))
        outputs = _tensors(out)
        self.count.op_calls[cat] += 1
        if cat == "matrix" and inputs:
            self.count.dtypes[str(inputs[0].dtype).replace("torch.", "")] += 1
        if cat not in _NO_WORK:
            self.count.bytes[cat] += sum(t.numel() * t.element_size() for t in inputs + outputs)
            if cat not in ("matrix", "attention_fused"):
                self.count.elements[cat] += sum(t.numel() for t in outputs)
        if self.accelerator is not None and cat not in _NO_WORK:
            on_cpu = [t for t in inputs + outputs if t.device.type == "cpu" and t.numel() > 1]
            if on_cpu:
                self.count.host_fallback_ops[name] += 1
        return out


class WorkCounter:
    """Context manager counting matrix FLOPs and vector work of everything run inside it.

    Example::

        with WorkCounter() as wc:
            model(x).sum().backward()
        wc.count.matrix_flops

    Args:
        accelerator: device type of the model (``"cuda"``, ``"hpu"``...) to flag operators on CPU tensors as host
            fallback; ``None`` on the CPU.
    """

    def __init__(self, accelerator: str | None = None) -> None:
        self.count = WorkCount()
        self._flops = FlopCounterMode(display=False, custom_mapping=extra_flop_formulas())
        self._vector = _VectorWorkMode(self.count, accelerator)
        self._active = False

    def __enter__(self) -> WorkCounter:
        self._flops.__enter__()
        self._vector.__enter__()
        self._active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._active:
            return
        self._active = False
        try:
            self._vector.__exit__(*exc)
        finally:
            self._flops.__exit__(*exc)
        self._collect()

    def _collect(self) -> None:
        counts = self._flops.get_flop_counts()
        glob = counts.get("Global", {})
        matrix = 0
        attention = 0
        for op, n in glob.items():
            name = f"aten::{getattr(op, '__name__', str(op)).split('.')[0]}"
            if classify_op(name) == "attention_fused":
                attention += int(n)
            else:
                matrix += int(n)
        self.count.matrix_flops = matrix
        self.count.attention_flops = attention
        self.count.flops_by_module = {k: int(sum(v.values())) for k, v in counts.items() if k != "Global"}


def count_work(fn: Any, *args: Any, accelerator: str | None = None, **kwargs: Any) -> WorkCount:
    """Run ``fn(*args, **kwargs)`` under a :class:`WorkCounter` and return its :class:`WorkCount`."""
    with WorkCounter(accelerator=accelerator) as wc:
        fn(*args, **kwargs)
    return wc.count
