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


def test_a_run_that_did_not_finish_is_summarised_with_why_and_what_it_finished(tmp_path):
    from benchmarks.solar_vs_loaders import _last_line, _partial, _summarise

    out = tmp_path / "solar_2.json"
    assert _partial(out) == {}
    out.write_text('{"epochs": [{"epoch": 0, "samples_per_s": 10.0}, {"epoch": 1, "samples_per_s": 30.0}]')
    assert _partial(out) == {}  # a file cut short by the kill reads as nothing
    out.write_text('{"epochs": [{"epoch": 0, "samples_per_s": 10.0}, {"epoch": 1, "samples_per_s": 30.0}]}')
    done = _partial(out)["epochs"]
    assert _last_line("epoch 2\nTraceback ...\nMemoryError: x\n\n") == "MemoryError: x"
    assert _last_line("[rank: 1] Child process terminated with code -9\nx.py:21: `f` is deprecated\n").startswith(
        "[rank"
    )
    rows = [
        {"ranks": 2, "loader": "solar", "failed": "failed (timeout)", "after_s": 300.2, "epochs_done": done},
        {"ranks": 2, "loader": "litdata", "failed": "oom-killed", "epochs_done": done[:1]},
        {"ranks": 2, "loader": "dl0", "failed": "failed (1)", "epochs_done": []},
    ]
    summary = {r["loader"]: r["samples/s"] for r in _summarise(rows, [2], ["solar", "litdata", "dl0"])}
    assert summary == {
        "solar": "timed out after 300 s, 2 epochs done (30.0 samples/s after the first)",
        "litdata": "oom-killed, no epoch after the first done",
        "dl0": "failed (1)",
    }
