"""The EngineProfiler report: numbers per step, findings with advice, summary table, metrics, merge and picture.

A report is an :class:`~lightning_sdp.profiling.results.EngineReport` (see :func:`build_report`); it pickles for
``all_gather_object`` and ``to_dict()`` gives the JSON the callback writes.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_sdp.profiling.breakdown import CategoryBreakdown
from lightning_sdp.profiling.categories import CATEGORIES
from lightning_sdp.profiling.flops import WorkCount
from lightning_sdp.profiling.hpu_trace import EngineOverlap
from lightning_sdp.profiling.memory import SOURCES, StepMemory
from lightning_sdp.profiling.module_groups import MODULE_GROUPS
from lightning_sdp.profiling.peaks import attention_model, crossover_seq_len
from lightning_sdp.profiling.results import (
    AnalyticModel,
    CudaKernels,
    DeviceInfo,
    EngineReport,
    Finding,
    HpuEngines,
    MergedReport,
    ModelDims,
    ModuleShare,
    TopOp,
)

# Thresholds of the findings (shares of the step time unless noted).
HOST_BOUND_FRAC = 0.30
ATTENTION_DOMINANT_FRAC = 0.50
TENSOR_CORE_MIN_FRAC = 0.50
MATRIX_ON_TPC_FRAC = 0.05
HPU_OVERLAP_MIN_FRAC = 0.10
TOP_OPS = 15
CEILING_EXCEEDED = 1.05  # utilisation above the measured ceiling (plus timing noise)
_UTIL_PEAK = {
    "matrix": "matrix_tflops",
    "attention": "matrix_tflops",
    "vector_bandwidth": "mem_gbps",
    "vector_compute": "vector_tflops",
}


def build_report(
    *,
    breakdown: CategoryBreakdown,
    steps: int,
    device: DeviceInfo,
    work: WorkCount | None,
    peaks: dict[str, float | None],
    batch_shapes: list[list[list[int]]],
    model_dims: ModelDims,
    softmax_k: float = 6.0,
    overlap: EngineOverlap | None = None,
    rank: int = 0,
    world_size: int = 1,
    cycle: int = 0,
    start_batch: int = 0,
    measured_peaks: dict[str, float | None] | None = None,
    peak_sources: dict[str, str | None] | None = None,
    memory: StepMemory | None = None,
) -> EngineReport:
    """Assemble the report of one profiling window.

    Args:
        breakdown: category times over the window (host view on CPU/HPU, kernel view on CUDA).
        steps: number of profiled (active) steps.
        device: the profiled device.
        work: FLOPs and vector work of one step (counted in the last warm-up step), or ``None``.
        peaks: resolved peaks ``{"matrix_tflops", "vector_tflops", "mem_gbps"}`` (values may be ``None``).
        batch_shapes: shapes of the batch tensors of each step seen in the window.
        model_dims: model dimensions where known.
        softmax_k: element operations per attention score in the analytic model.
        overlap: Gaudi engine overlap from the device trace, or ``None``.
        rank: global rank.
        world_size: number of ranks.
        cycle: index of the profiling window.
        start_batch: index of the first active batch.
        measured_peaks: ceilings measured on this device (:mod:`~lightning_sdp.profiling.engine_bench`), reported
            next to ``peaks`` with their own utilisation (``utilisation_measured``), or ``None``.
        peak_sources: where each value of ``peaks`` comes from (``datasheet``, ``user``, ``measured``).
        memory: the peak memory of each active step, or ``None`` where unknown.
    """
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    times = dict(breakdown.times_us)
    span = breakdown.span_us
    if overlap is not None and overlap.window_us > 0:
        times = overlap.categories_us()
        span = overlap.window_us
    total = sum(times.values()) or 1.0
    per_step_s = {c: times.get(c, 0.0) / steps / 1e6 for c in CATEGORIES}
    fractions = {c: times.get(c, 0.0) / total for c in CATEGORIES}
    step_time_s = breakdown.span_us / steps / 1e6

    module_total = {g: sum(v.values()) for g, v in breakdown.module_times_us.items()}
    mt_sum = breakdown.span_us or 1.0
    modules = {
        g: ModuleShare(
            time_s=module_total[g] / steps / 1e6,
            frac=module_total[g] / mt_sum,
            by_category_s={c: t / steps / 1e6 for c, t in breakdown.module_times_us[g].items()},
        )
        for g in sorted(module_total, key=lambda g: MODULE_GROUPS.index(g) if g in MODULE_GROUPS else 99)
    }
    top = sorted(breakdown.op_times_us.items(), key=lambda kv: -kv[1][1])[:TOP_OPS]
    top_ops = [
        TopOp(name=n, category=c, time_ms=t / steps / 1e3, frac=t / (breakdown.span_us or 1.0)) for n, (c, t) in top
    ]

    throughput: dict[str, float | None] = {
        "matrix_tflops": None,
        "attention_tflops": None,
        "total_tflops": None,
        "vector_gelem_per_s": None,
        "vector_gbps": None,
        "memory_gbps": None,
    }
    flops: WorkCount | None = None
    if work is not None:
        flops = WorkCount.from_dict(work.to_dict())  # a snapshot: the counter's dicts are not shared
        mat_s = per_step_s["matrix"]
        att_s = per_step_s["attention_fused"]
        vec_s = per_step_s["vector"]
        mem_s = per_step_s["memory"]
        if mat_s > 0 and work.matrix_flops:
            throughput["matrix_tflops"] = work.matrix_flops / mat_s / 1e12
        if att_s > 0 and work.attention_flops:
            throughput["attention_tflops"] = work.attention_flops / att_s / 1e12
        if step_time_s > 0:
            throughput["total_tflops"] = work.total_flops / step_time_s / 1e12
        if vec_s > 0:
            throughput["vector_gelem_per_s"] = work.elements.get("vector", 0) / vec_s / 1e9
            throughput["vector_gbps"] = work.bytes.get("vector", 0) / vec_s / 1e9
        if mem_s > 0:
            throughput["memory_gbps"] = work.bytes.get("memory", 0) / mem_s / 1e9

    utilisation = _utilisation(throughput, peaks)
    utilisation_measured = _utilisation(throughput, measured_peaks) if measured_peaks else None

    seq_len = model_dims.seq_len
    analytic = None
    d, h = model_dims.d_model, model_dims.n_heads
    p_mat, p_vec = peaks.get("matrix_tflops"), peaks.get("vector_tflops")
    if d and h and p_mat and p_vec:
        analytic = AnalyticModel(
            softmax_k=softmax_k,
            crossover_seq_len=crossover_seq_len(d, h, p_mat, p_vec, softmax_k),
            vector_to_matrix_attention_ratio=softmax_k / (4.0 * d / h) * p_mat / p_vec,
        )
        if seq_len and model_dims.attention != "linear":  # the model is for softmax attention
            analytic.predicted_at_seq_len = attention_model(
                seq_len, d, h, p_mat, p_vec, softmax_k, fused=model_dims.attention == "sdpa"
            )

    cuda = None
    if breakdown.tensor_core_us is not None:
        mk = breakdown.matrix_kernel_us or 0.0
        cuda = CudaKernels(
            tensor_core_us=breakdown.tensor_core_us,
            matrix_kernel_us=mk,
            tensor_core_frac=(breakdown.tensor_core_us / mk) if mk > 0 else None,
            host_busy_frac=breakdown.host_busy_us / (breakdown.span_us or 1.0),
        )

    report = EngineReport(
        rank=rank,
        world_size=world_size,
        cycle=cycle,
        start_batch=start_batch,
        device=dataclasses.replace(device),
        steps=steps,
        step_time_s=step_time_s,
        window_us=span,
        batch_shapes=batch_shapes,
        model=dataclasses.replace(model_dims),
        categories_s=per_step_s,
        fractions=fractions,
        overlap_scale=breakdown.overlap_scale,
        modules=modules,
        top_ops=top_ops,
        flops=flops,
        throughput=throughput,
        peaks=dict(peaks),
        peak_sources=dict(peak_sources) if peak_sources else None,
        peaks_measured=dict(measured_peaks) if measured_peaks else None,
        utilisation=utilisation,
        utilisation_measured=utilisation_measured,
        analytic=analytic,
        cuda=cuda,
        hpu=HpuEngines.from_overlap(overlap) if overlap is not None else None,
        memory=memory,
    )
    report.findings = findings(report)
    return report


def _utilisation(throughput: dict[str, float | None], peaks: dict[str, float | None]) -> dict[str, float | None]:
    """Achieved throughput over the peaks (``None`` where either is unknown)."""
    return {
        "matrix": _ratio(throughput["matrix_tflops"], peaks.get("matrix_tflops")),
        "attention": _ratio(throughput["attention_tflops"], peaks.get("matrix_tflops")),
        "vector_bandwidth": _ratio(throughput["vector_gbps"], (peaks.get("mem_gbps") or 0) or None),
        "vector_compute": _ratio(
            None if throughput["vector_gelem_per_s"] is None else throughput["vector_gelem_per_s"] / 1e3,
            peaks.get("vector_tflops"),
        ),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or not b:
        return None
    return a / b


def findings(report: EngineReport, uncertain: list[Finding] | None = None) -> list[Finding]:
    """Automated checks on a report, each with one sentence of advice.

    Checks: ``matrix_off_engine``, ``host_fallback``, ``low_precision_off``, ``changing_shapes``,
    ``attention_dominating``, ``engine_imbalance``, ``ceiling_exceeded`` (utilisation above a measured ceiling:
    the device profile is stale or was measured on a busy machine), ``host_bound``.

    On a report combined over several windows (:func:`combine_windows`, which sets ``report.spread``), the
    timing checks (``attention_dominating``, ``engine_imbalance``, ``host_bound``) fire only when the median clears
    the threshold by more than the spread (max - min over the windows); those that clear it by less go to
    ``uncertain`` (when a list is given) instead of being dropped unseen.

    Args:
        report: a report of :func:`build_report` or :func:`combine_windows`.
        uncertain: list that receives the timing findings within the spread.
    """
    out = _placement_findings(report)
    timing = _timing_check(report, out, uncertain)
    _attention_finding(report, timing)
    _imbalance_finding(report, out, timing)
    ceiling = _ceiling_finding(report)
    if ceiling is not None:
        out.append(ceiling)
    _host_bound_finding(report, timing)
    return out


_TimingCheck = Callable[[str, float, str, str, str], None]


def _timing_check(report: EngineReport, out: list[Finding], uncertain: list[Finding] | None) -> _TimingCheck:
    """``timing(check, effect, spread_key, message, advice)``: record a timing finding whose threshold is met.

    It goes to ``out`` when its effect is larger than the spread over windows, else to ``uncertain`` (if given).
    """
    spread = report.spread or {}
    windows = report.windows or 1

    def timing(check: str, effect: float, spread_key: str, message: str, advice: str) -> None:
        s = float(spread.get(spread_key) or 0.0)
        if spread:
            message += f" (median of {windows} windows, spread {s:.1%})"
        if s > 0 and effect <= s:
            if uncertain is not None:
                uncertain.append(Finding(check, message + "; the effect is within the spread", advice))
            return
        out.append(Finding(check, message, advice))

    return timing


def _placement_findings(report: EngineReport) -> list[Finding]:
    """Where the work ran and in what form: ``matrix_off_engine``, ``host_fallback``, ``low_precision_off``,
    ``changing_shapes`` (no timing threshold, so no spread to clear)."""
    out: list[Finding] = []
    dev = report.device
    fr = report.fractions
    cuda = report.cuda
    if cuda and cuda.tensor_core_frac is not None and cuda.matrix_kernel_us > 0:
        if cuda.tensor_core_frac < TENSOR_CORE_MIN_FRAC and fr["matrix"] > 0.05:
            out.append(
                Finding(
                    "matrix_off_engine",
                    f"only {cuda.tensor_core_frac:.0%} of matrix-kernel time ran on tensor cores",
                    "Use bf16/fp16 autocast (precision='bf16-mixed') or enable TF32 "
                    "(torch.set_float32_matmul_precision('high')) and keep matrix dimensions multiples of 8.",
                )
            )
    hpu = report.hpu
    if hpu and hpu.window_us > 0 and hpu.matrix_on_tpc_us / hpu.window_us > MATRIX_ON_TPC_FRAC:
        out.append(
            Finding(
                "matrix_off_engine",
                f"{hpu.matrix_on_tpc_us / hpu.window_us:.0%} of the window is matrix work on the TPC",
                "Reshape the operation to a plain (batched) matmul the graph compiler can place on the MME, e.g. "
                "replace einsum patterns with bmm and keep dimensions multiples of the MME tile.",
            )
        )

    fallback = report.flops.host_fallback_ops if report.flops is not None else {}
    if fallback and dev.type not in (None, "cpu"):
        names = ", ".join(sorted(fallback, key=lambda k: -fallback[k])[:5])
        out.append(
            Finding(
                "host_fallback",
                f"{sum(fallback.values())} operator calls ran on CPU tensors while the model is on "
                f"{dev.type} ({names})",
                "Move these tensors to the device (register buffers, create tensors with device=...), or replace "
                "the operators the device does not support.",
            )
        )

    if dev.type in ("cuda", "hpu") and dev.matrix_dtype == "fp32":
        dtype_of_ops = report.flops.dtypes if report.flops is not None else {}
        out.append(
            Finding(
                "low_precision_off",
                f"matrix work runs in {','.join(dtype_of_ops) or 'fp32'}; the matrix engine's peak is for bf16",
                "Train with precision='bf16-mixed' (Gaudi and Ampere+ GPUs run bf16 matmuls at full speed).",
            )
        )

    shapes = report.batch_shapes or []
    distinct = {repr(s) for s in shapes}
    if len(distinct) > 1:
        out.append(
            Finding(
                "changing_shapes",
                f"{len(distinct)} different batch shapes in {len(shapes)} steps of the window",
                "Pad or bucket batches to a few fixed shapes: each new shape recompiles the graph on HPU "
                "(and under torch.compile), and varying shapes make these shares unrepresentative.",
            )
        )
    return out


def _attention_finding(report: EngineReport, timing: _TimingCheck) -> None:
    """``attention_dominating``, with the analytic crossover next to the measured sequence length."""
    att = _attention_frac(report)
    if att < ATTENTION_DOMINANT_FRAC:
        return
    seq = report.model.seq_len
    cross = report.analytic.crossover_seq_len if report.analytic is not None else None
    cross_txt = (
        f"; the analytic crossover for this device is n* ≈ {cross:,.0f} tokens (measured at n = {seq})"
        if cross
        else f" at sequence length {seq} (no analytic crossover: {crossover_missing(report)})"
    )
    timing(
        "attention_dominating",
        att - ATTENTION_DOMINANT_FRAC,
        "module_attention",
        f"attention takes {att:.0%} of the step{cross_txt}",
        "Use fused attention (scaled_dot_product_attention / flash attention), shorter sequences, or a "
        "linear-attention variant for long contexts.",
    )


def crossover_missing(report: EngineReport) -> str:
    """Why the analytic crossover was not computed: the model's width and heads, or the device's peaks, unknown."""
    missing_dims = [k for k in ("d_model", "n_heads") if not getattr(report.model, k)]
    if missing_dims:
        return (
            f"the model's {' and '.join(missing_dims)} unknown; pass EngineProfiler(d_model=..., n_heads=...) or "
            "keep them in the module's hparams (n_embd/d_model/hidden_size, n_head/n_heads/num_heads)"
        )
    missing_peaks = [k for k in ("matrix_tflops", "vector_tflops") if not report.peaks.get(k)]
    if missing_peaks:
        return (
            f"no {' or '.join(missing_peaks)} peak known for this device; pass EngineProfiler(peaks={{...}}) or "
            "keep measure_peaks=True"
        )
    return "not applicable"


def _imbalance_finding(report: EngineReport, out: list[Finding], timing: _TimingCheck) -> None:
    """``engine_imbalance``: MME/TPC overlap on Gaudi (from the trace), else vector-side over matrix-side time."""
    fr = report.fractions
    matrix_side = fr["matrix"] + fr["attention_fused"]
    vector_side = fr["vector"] + fr["memory"]
    hpu = report.hpu
    if hpu:
        st = hpu.state_fractions
        busy = 1.0 - st["idle"]
        if busy > 0 and st["both"] / busy < HPU_OVERLAP_MIN_FRAC and (st["mme_only"] + st["tpc_only"]) > 0.5:
            out.append(
                Finding(
                    "engine_imbalance",
                    f"MME and TPC overlap only {st['both']:.0%} of the window "
                    f"(MME-only {st['mme_only']:.0%}, TPC-only {st['tpc_only']:.0%})",
                    "Fuse elementwise work into fewer TPC kernels and use larger batches so the graph compiler can "
                    "pipeline TPC work under MME work.",
                )
            )
    elif vector_side > matrix_side and vector_side > 0.2:
        timing(
            "engine_imbalance",
            vector_side - matrix_side,
            "imbalance",
            f"vector and memory work ({vector_side:.0%}) outweigh matrix work ({matrix_side:.0%})",
            "The step is vector-bound: fuse elementwise operators (torch.compile), use fused attention and "
            "fused optimizers (foreach/fused AdamW).",
        )


def _ceiling_finding(report: EngineReport) -> Finding | None:
    """``ceiling_exceeded``: utilisation above a measured ceiling (a stale profile or one from a busy machine)."""
    over = {
        k: v
        for source in ("utilisation", "utilisation_measured")
        for k, v in (getattr(report, source) or {}).items()
        if v is not None and v > CEILING_EXCEEDED and (source == "utilisation_measured" or _measured(report, k))
    }
    if not over:
        return None
    return Finding(
        "ceiling_exceeded",
        "the step beat the measured ceiling ("
        + ", ".join(f"{k} {v:.0%}" for k, v in sorted(over.items()))
        + "): the device profile was probably measured while the machine was busy",
        "Measure again on a quiet machine with `lightning-sdp engine-bench` (it refreshes the cached "
        "profile), or pass `peaks=`.",
    )


def _host_bound_finding(report: EngineReport, timing: _TimingCheck) -> None:
    """``host_bound``: too much of the step with no operator running (CPU) or the device idle (CUDA/HPU)."""
    host = report.fractions["host_other"]
    if host <= HOST_BOUND_FRAC:
        return
    where = "the device is idle" if report.device.type in ("cuda", "hpu") else "no operator is running"
    timing(
        "host_bound",
        host - HOST_BOUND_FRAC,
        "host_other",
        f"{host:.0%} of the step {where} (framework, Python and data-loading time)",
        "Raise the batch size, use DataLoader workers, and cut Python overhead (torch.compile, CUDA/HPU "
        "graphs, fewer small operators).",
    )


def _measured(report: EngineReport, util_key: str) -> bool:
    return (report.peak_sources or {}).get(_UTIL_PEAK.get(util_key, "")) == "measured"


def _attention_frac(report: EngineReport) -> float:
    """Share of the step in the attention module group (0 without the per-module view)."""
    share = report.modules.get("attention")
    return share.frac if share is not None else 0.0


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return _median(known) if known else None


def combine_windows(reports: list[EngineReport]) -> EngineReport:
    """Combine the windows of one rank: median of every share and throughput, with the spread over windows.

    One window is a sample, not the answer: the same run profiled twice can differ by several points. The result
    is an :class:`EngineReport` (so :func:`summary_table`, :func:`metrics` and :func:`plot_reports` take it)
    with medians in ``fractions``, ``categories_s``, ``step_time_s``, ``modules``, ``throughput`` and
    ``utilisation``, plus ``windows`` (count), ``cycles``, ``fractions_range`` (``[min, max]`` per category) and
    ``spread`` (max - min per category and for ``module_attention`` and ``imbalance`` = vector + memory minus
    matrix + fused attention). Medians of the shares need not sum to exactly 1. Findings are recomputed on the
    medians and keep only the timing effects larger than the spread (the others are listed in
    ``findings_within_spread``). FLOP counts, peaks and the device come from the last window.

    Args:
        reports: window reports of one rank (:func:`build_report`), at least one.
    """
    if not reports:
        raise ValueError("combine_windows needs at least one window report")
    out = copy.deepcopy(reports[-1])
    out.windows = len(reports)
    out.cycles = [r.cycle for r in reports]
    out.start_batches = [r.start_batch for r in reports]
    out.steps_total = sum(r.steps for r in reports)
    if len(reports) == 1:
        out.spread = None
        out.fractions_range = None
        out.findings_within_spread = []
        return out
    fr = {c: [r.fractions[c] for r in reports] for c in CATEGORIES}
    out.fractions = {c: _median(v) for c, v in fr.items()}
    out.fractions_range = {c: [min(v), max(v)] for c, v in fr.items()}
    out.categories_s = {c: _median([r.categories_s[c] for r in reports]) for c in CATEGORIES}
    out.step_time_s = _median([r.step_time_s for r in reports])
    out.spread = _spread(reports, fr)
    out.modules = _median_modules(reports, last=out.modules)
    out.throughput = _median_map([r.throughput for r in reports], out.throughput)
    out.utilisation = _median_map([r.utilisation for r in reports], out.utilisation)
    if out.utilisation_measured is not None:
        out.utilisation_measured = _median_map([r.utilisation_measured for r in reports], out.utilisation_measured)
    if out.cuda is not None:
        out.cuda.tensor_core_frac = _median_or_none([r.cuda.tensor_core_frac if r.cuda else None for r in reports])
        out.cuda.host_busy_frac = _median_or_none([r.cuda.host_busy_frac if r.cuda else None for r in reports])
    if out.hpu is not None:
        out.hpu.state_fractions = {
            k: _median([r.hpu.state_fractions.get(k, 0.0) if r.hpu else 0.0 for r in reports])
            for k in out.hpu.state_fractions
        }
    out.batch_shapes = [s for r in reports for s in r.batch_shapes]
    steps_memory = [r.memory for r in reports if r.memory is not None]
    if steps_memory:
        out.memory = StepMemory(steps_memory[-1].source, [b for m in steps_memory for b in m.peak_bytes])
    uncertain: list[Finding] = []
    out.findings = findings(out, uncertain=uncertain)
    out.findings_within_spread = uncertain
    return out


def _spread(reports: list[EngineReport], fractions: dict[str, list[float]]) -> dict[str, float]:
    """max - min over the windows per category, of the attention module's share and of the imbalance."""
    imbalance = [
        r.fractions["vector"] + r.fractions["memory"] - r.fractions["matrix"] - r.fractions["attention_fused"]
        for r in reports
    ]
    att = [_attention_frac(r) for r in reports]
    spread = {c: max(v) - min(v) for c, v in fractions.items()}
    spread["module_attention"] = max(att) - min(att)
    spread["imbalance"] = max(imbalance) - min(imbalance)
    return spread


