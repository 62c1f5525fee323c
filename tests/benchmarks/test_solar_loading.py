"""``python -m benchmarks.solar_loading --quick``: SOLAR against the per-sample h5py DataLoader, loading only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks._common import RESULTS_DIR
from tests._warm_python import run_python

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
