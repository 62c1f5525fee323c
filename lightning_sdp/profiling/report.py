"""The EngineProfiler report: numbers per step, findings with advice, summary table, metrics, merge and picture.

A report is a plain JSON-ready ``dict`` (see :func:`build_report`), so per-rank reports can be gathered with
``all_gather_object`` and written as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_sdp.profiling.categories import CATEGORIES, MODULE_GROUPS, CategoryBreakdown
from lightning_sdp.profiling.flops import WorkCount
from lightning_sdp.profiling.hpu_trace import EngineOverlap
from lightning_sdp.profiling.peaks import attention_model, crossover_seq_len

# Thresholds of the findings (shares of the step time unless noted).
HOST_BOUND_FRAC = 0.30
ATTENTION_DOMINANT_FRAC = 0.50
TENSOR_CORE_MIN_FRAC = 0.50
MATRIX_ON_TPC_FRAC = 0.05
HPU_OVERLAP_MIN_FRAC = 0.10
TOP_OPS = 15


def build_report(
    *,
    breakdown: CategoryBreakdown,
    steps: int,
    device: dict[str, Any],
    work: WorkCount | None,
    peaks: dict[str, float | None],
    batch_shapes: list[list[list[int]]],
    model_dims: dict[str, Any],
    softmax_k: float = 6.0,
    overlap: EngineOverlap | None = None,
    rank: int = 0,
    world_size: int = 1,
    cycle: int = 0,
    start_batch: int = 0,
) -> dict[str, Any]:
    """Assemble the report of one profiling window.

    Args:
        breakdown: category times over the window (host view on CPU/HPU, kernel view on CUDA).
        steps: number of profiled (active) steps.
        device: ``{"type", "name", "precision", "matrix_dtype"}``.
        work: FLOPs and vector work of one step (counted in the last warm-up step), or ``None``.
        peaks: resolved peaks ``{"matrix_tflops", "vector_tflops", "mem_gbps"}`` (values may be ``None``).
        batch_shapes: shapes of the batch tensors of each step seen in the window.
        model_dims: ``{"d_model", "n_heads", "attention", "seq_len"}`` where known.
        softmax_k: element operations per attention score in the analytic model.
        overlap: Gaudi engine overlap from the device trace, or ``None``.
        rank: global rank.
        world_size: number of ranks.
        cycle: index of the profiling window.
        start_batch: index of the first active batch.
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
        g: {
            "time_s": module_total[g] / steps / 1e6,
            "frac": module_total[g] / mt_sum,
            "by_category_s": {c: t / steps / 1e6 for c, t in breakdown.module_times_us[g].items()},
        }
        for g in sorted(module_total, key=lambda g: MODULE_GROUPS.index(g) if g in MODULE_GROUPS else 99)
    }
    top = sorted(breakdown.op_times_us.items(), key=lambda kv: -kv[1][1])[:TOP_OPS]
    top_ops = [
        {"name": n, "category": c, "time_ms": t / steps / 1e3, "frac": t / (breakdown.span_us or 1.0)}
        for n, (c, t) in top
    ]

    throughput: dict[str, float | None] = {
        "matrix_tflops": None,
        "attention_tflops": None,
        "total_tflops": None,
        "vector_gelem_per_s": None,
        "vector_gbps": None,
        "memory_gbps": None,
    }
    flops: dict[str, Any] | None = None
    if work is not None:
        flops = work.to_dict()
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

    utilisation = {
        "matrix": _ratio(throughput["matrix_tflops"], peaks.get("matrix_tflops")),
        "attention": _ratio(throughput["attention_tflops"], peaks.get("matrix_tflops")),
        "vector_bandwidth": _ratio(throughput["vector_gbps"], (peaks.get("mem_gbps") or 0) or None),
        "vector_compute": _ratio(
            None if throughput["vector_gelem_per_s"] is None else throughput["vector_gelem_per_s"] / 1e3,
            peaks.get("vector_tflops"),
        ),
    }

    seq_len = model_dims.get("seq_len")
    analytic = None
    d, h = model_dims.get("d_model"), model_dims.get("n_heads")
    if d and h and peaks.get("matrix_tflops") and peaks.get("vector_tflops"):
        p_mat, p_vec = float(peaks["matrix_tflops"]), float(peaks["vector_tflops"])  # type: ignore[arg-type]
        analytic = {
            "softmax_k": softmax_k,
            "crossover_seq_len": crossover_seq_len(d, h, p_mat, p_vec, softmax_k),
            "vector_to_matrix_attention_ratio": softmax_k / (4.0 * d / h) * p_mat / p_vec,
        }
        if seq_len and model_dims.get("attention") != "linear":  # the model is for softmax attention
            analytic["predicted_at_seq_len"] = attention_model(
                seq_len, d, h, p_mat, p_vec, softmax_k, fused=model_dims.get("attention") == "sdpa"
            )

    cuda = None
    if breakdown.tensor_core_us is not None:
        mk = breakdown.matrix_kernel_us or 0.0
        cuda = {
            "tensor_core_us": breakdown.tensor_core_us,
            "matrix_kernel_us": mk,
            "tensor_core_frac": (breakdown.tensor_core_us / mk) if mk > 0 else None,
            "host_busy_frac": breakdown.host_busy_us / (breakdown.span_us or 1.0),
        }

    report: dict[str, Any] = {
        "rank": rank,
        "world_size": world_size,
        "cycle": cycle,
        "start_batch": start_batch,
        "device": dict(device),
        "steps": steps,
        "step_time_s": step_time_s,
        "window_us": span,
        "batch_shapes": batch_shapes,
        "model": dict(model_dims),
        "categories_s": per_step_s,
        "fractions": fractions,
        "overlap_scale": breakdown.overlap_scale,
        "modules": modules,
        "top_ops": top_ops,
        "flops": flops,
        "throughput": throughput,
        "peaks": dict(peaks),
        "utilisation": utilisation,
        "analytic": analytic,
        "cuda": cuda,
        "hpu": overlap.to_dict() if overlap is not None else None,
    }
    report["findings"] = findings(report, work)
    return report


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or not b:
        return None
    return a / b


