"""``python -m benchmarks.solar_slow_storage --quick`` on the throttled loop device (needs root and blkio cgroup v1).

Where the device cannot be built, the benchmark must refuse with exit code 2 and say why; that is asserted instead.
"""

from __future__ import annotations

from tests.benchmarks._throttled import run_quick


def test_quick_run_reads_fewer_device_requests_with_a_read_window():
    payload = run_quick("solar_slow_storage", timeout=300)
    if payload is None:  # refused clearly: no root or no blkio cgroup
        return
    rows = {r["mode"]: r for r in payload["summary"]}
    assert set(rows) == {"dl0", "solar:1:0", "solar:16:8"}, "every mode ran in its child process"
    assert all(r["device MiB/epoch"] > 0 for r in rows.values()), "the device served the reads (cache dropped)"
    # 16 steps' reads merged into a few long requests instead of one request per run of rows
    assert rows["solar:16:8"]["device requests/epoch"] < rows["solar:1:0"]["device requests/epoch"]


def test_without_root_it_exits_2_saying_why(monkeypatch, capsys):
    import os

    from benchmarks import solar_slow_storage

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert solar_slow_storage.main(["--quick"]) == 2
    assert "needs root" in capsys.readouterr().err
