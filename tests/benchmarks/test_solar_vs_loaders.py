"""``python -m benchmarks.solar_vs_loaders --quick``: PtychoNN trained through ``Trainer`` from the throttled loop
device with a DataLoader and with SOLAR (needs root and blkio cgroup v1).

Where the device cannot be built, the benchmark must refuse with exit code 2 and say why; that is asserted instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks._throttled_storage import check_root

REPO = Path(__file__).resolve().parents[2]


def _storage_unavailable() -> str | None:
    try:
        check_root()
    except PermissionError as err:
        return str(err)
    return None


def test_quick_run_trains_with_both_loaders_to_the_same_validation_loss():
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.solar_vs_loaders", "--quick"],
        cwd=REPO, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    reason = _storage_unavailable()
    if reason is not None:
        assert res.returncode == 2 and reason in res.stderr
        return
    assert res.returncode == 0, res.stderr[-3000:]
    payload = json.loads((REPO / "benchmarks" / "results" / "solar_vs_loaders_quick.json").read_text())
    rows = {r["loader"]: r for r in payload["summary"]}
    assert set(rows) == {"dl0", "solar_window"}
    for row in rows.values():
        assert row["samples/s"] != "failed" and row["samples/s"] > 0
        assert row["device MiB/epoch"] > 0
    # the same model, data and validation file: the two loaders train to nearly the same loss
    assert abs(rows["dl0"]["final val loss"] - rows["solar_window"]["final val loss"]) < 0.05
    assert rows["solar_window"]["device requests/epoch"] < rows["dl0"]["device requests/epoch"]


def test_without_root_it_exits_2_saying_why(monkeypatch, capsys):
    import os

    from benchmarks import solar_vs_loaders

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert solar_vs_loaders.main(["--quick"]) == 2
    assert "needs root" in capsys.readouterr().err