def _median_modules(reports: list[EngineReport], last: dict[str, ModuleShare]) -> dict[str, ModuleShare]:
    """Median time and share per module group over the windows (0 where a window lacks the group)."""
    groups = list(last)
    for r in reports:
        groups += [g for g in r.modules if g not in groups]
    empty = ModuleShare(time_s=0.0, frac=0.0)
    out = {}
    for g in groups:
        shares = [r.modules.get(g, empty) for r in reports]
        fracs = [m.frac for m in shares]
        out[g] = ModuleShare(
            time_s=_median([m.time_s for m in shares]),
            frac=_median(fracs),
            frac_range=[min(fracs), max(fracs)],
            by_category_s=last[g].by_category_s if g in last else {},
        )
    return out


def _median_map(maps: list[dict[str, float | None] | None], keys: dict[str, float | None]) -> dict[str, float | None]:
    """Median over the windows of each key of ``keys`` (``None`` where no window knows it)."""
    return {k: _median_or_none([(m or {}).get(k) for m in maps]) for k in keys}


def metrics(report: EngineReport) -> dict[str, float]:
    """Scalar metrics for the Trainer's loggers (``engine/matrix_frac``, ``engine/matrix_tflops``, ...)."""
    m: dict[str, float] = {f"engine/{c}_frac": float(v) for c, v in report.fractions.items()}
    m["engine/step_time_s"] = float(report.step_time_s)
    for k, v in report.throughput.items():
        if v is not None:
            m[f"engine/{k}"] = float(v)
    for k, v in report.utilisation.items():
        if v is not None:
            m[f"engine/util_{k}"] = float(v)
    for k, v in (report.utilisation_measured or {}).items():
        if v is not None:
            m[f"engine/util_{k}_measured"] = float(v)
    for g, share in report.modules.items():
        m[f"engine/module_{g}_frac"] = float(share.frac)
    if report.cuda is not None and report.cuda.tensor_core_frac is not None:
        m["engine/tensor_core_frac"] = float(report.cuda.tensor_core_frac)
    if report.hpu is not None:
        for s, v in report.hpu.state_fractions.items():
            m[f"engine/hpu_{s}_frac"] = float(v)
    if report.memory is not None:
        m["engine/peak_memory_mb"] = report.memory.max_bytes / 2**20
    return m