def findings(report: dict[str, Any], work: WorkCount | None = None) -> list[dict[str, str]]:
    """Automated checks on a report, each with one sentence of advice.

    Checks: ``matrix_off_engine``, ``host_fallback``, ``low_precision_off``, ``changing_shapes``,
    ``attention_dominating``, ``engine_imbalance``, ``host_bound``.
    """
    out: list[dict[str, str]] = []
    dev = report["device"]
    dtype = dev.get("matrix_dtype", "fp32")
    fr = report["fractions"]
    dtype_of_ops = (report.get("flops") or {}).get("matrix_dtypes") or {}

    cuda = report.get("cuda")
    if cuda and cuda.get("tensor_core_frac") is not None and cuda["matrix_kernel_us"] > 0:
        if cuda["tensor_core_frac"] < TENSOR_CORE_MIN_FRAC and fr["matrix"] > 0.05:
            out.append(
                _f(
                    "matrix_off_engine",
                    f"only {cuda['tensor_core_frac']:.0%} of matrix-kernel time ran on tensor cores",
                    "Use bf16/fp16 autocast (precision='bf16-mixed') or enable TF32 "
                    "(torch.set_float32_matmul_precision('high')) and keep matrix dimensions multiples of 8.",
                )
            )
    hpu = report.get("hpu")
    if hpu and hpu["window_us"] > 0 and hpu["matrix_on_tpc_us"] / hpu["window_us"] > MATRIX_ON_TPC_FRAC:
        out.append(
            _f(
                "matrix_off_engine",
                f"{hpu['matrix_on_tpc_us'] / hpu['window_us']:.0%} of the window is matrix work on the TPC",
                "Reshape the operation to a plain (batched) matmul the graph compiler can place on the MME, e.g. "
                "replace einsum patterns with bmm and keep dimensions multiples of the MME tile.",
            )
        )

    fallback = (report.get("flops") or {}).get("host_fallback_ops") or {}
    if fallback and dev.get("type") not in (None, "cpu"):
        names = ", ".join(sorted(fallback, key=lambda k: -fallback[k])[:5])
        out.append(
            _f(
                "host_fallback",
                f"{sum(fallback.values())} operator calls ran on CPU tensors while the model is on "
                f"{dev.get('type')} ({names})",
                "Move these tensors to the device (register buffers, create tensors with device=...), or replace "
                "the operators the device does not support.",
            )
        )

    if dev.get("type") in ("cuda", "hpu") and dtype == "fp32":
        out.append(
            _f(
                "low_precision_off",
                f"matrix work runs in {','.join(dtype_of_ops) or 'fp32'}; the matrix engine's peak is for bf16",
                "Train with precision='bf16-mixed' (Gaudi and Ampere+ GPUs run bf16 matmuls at full speed).",
            )
        )

    shapes = report.get("batch_shapes") or []
    distinct = {repr(s) for s in shapes}
    if len(distinct) > 1:
        out.append(
            _f(
                "changing_shapes",
                f"{len(distinct)} different batch shapes in {len(shapes)} steps of the window",
                "Pad or bucket batches to a few fixed shapes: each new shape recompiles the graph on HPU "
                "(and under torch.compile), and varying shapes make these shares unrepresentative.",
            )
        )

    att = (report.get("modules") or {}).get("attention", {}).get("frac", 0.0)
    if att >= ATTENTION_DOMINANT_FRAC:
        seq = report.get("model", {}).get("seq_len")
        analytic = report.get("analytic") or {}
        cross = analytic.get("crossover_seq_len")
        cross_txt = (
            f"; the analytic crossover for this device is n* ≈ {cross:,.0f} tokens (measured at n = {seq})"
            if cross
            else f" at sequence length {seq} (no device peaks known for the analytic crossover)"
        )
        out.append(
            _f(
                "attention_dominating",
                f"attention takes {att:.0%} of the step{cross_txt}",
                "Use fused attention (scaled_dot_product_attention / flash attention), shorter sequences, or a "
                "linear-attention variant for long contexts.",
            )
        )

    matrix_side = fr["matrix"] + fr["attention_fused"]
    vector_side = fr["vector"] + fr["memory"]
    if hpu:
        st = hpu["state_fractions"]
        busy = 1.0 - st["idle"]
        if busy > 0 and st["both"] / busy < HPU_OVERLAP_MIN_FRAC and (st["mme_only"] + st["tpc_only"]) > 0.5:
            out.append(
                _f(
                    "engine_imbalance",
                    f"MME and TPC overlap only {st['both']:.0%} of the window "
                    f"(MME-only {st['mme_only']:.0%}, TPC-only {st['tpc_only']:.0%})",
                    "Fuse elementwise work into fewer TPC kernels and use larger batches so the graph compiler can "
                    "pipeline TPC work under MME work.",
                )
            )
    elif vector_side > matrix_side and vector_side > 0.2:
        out.append(
            _f(
                "engine_imbalance",
                f"vector and memory work ({vector_side:.0%}) outweigh matrix work ({matrix_side:.0%})",
                "The step is vector-bound: fuse elementwise operators (torch.compile), use fused attention and "
                "fused optimizers (foreach/fused AdamW).",
            )
        )

    host = fr["host_other"]
    if host > HOST_BOUND_FRAC:
        where = "the device is idle" if dev.get("type") in ("cuda", "hpu") else "no operator is running"
        out.append(
            _f(
                "host_bound",
                f"{host:.0%} of the step {where} (framework, Python and data-loading time)",
                "Raise the batch size, use DataLoader workers, and cut Python overhead (torch.compile, CUDA/HPU "
                "graphs, fewer small operators).",
            )
        )
    return out


