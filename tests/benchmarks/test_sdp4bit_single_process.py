"""``python -m benchmarks.sdp4bit_single_process --quick``: one process, strategy="sdp4bit" beside "auto"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks._common import RESULTS_DIR
from tests._warm_python import run_python

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.bench
def test_quick_run_times_both_strategies_and_writes_the_ratio():
    res = run_python(
        ["-m", "benchmarks.sdp4bit_single_process", "--quick", "--data", "/nonexistent/input.txt", "--threads", "1"],
        cwd=REPO,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "using the built-in corpus" in res.stdout
    payload = json.loads((RESULTS_DIR / "sdp4bit_single_process_quick.json").read_text())
    runs = payload["runs"]
    assert [r["strategy"] for r in runs] == ["auto", "sdp4bit"]
    assert not any(r["sharded"] for r in runs)  # one process: nothing sharded
    assert all(len(r["step_ms"]) == 5 and r["cpu_ms_per_step"] > 0 for r in runs)  # 8 steps, 2 warm-up, 7 gaps
    summary = payload["summary"]
    assert summary["step_ratio"] == pytest.approx(
        summary["sdp4bit"]["median_step_ms"] / summary["auto"]["median_step_ms"]
    )
    assert summary["target_ratio"] == 1.05
    for suffix in ("md", "png"):
        assert (RESULTS_DIR / f"sdp4bit_single_process_quick.{suffix}").is_file()
