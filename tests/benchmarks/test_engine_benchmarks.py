"""The EngineProfiler benchmarks' ``--quick`` modes run and write their results (``<results dir>/*_quick.*``, a temporary
folder under the test suite)."""

from __future__ import annotations

import json

import pytest

from benchmarks import engine_overhead, engine_sequence_sweep, engine_stability
from benchmarks._common import RESULTS_DIR

pytestmark = [pytest.mark.bench, pytest.mark.slow]


def _result(name: str) -> dict:
    assert (RESULTS_DIR / f"{name}.md").stat().st_size > 0
    assert (RESULTS_DIR / f"{name}.png").stat().st_size > 0
    return json.loads((RESULTS_DIR / f"{name}.json").read_text())


def test_sequence_sweep_quick(monkeypatch, tmp_path):
    monkeypatch.setenv("LIGHTNING_SDP_CACHE_DIR", str(tmp_path))  # a private device-profile cache
    engine_sequence_sweep.main(["--quick"])
    result = _result("engine_sequence_sweep_quick")
    assert [(r["attention"], r["seq_len"]) for r in result["rows"]] == [
        ("explicit", 16), ("explicit", 32), ("sdpa", 16), ("sdpa", 32),
    ]  # fmt: skip
    assert all(r["step_ms"] > 0 for r in result["rows"])
    overhead = result["overhead"]
    assert overhead["median_baseline_ms"] > 0 and overhead["median_inside_ms"] > 0
    assert overhead["hook_pair_us_outside_window"] > 0


def test_overhead_quick(monkeypatch, tmp_path):
    monkeypatch.setenv("LIGHTNING_SDP_CACHE_DIR", str(tmp_path))  # a private device-profile cache
    engine_overhead.main(["--quick", "--only", "ep_inside", "ep_before"])
    result = _result("engine_overhead_quick")
    rows = {r["key"]: r for r in result["rows"]}
    assert set(rows) == {"none", "ep_before", "ep_inside"}
    # Steps inside the window are those with autograd profiling on at both ends (the typed StepTimer's flag).
    assert result["runs"]["ep_inside"][0]["measured_steps"] > 0
    assert rows["ep_inside"]["analysis_s"] > 0 and rows["ep_before"]["ep_hook_us"] > 0


def test_stability_quick():
    pytest.importorskip("torchvision", reason="the clip extra (torchvision, for resnet18) is not installed")
    assert engine_stability.main(["--quick", "--threads", "1"]) == 0
    result = _result("engine_stability_quick")
    assert [w["workload"] for w in result["workloads"]] == ["gemm_only", "gpt", "resnet18"]
    assert all(w["windows"] == 2 for w in result["workloads"])
