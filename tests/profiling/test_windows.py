"""Several windows: medians, spread, findings beyond the spread; peaks side by side."""

from __future__ import annotations

import statistics

import pytest

from lightning_sdp.profiling.breakdown import CategoryBreakdown
from lightning_sdp.profiling.categories import CATEGORIES
from lightning_sdp.profiling.flops import WorkCount
from lightning_sdp.profiling.peaks import effective_peaks
from lightning_sdp.profiling.report import (
    build_report,
    combine_windows,
    merge_reports,
    metrics,
    summary_table,
)
from lightning_sdp.profiling.results import DeviceInfo, EngineReport, ModelDims

NO_PEAKS = {"matrix_tflops": None, "vector_tflops": None, "mem_gbps": None}


def _window(cycle: int, peaks=None, measured=None, sources=None, **times) -> EngineReport:
    t = {c: float(times.get(c, 0.0)) for c in CATEGORIES}
    span = sum(t.values())
    work = WorkCount(matrix_flops=1_000_000_000)
    work.elements["vector"] = 1_000_000
    work.bytes["vector"] = 8_000_000
    return build_report(
        breakdown=CategoryBreakdown(
            span_us=span,
            times_us=t,
            op_times_us={"aten::mm": ("matrix", t["matrix"])},
            module_times_us={"mlp": {"matrix": t["matrix"]}},
            covered_us=span - t["host_other"],
        ),
        steps=2,
        device=DeviceInfo(type="cpu", name=None, precision="32-true", matrix_dtype="fp32"),
        work=work,
        peaks=peaks or NO_PEAKS,
        batch_shapes=[[[4, 8]]],
        model_dims=ModelDims(),
        cycle=cycle,
        start_batch=3 + 6 * cycle,
        measured_peaks=measured,
        peak_sources=sources,
    )


def test_median_and_spread_over_windows():
    matrix = [500, 300, 700, 450, 550]
    windows = [_window(i, matrix=m, vector=200, host_other=1000 - m - 200) for i, m in enumerate(matrix)]
    c = combine_windows(windows)
    shares = sorted(w.fractions["matrix"] for w in windows)
    assert c.windows == 5 and c.cycles == [0, 1, 2, 3, 4]
    assert c.fractions["matrix"] == pytest.approx(statistics.median(shares)) == pytest.approx(0.5)
    assert c.fractions_range["matrix"] == pytest.approx([0.3, 0.7])
    assert c.spread["matrix"] == pytest.approx(0.4)
    assert c.step_time_s == pytest.approx(statistics.median(w.step_time_s for w in windows))
    out = summary_table(c)
    assert "median of 5 windows" in out and "30.0%-70.0%" in out
    m = merge_reports([c])
    assert m.windows == {"0": 5} and m.mean_fractions["matrix"] == pytest.approx(0.5)
    assert metrics(c)["engine/matrix_frac"] == pytest.approx(0.5)


def test_findings_only_beyond_the_spread():
    # host_other 35 %, 55 %, 20 %: median 35 % clears the 30 % threshold by 5 points, spread 35 points.
    noisy = [_window(i, matrix=1000 - h - 100, vector=100, host_other=h) for i, h in enumerate((350, 550, 200))]
    c = combine_windows(noisy)
    assert "host_bound" not in {f.check for f in c.findings}
    assert [f.check for f in c.findings_within_spread] == ["host_bound"]
    assert "not a finding: host_bound" in summary_table(c)
    # host_other 60-62 %: the effect (30 points) is far beyond the spread (2 points).
    stable = [_window(i, matrix=1000 - h - 100, vector=100, host_other=h) for i, h in enumerate((600, 620, 610))]
    s = combine_windows(stable)
    host = [f for f in s.findings if f.check == "host_bound"]
    assert host and "median of 3 windows" in host[0].message
    # A single window keeps the single-window behaviour: no spread, the finding fires.
    one = combine_windows(noisy[:1])
    assert one.windows == 1 and one.spread is None
    assert "host_bound" in {f.check for f in one.findings}
    assert "1 window: no spread" in summary_table(one)


def test_measured_ceilings_fill_the_cpu_and_sit_next_to_the_datasheet():
    measured = {"matrix_tflops": 0.1, "vector_tflops": 0.002, "mem_gbps": 20.0}
    cpu_peaks, cpu_src = effective_peaks(None, "fp32", None, measured)
    assert cpu_peaks == measured and set(cpu_src.values()) == {"measured"}
    r = _window(0, peaks=cpu_peaks, measured=measured, sources=cpu_src, matrix=600, vector=300, host_other=100)
    # 1 GFLOP per step in 0.3 ms of matrix time: 3.33 TFLOPS -> against 0.1 measured.
    assert r.utilisation["matrix"] == pytest.approx(1e9 / 300e-6 / 1e12 / 0.1)
    assert "util n/a" not in summary_table(r)
    # A GPU with a datasheet entry: the datasheet wins, measured is shown beside it.
    gpu_peaks, gpu_src = effective_peaks("NVIDIA H100 80GB HBM3", "bf16", None, {**measured, "matrix_tflops": 700.0})
    assert gpu_peaks["matrix_tflops"] == 989.0 and gpu_src["matrix_tflops"] == "datasheet"
    g = _window(
        0,
        peaks=gpu_peaks,
        measured={**measured, "matrix_tflops": 700.0},
        sources=gpu_src,
        matrix=600,
        vector=400,
    )
    assert g.utilisation_measured["matrix"] == pytest.approx(g.utilisation["matrix"] * 989.0 / 700.0)
    text = summary_table(g)
    assert "of datasheet" in text and "of measured" in text
    assert "engine/util_matrix_measured" in metrics(g)
    # User overrides still win over both.
    user, src = effective_peaks(None, "fp32", {"matrix_tflops": 5.0}, measured)
    assert user["matrix_tflops"] == 5.0 and src["matrix_tflops"] == "user" and src["mem_gbps"] == "measured"


def test_beating_a_measured_ceiling_is_a_finding():
    # 1 GFLOP in 0.3 ms = 3.3 TFLOPS against a measured 0.1: the profile was measured on a busy machine.
    low = {"matrix_tflops": 0.1, "vector_tflops": 1.0, "mem_gbps": 1e4}
    peaks, src = effective_peaks(None, "fp32", None, low)
    r = _window(0, peaks=peaks, measured=low, sources=src, matrix=600, vector=300, host_other=100)
    f = [f for f in r.findings if f.check == "ceiling_exceeded"]
    assert f and "matrix" in f[0].message and "engine-bench" in f[0].advice
    # Against a datasheet peak the same numbers are no finding of this kind (only measured ceilings can be stale).
    ds = _window(0, peaks={**low, "matrix_tflops": 0.1}, sources={k: "datasheet" for k in low}, matrix=600, vector=300)
    assert "ceiling_exceeded" not in {f.check for f in ds.findings}