def summary_table(report: EngineReport) -> str:
    """Human-readable summary of one window's report or of a :func:`combine_windows` report (median, spread)."""
    dev = report.device
    seq = report.model.seq_len
    n = report.windows or 1
    ranges = report.fractions_range
    if n > 1:
        where = f"median of {n} windows (cycles {', '.join(str(c) for c in report.cycles or [])})"
    elif report.combined:
        where = f"window {report.cycle} (1 window: no spread; raise `repeat` or train longer for several)"
    else:
        where = f"window {report.cycle}"
    lines = [
        f"EngineProfiler: rank {report.rank}/{report.world_size}, {where}, "
        f"{dev.type} ({dev.name or 'unknown'}, {dev.matrix_dtype}), {report.steps} steps"
        f"{' per window' if n > 1 else ''}, {report.step_time_s * 1e3:.2f} ms/step" + (f", seq {seq}" if seq else ""),
        f"{'category':<16}{'ms/step':>10}{'share':>9}" + (f"{'min-max':>16}" if ranges else ""),
    ]
    for c in CATEGORIES:
        row = f"{c:<16}{report.categories_s[c] * 1e3:>10.3f}{report.fractions[c]:>9.1%}"
        if ranges:
            lo, hi = ranges[c]
            row += f"{f'{lo:.1%}-{hi:.1%}':>16}"
        lines.append(row)
    if report.modules:
        lines.append(f"{'module group':<16}{'ms/step':>10}{'share':>9}")
        for g, share in report.modules.items():
            lines.append(f"{g:<16}{share.time_s * 1e3:>10.3f}{share.frac:>9.1%}")
    tp = report.throughput
    ut = report.utilisation
    um = report.utilisation_measured
    src = report.peak_sources or {}

    def util(key: str, peak_key: str) -> str:
        main = _pct(ut[key])
        label = src.get(peak_key) or ("datasheet" if ut[key] is not None else None)
        txt = f"util {main}" + (f" of {label}" if label and ut[key] is not None else "")
        if um is not None and label != "measured" and um.get(key) is not None:
            txt += f", {_pct(um[key])} of measured"
        return txt

    if report.flops is not None:
        fl = report.flops
        lines.append(
            f"matrix {fl.matrix_flops / 1e9:.3f} GFLOP/step at {_fmt(tp['matrix_tflops'], 'TFLOPS')}"
            f" ({util('matrix', 'matrix_tflops')}); fused attention {fl.attention_flops / 1e9:.3f} GFLOP/step at "
            f"{_fmt(tp['attention_tflops'], 'TFLOPS')}; vector {_fmt(tp['vector_gbps'], 'GB/s')} "
            f"({util('vector_bandwidth', 'mem_gbps')}), {_fmt(tp['vector_gelem_per_s'], 'Gelem/s')} "
            f"({util('vector_compute', 'vector_tflops')})"
        )
    else:
        lines.append("FLOPs not counted (needs warmup >= 1 and count_flops=True)")
    pm = report.peaks_measured
    kinds = sorted({v for v in src.values() if v})
    lines.append(
        "peaks: "
        + _describe_peaks(report.peaks or {})
        + (f" ({', '.join(kinds)})" if kinds else "")
        + (f"; measured on this device: {_describe_peaks(pm)}" if pm and kinds != ["measured"] else "")
    )
    lines += _device_lines(report)
    for f in report.findings:
        lines.append(f"[{f.check}] {f.message}. {f.advice}")
    for f in report.findings_within_spread or []:
        lines.append(f"(not a finding: {f.check}: {f.message})")
    return "\n".join(lines)


