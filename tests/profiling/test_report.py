"""Report assembly, findings, metrics, merge and picture from synthetic inputs."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_sdp.profiling.breakdown import CategoryBreakdown
from lightning_sdp.profiling.categories import CATEGORIES
from lightning_sdp.profiling.flops import WorkCount
from lightning_sdp.profiling.hpu_trace import EngineOverlap
from lightning_sdp.profiling.report import build_report, merge_reports, metrics, plot_reports, summary_table
from lightning_sdp.profiling.results import DeviceInfo, ModelDims


def _breakdown(att_share=0.8, **times):
    t = {c: float(times.get(c, 0.0)) for c in CATEGORIES}
    span = sum(t.values())
    return CategoryBreakdown(
        span_us=span,
        times_us=t,
        op_times_us={"aten::mm": ("matrix", t["matrix"])},
        module_times_us={
            "attention": {"matrix": t["matrix"] * att_share},
            "mlp": {"matrix": t["matrix"] * (1 - att_share)},
        },
        covered_us=span - t["host_other"],
    )


def _work():
    w = WorkCount(matrix_flops=2_000_000_000, attention_flops=0)
    w.elements["vector"] = 10_000_000
    w.bytes["vector"] = 80_000_000
    w.bytes["matrix"] = 40_000_000
    w.dtypes["float32"] = 10
    return w


def _report(device_type="cpu", dtype="fp32", shapes=None, overlap=None, peaks=None, att_share=0.8, **times):
    return build_report(
        breakdown=_breakdown(att_share, **times),
        steps=2,
        device=DeviceInfo(type=device_type, name=None, precision="32-true", matrix_dtype=dtype),
        work=_work(),
        peaks=peaks or {"matrix_tflops": None, "vector_tflops": None, "mem_gbps": None},
        batch_shapes=shapes or [[[4, 64], [4, 64]], [[4, 64], [4, 64]]],
        model_dims=ModelDims(d_model=768, n_heads=12, attention="explicit", seq_len=64),
        overlap=overlap,
    )


def test_shares_throughput_and_utilisation():
    r = _report(
        peaks={"matrix_tflops": 2.0, "vector_tflops": 0.1, "mem_gbps": 10.0},
        matrix=600_000,
        vector=300_000,
        host_other=100_000,
    )
    assert r.step_time_s == pytest.approx(0.5)
    assert r.fractions["matrix"] == pytest.approx(0.6)
    assert sum(r.fractions.values()) == pytest.approx(1.0)
    # 2 GFLOP per step in 0.3 s of matrix time per step.
    assert r.throughput["matrix_tflops"] == pytest.approx(2e9 / 0.3 / 1e12)
    assert r.utilisation["matrix"] == pytest.approx(2e9 / 0.3 / 1e12 / 2.0)
    assert r.throughput["vector_gbps"] == pytest.approx(80e6 / 0.15 / 1e9)
    assert r.analytic.crossover_seq_len == pytest.approx(24 * 768**2 * 0.1 / (6 * 12 * 2.0))
    assert r.modules["attention"].frac == pytest.approx(0.48)
    m = metrics(r)
    for key in ("engine/matrix_frac", "engine/vector_frac", "engine/matrix_tflops", "engine/step_time_s"):
        assert key in m
    assert "engine/util_matrix" in m


def test_unknown_device_has_shares_without_utilisation():
    r = _report(matrix=500, vector=500)
    assert all(v is None for v in r.utilisation.values())
    assert r.analytic is None
    assert "engine/util_matrix" not in metrics(r)
    assert "util n/a" in summary_table(r)


def _checks(r):
    return {f.check for f in r.findings}


def test_findings_trigger_and_stay_quiet():
    quiet = _report(matrix=800, vector=150, host_other=50, att_share=0.3)
    assert _checks(quiet) == set()
    assert "host_bound" in _checks(_report(matrix=300, vector=100, host_other=600))
    assert "engine_imbalance" in _checks(_report(matrix=200, vector=500, memory=200, host_other=100))
    assert "changing_shapes" in _checks(_report(shapes=[[[4, 64]], [[4, 80]]], matrix=900, vector=100))
    low = _report(device_type="cuda", dtype="fp32", matrix=900, vector=100)
    assert "low_precision_off" in _checks(low)
    assert "low_precision_off" not in _checks(_report(device_type="cuda", dtype="bf16", matrix=900, vector=100))
    # Attention module takes 80 % of the matrix time -> attention dominates at 72 % of the step.
    att = _report(matrix=900, vector=100)
    f = next(x for x in att.findings if x.check == "attention_dominating")
    assert "no matrix_tflops or vector_tflops peak known" in f.message and "d_model" not in f.message
    no_dims = build_report(
        breakdown=_breakdown(0.8, matrix=900, vector=100),
        steps=2,
        device=DeviceInfo(type="cpu", name=None, precision="32-true", matrix_dtype="fp32"),
        work=_work(),
        peaks={"matrix_tflops": 2.0, "vector_tflops": 0.1, "mem_gbps": None},
        batch_shapes=[[[4, 64]]],
        model_dims=ModelDims(seq_len=64),
    )
    f0 = next(x for x in no_dims.findings if x.check == "attention_dominating")
    assert "d_model and n_heads unknown" in f0.message and "EngineProfiler(d_model=..., n_heads=...)" in f0.message
    assert "analytic crossover: not computed (the model's d_model and n_heads unknown" in summary_table(no_dims)
    att2 = _report(matrix=900, vector=100, peaks={"matrix_tflops": 2.0, "vector_tflops": 0.1, "mem_gbps": None})
    f2 = next(x for x in att2.findings if x.check == "attention_dominating")
    assert "crossover" in f2.message
    for finding in att2.findings:
        assert finding.advice.endswith(".")


def test_cuda_tensor_core_and_host_fallback_findings():
    br = _breakdown(matrix=800, vector=200)
    br.tensor_core_us = 100.0
    br.matrix_kernel_us = 800.0
    work = _work()
    work.host_fallback_ops["aten::exp"] = 3
    r = build_report(
        breakdown=br,
        steps=1,
        device=DeviceInfo(type="cuda", name="NVIDIA A100", precision="bf16-mixed", matrix_dtype="bf16"),
        work=work,
        peaks={"matrix_tflops": 312.0, "vector_tflops": 19.5, "mem_gbps": 2039.0},
        batch_shapes=[],
        model_dims=ModelDims(),
    )
    assert {"matrix_off_engine", "host_fallback"} <= _checks(r)
    assert r.cuda.tensor_core_frac == pytest.approx(0.125)
    assert metrics(r)["engine/tensor_core_frac"] == pytest.approx(0.125)


def test_hpu_overlap_drives_categories_and_imbalance():
    ov = EngineOverlap(
        window_us=100.0,
        states_us={
            "both": 2.0,
            "mme_only": 40.0,
            "tpc_only": 40.0,
            "dma_only": 8.0,
            "other_only": 0.0,
            "idle": 10.0,
        },
        busy_us={"mme": 42.0, "tpc": 42.0, "dma": 8.0, "nic": 0.0, "other": 0.0},
        matrix_on_tpc_us=10.0,
    )
    r = _report(device_type="hpu", dtype="bf16", overlap=ov, matrix=10, vector=10)
    assert r.fractions["matrix"] == pytest.approx(0.42)
    assert r.fractions["vector"] == pytest.approx(0.40)
    assert {"engine_imbalance", "matrix_off_engine"} <= _checks(r)
    assert metrics(r)["engine/hpu_both_frac"] == pytest.approx(0.02)
    assert "HPU engines" in summary_table(r)


def test_merge_and_plot(tmp_path):
    r0 = _report(matrix=800, vector=200)
    r1 = dataclasses.replace(_report(matrix=600, vector=400), rank=1)
    r1.step_time_s = 1.0
    merged = merge_reports([r0, r1])
    assert merged.mean_fractions["matrix"] == pytest.approx(0.7)
    assert merged.slowest_rank == 1
    path = plot_reports([r0, r1], tmp_path / "x.png")
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError):
        merge_reports([])


def test_steps_must_be_positive():
    with pytest.raises(ValueError, match="steps"):
        build_report(
            breakdown=_breakdown(matrix=1),
            steps=0,
            device=DeviceInfo(type="cpu"),
            work=None,
            peaks={},
            batch_shapes=[],
            model_dims=ModelDims(),
        )


# The keys of the dict reports of earlier releases (and ``memory``, which they lack): result files written before the
# typed report stay readable.
_WINDOW_KEYS = [
    "rank", "world_size", "cycle", "start_batch", "device", "steps", "step_time_s", "window_us", "batch_shapes",
    "model", "categories_s", "fractions", "overlap_scale", "modules", "top_ops", "flops", "throughput", "peaks",
    "peak_sources", "peaks_measured", "utilisation", "utilisation_measured", "analytic", "cuda", "hpu", "findings",
    "trace_file", "analysis_s", "memory",
]  # fmt: skip


def test_json_keeps_the_keys_and_round_trips():
    import json

    from lightning_sdp.profiling.report import combine_windows
    from lightning_sdp.profiling.results import EngineReport, MergedReport

    r = _report(peaks={"matrix_tflops": 2.0, "vector_tflops": 0.1, "mem_gbps": 10.0}, matrix=900, vector=100)
    d = json.loads(json.dumps(r.to_dict()))
    assert list(d) == _WINDOW_KEYS
    assert set(d["modules"]["attention"]) == {"time_s", "frac", "by_category_s"}
    assert set(d["flops"]) >= {"matrix_flops", "attention_flops", "matrix_dtypes", "host_fallback_ops"}
    assert d["findings"][0] == {"check": "attention_dominating", "message": r.findings[0].message,
                                "advice": r.findings[0].advice}  # fmt: skip
    assert EngineReport.from_dict(d) == r
    c = combine_windows([r, _report(matrix=800, vector=200)])
    cd = c.to_dict()
    assert list(cd)[: len(_WINDOW_KEYS)] == _WINDOW_KEYS and cd["windows"] == 2
    assert cd["modules"]["attention"]["frac_range"] == c.modules["attention"].frac_range
    assert EngineReport.from_dict(json.loads(json.dumps(cd))) == c
    merged = merge_reports([c])
    assert MergedReport.from_dict(json.loads(json.dumps(merged.to_dict()))) == merged
    with pytest.raises(ValueError, match="not an EngineProfiler report: missing"):
        EngineReport.from_dict({"throughput": {}})


def test_dict_style_access_still_reads_the_json_view_with_a_deprecation_warning():
    r = _report(matrix=900, vector=100)
    with pytest.warns(DeprecationWarning, match="report.fractions"):
        assert r["fractions"] == r.fractions
    with pytest.warns(DeprecationWarning):
        assert r.get("modules")["attention"]["frac"] == r.modules["attention"].frac
    with pytest.warns(DeprecationWarning):
        assert r.get("windows", "absent") == "absent"  # a window report has no combined fields
