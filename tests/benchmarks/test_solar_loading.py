"""``python -m benchmarks.solar_loading --quick``: SOLAR against the per-sample h5py DataLoader, loading only, with
the in-process throttle and on the throttled loop device (needs root; without it the refusal is checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks._common import RESULTS_DIR
from tests._warm_python import run_python
from tests.benchmarks._throttled import run_quick

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.bench
def test_quick_run_writes_results_with_solar_at_its_hit_rate_bound():
    res = run_python(["-m", "benchmarks.solar_loading", "--quick", "--storage", "throttled"], cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    payload = json.loads((RESULTS_DIR / "solar_loading_quick.json").read_text())
    rows = {(r["P"], r["mode"]): r for r in payload["summary"]}
    assert {mode for _, mode in rows} == {"baseline", "lru", "consumed_first", "solar_serial", "solar"}
    for ranks in (1, 2):
        assert rows[ranks, "baseline"]["hit rate (later)"] == 0.0
        # Belady + re-routing reaches C/N after the first epoch, and reads only the rest of the file
        assert rows[ranks, "solar"]["hit rate (later)"] == rows[ranks, "solar"]["bound C/N"] == 0.25
        base_mib = rows[ranks, "baseline"]["storage MiB/epoch (later)"]
        assert rows[ranks, "solar"]["storage MiB/epoch (later)"] == base_mib * 0.75


@pytest.mark.slow
@pytest.mark.bench
def test_quick_device_run_counts_what_the_device_served():
    extra = ("--storage", "device", "--modes", "baseline", "solar_auto", "--name", "solar_loading_device")
    payload = run_quick("solar_loading", timeout=300, extra=extra, results="solar_loading_device")
    if payload is None:  # refused clearly: no root or no cgroup
        return
    rows = {(r["P"], r["mode"]): r for r in payload["summary"]}
    assert set(rows) == {(p, m) for p in (1, 2) for m in ("baseline", "solar_auto")}
    for row in rows.values():
        # the cache is dropped before every rank's epoch: the device served the reads, and was busy part of the time
        assert row["device MiB/epoch (later)"] > 0 and row["device requests/epoch (later)"] > 0
        assert 0 < row["device busy (probed)"] < 2
        assert row["bound samples/s (probed)"] > 0
    # the plan's read windows merge rows into long requests: fewer than the DataLoader's one per sample and dataset
    for ranks in (1, 2):
        assert (
            rows[ranks, "solar_auto"]["device requests/epoch (later)"]
            < rows[ranks, "baseline"]["device requests/epoch (later)"]
        )
