"""``python -m benchmarks.solar_vs_loaders --quick``: PtychoNN trained through ``Trainer`` from the throttled loop
device with a DataLoader and with SOLAR (needs root and blkio cgroup v1).

Where the device cannot be built, the benchmark must refuse with exit code 2 and say why; that is asserted instead.
"""

from __future__ import annotations

import pytest

from tests.benchmarks._throttled import run_quick


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(900)
def test_quick_run_trains_with_both_loaders_to_the_same_validation_loss():
    payload = run_quick("solar_vs_loaders", timeout=800)
    if payload is None:  # refused clearly: no root or no blkio cgroup
        return
    rows = {r["loader"]: r for r in payload["summary"]}
    assert set(rows) == {"dl0", "solar"}
    for row in rows.values():
        assert row["samples/s"] != "failed" and row["samples/s"] > 0
        assert row["device MiB/epoch"] > 0
    # the same model, data and validation file: the two loaders train to nearly the same loss
    assert abs(rows["dl0"]["final val loss"] - rows["solar"]["final val loss"]) < 0.05
    assert rows["solar"]["device requests/epoch"] < rows["dl0"]["device requests/epoch"]


def test_without_root_it_exits_2_saying_why(monkeypatch, capsys):
    import os

    from benchmarks import solar_vs_loaders

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert solar_vs_loaders.main(["--quick"]) == 2
    assert "needs root" in capsys.readouterr().err