def _device_lines(report: EngineReport) -> list[str]:
    """The summary's lines on tensor cores, Gaudi engines, peak memory and the analytic crossover."""
    lines: list[str] = []
    if report.cuda is not None and report.cuda.tensor_core_frac is not None:
        lines.append(f"tensor-core share of matrix-kernel time: {report.cuda.tensor_core_frac:.1%}")
    if report.hpu is not None:
        lines.append("HPU engines: " + ", ".join(f"{k} {v:.1%}" for k, v in report.hpu.state_fractions.items()))
    if report.memory is not None:
        mib = ", ".join(f"{b / 2**20:.1f}" for b in report.memory.peak_bytes)
        lines.append(f"peak memory per step: {mib} MiB ({SOURCES.get(report.memory.source, report.memory.source)})")
    an = report.analytic
    if an is not None:
        lines.append(f"analytic crossover n* ≈ {an.crossover_seq_len:,.0f} tokens (k={an.softmax_k:g})")
    else:
        lines.append(f"analytic crossover: not computed ({crossover_missing(report)})")
    return lines


def _describe_peaks(peaks: dict[str, float | None]) -> str:
    """One-line description of resolved peaks for the summary table."""
    parts = []
    for k, unit in (
        ("matrix_tflops", "TFLOPS matrix"),
        ("vector_tflops", "TFLOPS vector"),
        ("mem_gbps", "GB/s"),
    ):
        v = peaks.get(k)
        parts.append(f"{v:.4g} {unit}" if v else f"? {unit}")
    return ", ".join(parts)