def _f(check: str, message: str, advice: str) -> dict[str, str]:
    return {"check": check, "message": message, "advice": advice}


def metrics(report: dict[str, Any]) -> dict[str, float]:
    """Scalar metrics for the Trainer's loggers (``engine/matrix_frac``, ``engine/matrix_tflops``, ...)."""
    m: dict[str, float] = {f"engine/{c}_frac": float(v) for c, v in report["fractions"].items()}
    m["engine/step_time_s"] = float(report["step_time_s"])
    for k, v in report["throughput"].items():
        if v is not None:
            m[f"engine/{k}"] = float(v)
    for k, v in report["utilisation"].items():
        if v is not None:
            m[f"engine/util_{k}"] = float(v)
    for g, v in report["modules"].items():
        m[f"engine/module_{g}_frac"] = float(v["frac"])
    if report.get("cuda") and report["cuda"].get("tensor_core_frac") is not None:
        m["engine/tensor_core_frac"] = float(report["cuda"]["tensor_core_frac"])
    if report.get("hpu"):
        for s, v in report["hpu"]["state_fractions"].items():
            m[f"engine/hpu_{s}_frac"] = float(v)
    return m


def summary_table(report: dict[str, Any]) -> str:
    """Human-readable summary of one report."""
    dev = report["device"]
    seq = report.get("model", {}).get("seq_len")
    lines = [
        f"EngineProfiler: rank {report['rank']}/{report['world_size']}, window {report['cycle']}, "
        f"{dev.get('type')} ({dev.get('name') or 'unknown'}, {dev.get('matrix_dtype')}), {report['steps']} steps, "
        f"{report['step_time_s'] * 1e3:.2f} ms/step" + (f", seq {seq}" if seq else ""),
        f"{'category':<16}{'ms/step':>10}{'share':>9}",
    ]
    for c in CATEGORIES:
        lines.append(f"{c:<16}{report['categories_s'][c] * 1e3:>10.3f}{report['fractions'][c]:>9.1%}")
    if report["modules"]:
        lines.append(f"{'module group':<16}{'ms/step':>10}{'share':>9}")
        for g, v in report["modules"].items():
            lines.append(f"{g:<16}{v['time_s'] * 1e3:>10.3f}{v['frac']:>9.1%}")
    tp = report["throughput"]
    ut = report["utilisation"]
    if report.get("flops"):
        fl = report["flops"]
        lines.append(
            f"matrix {fl['matrix_flops'] / 1e9:.3f} GFLOP/step at {_fmt(tp['matrix_tflops'], 'TFLOPS')}"
            f" (util {_pct(ut['matrix'])}); fused attention {fl['attention_flops'] / 1e9:.3f} GFLOP/step at "
            f"{_fmt(tp['attention_tflops'], 'TFLOPS')}; vector {_fmt(tp['vector_gbps'], 'GB/s')} "
            f"(util {_pct(ut['vector_bandwidth'])})"
        )
    else:
        lines.append("FLOPs not counted (needs warmup >= 1 and count_flops=True)")
    if report.get("cuda") and report["cuda"].get("tensor_core_frac") is not None:
        lines.append(f"tensor-core share of matrix-kernel time: {report['cuda']['tensor_core_frac']:.1%}")
    if report.get("hpu"):
        st = report["hpu"]["state_fractions"]
        lines.append("HPU engines: " + ", ".join(f"{k} {v:.1%}" for k, v in st.items()))
    an = report.get("analytic")
    if an:
        lines.append(f"analytic crossover n* ≈ {an['crossover_seq_len']:,.0f} tokens (k={an['softmax_k']:g})")
    for f in report["findings"]:
        lines.append(f"[{f['check']}] {f['message']}. {f['advice']}")
    return "\n".join(lines)


