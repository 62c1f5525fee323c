"""``benchmarks.solar_time_to_loss``: time to a target loss in the fair arena (needs root for its runs)."""

from __future__ import annotations

import pytest

from benchmarks.solar_time_to_loss import summarise, time_to_target
from tests.benchmarks._throttled import run_quick


def _run(loader, losses, conversion=0.0, ranks=1):
    points = [{"epoch": i // 2, "train_s": 10.0 * (i + 1), "val_loss": v} for i, v in enumerate(losses)]
    costs = dict(device_mib=1.0, device_requests=1, memory_cap_mib=None, memory_peak_mib=1.0, pinned_peak_mib=1.0)
    return {"ranks": ranks, "loader": loader, "status": "ok", "points": points, "conversion_s": conversion, **costs}


def test_time_to_target_is_the_first_validation_at_or_below_it_plus_the_conversion():
    runs = [
        _run("memory", [0.5, 0.3, 0.2, 0.1]),  # 2 epochs; its loss after epoch 2 (0.1) sets the target
        _run("solar", [0.4, 0.2, 0.1005, 0.09]),
        _run("litdata", [0.5, 0.2, 0.1, 0.1], conversion=25.0),
        _run("webdataset", [0.5, 0.4, 0.3, 0.2]),
    ]
    assert time_to_target(runs[1]["points"], 0.101) == 30.0
    rows = {r["loader"]: r for r in summarise(runs, epochs=2, tolerance=0.01)}
    assert rows["solar"]["target loss"] == pytest.approx(0.101)
    assert rows["solar"]["seconds to target"] == 30.0
    assert rows["litdata"]["seconds to target"] == 55.0  # 30 s of training + 25 s of conversion
    assert rows["webdataset"]["seconds to target"] == "never"
    assert rows["solar"]["vs fastest peer"] == pytest.approx(55.0 / 30.0, abs=0.01)
    assert rows["solar"]["vs slowest peer"] == "inf"  # webdataset never gets there


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(900)
def test_quick_run_reaches_a_target_with_memory_capped_runs():
    payload = run_quick("solar_time_to_loss", timeout=900)
    if payload is None:  # refused clearly: no root or no cgroup
        return
    import importlib.util

    rows = {r["loader"]: r for r in payload["summary"]}
    has_litdata = importlib.util.find_spec("litdata") is not None  # a peer of the bench extra, skipped when absent
    assert set(rows) == {"memory", "solar", *(["litdata"] if has_litdata else [])}
    assert payload["not_installed"] == ({} if has_litdata else {"litdata": "litdata"})
    assert rows["memory"]["memory cap MiB"] is None
    for name in set(rows) - {"memory"}:
        assert rows[name]["memory cap MiB"] > 0, "every contestant runs under a memory cap"
        assert rows[name]["memory peak MiB"] <= rows[name]["memory cap MiB"] + 1
    assert rows["solar"]["status"] == "ok" and rows["solar"]["device MiB"] > 0
    # every baseline imports the libraries of the loader it calibrates (the budget pays for data, not code)
    assert any("lightning_sdp.datamodules.solar" in key for key in payload["baselines_mib"])
    if has_litdata:
        assert payload["conversions"]["litdata"][0]["seconds"] > 0
    for name in set(rows) - {"memory"}:  # a run that reaches the target stops at that validation
        if rows[name]["seconds to target"] != "never":
            assert rows[name]["final val loss"] <= rows[name]["target loss"]


def test_without_root_it_exits_2_saying_why(monkeypatch, capsys):
    import os

    from benchmarks import solar_time_to_loss

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert solar_time_to_loss.main(["--quick"]) == 2
    assert "needs root" in capsys.readouterr().err