def _fmt(v: float | None, unit: str) -> str:
    return "n/a" if v is None else f"{v:.4g} {unit}"


def _pct(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.1%}" if v == 0 or abs(v) >= 0.001 else f"{v * 100:.2g}%"


def merge_reports(reports: list[EngineReport]) -> MergedReport:
    """Merge one report per rank (each rank's :func:`combine_windows` report): mean shares, slowest rank, per-rank
    step time and findings."""
    if not reports:
        raise ValueError("merge_reports needs at least one report")
    n = len(reports)
    times = [r.step_time_s for r in reports]
    slowest = max(range(n), key=lambda i: times[i])
    return MergedReport(
        world_size=reports[0].world_size,
        ranks=[r.rank for r in reports],
        mean_fractions={c: sum(r.fractions[c] for r in reports) / n for c in CATEGORIES},
        step_time_s={str(r.rank): r.step_time_s for r in reports},
        max_step_time_s=times[slowest],
        slowest_rank=reports[slowest].rank,
        matrix_tflops={str(r.rank): r.throughput["matrix_tflops"] for r in reports},
        findings=sorted({f.check for r in reports for f in r.findings}),
        windows={str(r.rank): r.windows or 1 for r in reports},
        per_rank=list(reports),
    )


def roofline_points(report: EngineReport) -> list[tuple[str, float, float]]:
    """``(category, work per byte, achieved rate)`` of the report's engines for a roofline.

    Matrix and fused attention: FLOP per byte and GFLOP/s; vector: elements per byte and Gelem/s. An engine whose
    throughput or bytes are unknown is left out.
    """
    fl, tp = report.flops, report.throughput
    if fl is None:
        return []
    pts = []
    matrix, attention, vector = tp.get("matrix_tflops"), tp.get("attention_tflops"), tp.get("vector_gelem_per_s")
    if matrix and fl.bytes.get("matrix"):
        pts.append(("matrix", fl.matrix_flops / fl.bytes["matrix"], matrix * 1e3))
    if attention and fl.bytes.get("attention_fused"):
        pts.append(("attention_fused", fl.attention_flops / fl.bytes["attention_fused"], attention * 1e3))
    if vector and fl.bytes.get("vector"):
        pts.append(("vector", fl.elements.get("vector", 0) / fl.bytes["vector"], vector))
    return pts