def _fmt(v: float | None, unit: str) -> str:
    return "n/a" if v is None else f"{v:.4g} {unit}"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the last report of every rank: mean shares, slowest rank, per-rank step time and findings."""
    if not reports:
        raise ValueError("merge_reports needs at least one report")
    n = len(reports)
    mean_fr = {c: sum(r["fractions"][c] for r in reports) / n for c in CATEGORIES}
    times = [r["step_time_s"] for r in reports]
    slowest = max(range(n), key=lambda i: times[i])
    return {
        "world_size": reports[0]["world_size"],
        "ranks": [r["rank"] for r in reports],
        "mean_fractions": mean_fr,
        "step_time_s": {str(r["rank"]): r["step_time_s"] for r in reports},
        "max_step_time_s": times[slowest],
        "slowest_rank": reports[slowest]["rank"],
        "matrix_tflops": {str(r["rank"]): r["throughput"]["matrix_tflops"] for r in reports},
        "findings": sorted({f["check"] for r in reports for f in r["findings"]}),
        "per_rank": reports,
    }


_COLORS = {
    "matrix": "#1f77b4",
    "attention_fused": "#9467bd",
    "vector": "#ff7f0e",
    "memory": "#2ca02c",
    "communication": "#d62728",
    "host_other": "#7f7f7f",
}


def plot_reports(reports: list[dict[str, Any]], path: str | Path, labels: list[str] | None = None) -> Path:
    """Save a PNG: stacked category shares per report (left) and a roofline per engine (right)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    labels = labels or [f"rank {r['rank']} w{r['cycle']}" for r in reports]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = [0.0] * len(reports)
    xs = list(range(len(reports)))
    for c in CATEGORIES:
        vals = [r["fractions"][c] for r in reports]
        ax1.bar(xs, vals, bottom=bottom, color=_COLORS[c], label=c)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax1.set_xticks(xs, labels, rotation=30, ha="right")
    ax1.set_ylabel("share of step time")
    ax1.set_ylim(0, 1)
    ax1.legend(fontsize=8, loc="upper right")
    ax1.set_title("where the step time goes")

    # Roofline: achieved throughput (GFLOP/s or Gelem/s) against arithmetic intensity (work per byte).
    r0 = reports[-1]
    fl = r0.get("flops") or {}
    tp = r0["throughput"]
    pts = []
    byts = fl.get("bytes") or {}
    if tp.get("matrix_tflops") and byts.get("matrix"):
        pts.append(("matrix", fl["matrix_flops"] / byts["matrix"], tp["matrix_tflops"] * 1e3))
    if tp.get("attention_tflops") and byts.get("attention_fused"):
        pts.append(
            ("attention_fused", fl["attention_flops"] / byts["attention_fused"], tp["attention_tflops"] * 1e3)
        )
    if tp.get("vector_gelem_per_s") and byts.get("vector"):
        pts.append(("vector", fl["elements"]["vector"] / byts["vector"], tp["vector_gelem_per_s"]))
    for name, x, y in pts:
        ax2.scatter([x], [y], color=_COLORS[name], label=name, s=60)
    peaks = r0.get("peaks") or {}
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
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
