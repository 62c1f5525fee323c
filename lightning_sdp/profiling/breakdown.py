"""Sum a profile's events into engine categories and module groups over a measured span.

On the CPU an event's cost is its *self* CPU time, so nothing is counted twice and the categories plus the
uncovered remainder sum to the measured wall time. On CUDA the cost is the device time of the kernels each operator
launched (``FunctionEvent.kernels``); a kernel whose name is decisive (GEMM, flash attention, NCCL, memcpy) keeps
its own category, otherwise it takes the launching operator's (:mod:`~lightning_sdp.profiling.categories`).

:func:`categorize_events` runs in named steps: keep the host (CPU) events; give each event its module group from
its enclosing scopes (:func:`_event_groups`); give each its category and cost (:func:`_event_costs`); sum the costs
(:class:`_Totals`); scale overlapping events down to the span and put the uncovered remainder into ``host_other``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_sdp.profiling.categories import (
    CATEGORIES,
    classify_kernel,
    classify_op,
    is_annotation,
    is_tensor_core_kernel,
    op_base_name,
)
from lightning_sdp.profiling.module_groups import MODULE_SCOPE_PREFIX, is_loss_op, module_group

_BACKWARD_NODE = "autograd::engine::evaluate_function"
_FROM_FORWARD = ""  # group placeholder of a backward event: resolved from its forward sequence number


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
            ``sequence_nr``, ``kernels``, ``device_type``, ``time_range``).
        span_us: the measured wall time the events cover, in microseconds.
        device: ``"cpu"`` (self CPU times) or ``"cuda"`` (kernel device times attributed to their operators).
        module_types: map ``module path -> class name`` (see
            :func:`~lightning_sdp.profiling.module_groups.module_group`).

    Returns:
        A :class:`CategoryBreakdown` whose ``times_us`` sum to ``span_us``.
    """
    if span_us < 0:
        raise ValueError(f"span_us must be >= 0, got {span_us}")
    cpu_events = [e for e in events if _is_cpu_event(e)]
    groups = _event_groups(cpu_events, module_types)
    totals = _Totals()
    category_cache: dict[int, str] = {}
    for e in cpu_events:
        category = _resolve_category(e, category_cache)
        self_cpu = float(e.self_cpu_time_total)
        if category != "host_other" and not is_annotation(e.name):
            totals.host_busy += self_cpu
        for cost_category, t in _event_costs(e, category, self_cpu, device, totals):
            totals.add(e.name, groups[id(e)], cost_category, t)
    return totals.breakdown(float(span_us), cuda=device == "cuda")


# ---------------------------------------------------------------------------------------------------- steps


def _is_cpu_event(e: Any) -> bool:
    dt = getattr(e, "device_type", None)
    if dt is None:
        return True
    return str(dt).endswith("CPU")


def _event_groups(events: list[Any], module_types: Mapping[str, str] | None) -> dict[int, str]:
    """Module group of every event (by ``id``): from its enclosing scopes, backward nodes from their forward.

    A backward node runs outside any module scope; it takes the group of the forward operator with the same
    autograd sequence number.
    """
    closure_end = _closure_ends(events)
    groups: dict[int, str] = {}
    seq_group: dict[int, str] = {}  # forward autograd sequence number -> module group
    for e in events:
        group = _scope_group(e, closure_end, module_types)
        groups[id(e)] = group
        seq = getattr(e, "sequence_nr", -1)
        if group != _FROM_FORWARD and seq is not None and seq >= 0 and seq not in seq_group:
            seq_group[seq] = group
    for e in events:
        if groups[id(e)] == _FROM_FORWARD:
            _, _, backward = _enclosing_scope(e)
            groups[id(e)] = seq_group.get(getattr(backward, "sequence_nr", -1), "other")
    return groups