_COLORS = {
    "matrix": "#1f77b4",
    "attention_fused": "#9467bd",
    "vector": "#ff7f0e",
    "memory": "#2ca02c",
    "communication": "#d62728",
    "host_other": "#7f7f7f",
}


def plot_reports(
    reports: list[EngineReport],
    path: str | Path,
    labels: list[str] | None = None,
    roofline: EngineReport | None = None,
) -> Path:
    """Save a PNG: stacked category shares per report (left) and a roofline per engine (right).

    Args:
        reports: one bar each (windows of a rank, or one combined report per rank).
        path: PNG file.
        labels: bar labels; default ``rank R wC`` (``median`` for combined reports).
        roofline: the report whose throughput the roofline shows; default the last of ``reports``.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    labels = labels or [
        f"rank {r.rank} " + (f"median of {r.windows}" if (r.windows or 1) > 1 else f"w{r.cycle}") for r in reports
    ]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = [0.0] * len(reports)
    xs = list(range(len(reports)))
    for c in CATEGORIES:
        vals = [r.fractions[c] for r in reports]
        ax1.bar(xs, vals, bottom=bottom, color=_COLORS[c], label=c)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax1.set_xticks(xs, labels, rotation=30, ha="right")
    ax1.set_ylabel("share of step time")
    ax1.set_ylim(0, 1)
    ax1.legend(fontsize=8, loc="upper right")
    ax1.set_title("where the step time goes")

    # Roofline: achieved throughput (GFLOP/s or Gelem/s) against arithmetic intensity (work per byte).
    r0 = roofline if roofline is not None else reports[-1]
    pts = roofline_points(r0)
    for name, x, y in pts:
        ax2.scatter([x], [y], color=_COLORS[name], label=name, s=60)
    peaks = r0.peaks or {}
    if pts:
        xmin = min(p[1] for p in pts) / 4
        xmax = max(p[1] for p in pts) * 4
        grid = [xmin * (xmax / xmin) ** (i / 50) for i in range(51)]
        bw = peaks.get("mem_gbps")
        for key, style in (("matrix_tflops", "-"), ("vector_tflops", "--")):
            p = peaks.get(key)
            if p:
                roof = [min(p * 1e3, x * bw) if bw else p * 1e3 for x in grid]
                ax2.plot(grid, roof, style, color="k", lw=1, label=f"roof ({key.split('_')[0]})")
        ax2.set_xscale("log")
        ax2.set_yscale("log")
        ax2.legend(fontsize=8)
    else:
        ax2.text(0.5, 0.5, "no FLOP counts", ha="center", va="center", transform=ax2.transAxes)
    ax2.set_xlabel("work per byte moved (FLOP/B or elem/B)")
    ax2.set_ylabel("achieved GFLOP/s (vector: Gelem/s)")
    ax2.set_title("roofline per engine" + (" (peaks unknown)" if not peaks.get("matrix_tflops") else ""))
    return save_figure(fig, path)


def save_figure(fig: Any, path: str | Path) -> Path:
    """Lay out ``fig``, write it to ``path`` (creating the folder) and close it; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