def _scope_group(e: Any, closure_end: dict[int, float], module_types: Mapping[str, str] | None) -> str:
    """Group of one event from its scopes; :data:`_FROM_FORWARD` for an event inside a backward node."""
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
        return "optimizer"
    if backward is not None:
        return _FROM_FORWARD
    if module is not None:
        return module_group(module, module_types)
    if is_loss_op(op_base_name(e.name)):
        return "loss"
    return "other"


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
        if optimizer is None and (name.startswith("Optimizer.step") or name.startswith("Optimizer.zero_grad")):
            optimizer = node
        if backward is None and module is None and name.startswith(_BACKWARD_NODE):
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
        if not e.name.startswith(_BACKWARD_NODE):
            continue
        start, end = float(e.time_range.start), float(e.time_range.end)
        for opt in steps:
            if float(opt.time_range.start) <= start <= float(opt.time_range.end):
                ends[id(opt)] = max(ends.get(id(opt), float("-inf")), end)
    return ends


def _resolve_category(event: Any, cache: dict[int, str]) -> str:
    """Category of an event; a composite operator takes its most expensive child's (memoised by ``id``)."""
    key = id(event)
    if key in cache:
        return cache[key]
    cat = classify_op(event.name)
    if cat is None:
        children = [c for c in getattr(event, "cpu_children", []) or [] if not is_annotation(c.name)]
        if children:
            # Views (``aten::t`` under ``linear``) cost host time only; on a loaded host one can outlast the tiny
            # matmul beside it, so the composite takes the category of its most expensive *compute* child.
            resolved = [(c, _resolve_category(c, cache)) for c in children]
            compute = [rc for rc in resolved if rc[1] != "host_other"] or resolved
            cat = max(compute, key=lambda rc: rc[0].cpu_time_total)[1]
        else:
            base = op_base_name(event.name)
            cat = "attention_fused" if "attention" in base and "math" not in base else "vector"
    cache[key] = cat
    return cat


def _event_costs(e: Any, category: str, self_cpu_us: float, device: str, totals: _Totals) -> list[tuple[str, float]]:
    """``(category, microseconds)`` an event costs: its self CPU time, or on CUDA its kernels' device times.

    On CUDA the matrix-kernel and tensor-core times go to ``totals`` too.
    """
    if device != "cuda":
        return [(category, self_cpu_us)]
    costs = []
    for k in getattr(e, "kernels", []) or []:
        kcat = classify_kernel(k.name) or (category if category != "host_other" else "vector")
        duration = float(k.duration)
        costs.append((kcat, duration))
        if kcat == "matrix":
            totals.matrix_kernel += duration
            if is_tensor_core_kernel(k.name):
                totals.tensor_core += duration
    return costs


@dataclass
class _Totals:
    """Running sums of :func:`categorize_events` (microseconds)."""

    times: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    modules: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    op_times: dict[str, list[Any]] = field(default_factory=dict)  # name -> [category, time]
    host_busy: float = 0.0
    tensor_core: float = 0.0
    matrix_kernel: float = 0.0

    def add(self, op_name: str, group: str, category: str, t: float) -> None:
        if t <= 0:
            return
        self.times[category] += t
        self.modules[group][category] += t
        entry = self.op_times.setdefault(op_name, [category, 0.0])
        entry[1] += t

    def breakdown(self, span_us: float, cuda: bool) -> CategoryBreakdown:
        """The sums scaled to the span when events overlapped, the uncovered remainder added to ``host_other``."""
        covered = sum(self.times.values())
        scale = 1.0
        if covered > span_us > 0:
            # Events overlapped (several host threads, or kernels on several streams): scale to the span.
            scale = span_us / covered
            for c in list(self.times):
                self.times[c] *= scale
            for g in self.modules.values():
                for c in list(g):
                    g[c] *= scale
        self.times["host_other"] += max(0.0, span_us - covered * scale)
        return CategoryBreakdown(
            span_us=span_us,
            times_us={c: float(self.times.get(c, 0.0)) for c in CATEGORIES},
            op_times_us={k: (v[0], v[1] * scale) for k, v in self.op_times.items()},
            module_times_us={g: dict(v) for g, v in self.modules.items()},
            covered_us=covered,
            overlap_scale=scale,
            tensor_core_us=self.tensor_core if cuda else None,
            matrix_kernel_us=self.matrix_kernel if cuda else None,
            host_busy_us=self.host_busy,
        )
