"""``python -m benchmarks.solar_slow_storage --quick`` on the throttled loop device (needs root and blkio cgroup v1).

Where the device cannot be built, the benchmark must refuse with exit code 2 and say why; that is asserted instead.
"""

from __future__ import annotations

import json

import pytest

from tests.benchmarks._throttled import run_quick


@pytest.mark.slow
@pytest.mark.bench
def test_quick_run_reads_fewer_device_requests_with_a_read_window():
    payload = run_quick("solar_slow_storage", timeout=300)
    if payload is None:  # refused clearly: no root or no blkio cgroup
        return
    rows = {r["mode"]: r for r in payload["summary"]}
    assert set(rows) == {"dl0", "solar:1:0", "solar:16:8", "solar:auto"}, "every mode ran in its child process"
    assert "read window" in payload["plans"]["solar:auto"], "the planner's choice is reported"
    assert all(0 < r["of bandwidth limit for (1 - C/N)"] for r in rows.values())
    assert all(r["device MiB/epoch"] > 0 for r in rows.values()), "the device served the reads (cache dropped)"
    # 16 steps' reads merged into a few long requests instead of one request per run of rows
    assert rows["solar:16:8"]["device requests/epoch"] < rows["solar:1:0"]["device requests/epoch"]


def test_without_root_it_exits_2_saying_why(monkeypatch, capsys):
    import os

    from benchmarks import solar_slow_storage

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert solar_slow_storage.main(["--quick"]) == 2
    assert "needs root" in capsys.readouterr().err


def _stored_run(headroom: int, sps: float) -> dict:
    return {
        "args": {"samples": 2048 * (2 if headroom else 1), "size": 64, "headroom_mib": headroom},
        "summary": [
            {"mode": "dl0", "samples/s (later epochs)": 100.0},
            {"mode": "solar:16:8", "samples/s (later epochs)": sps},
        ],
        "epochs": [{"mode": "dl0", "epoch": 1, "samples_per_s": 100.0}],
    }


def test_merge_writes_one_set_with_every_runs_numbers_unchanged(tmp_path, monkeypatch, capsys):
    from benchmarks import _common, solar_slow_storage

    monkeypatch.setattr(_common, "RESULTS_DIR", tmp_path)
    runs = {"uncapped": _stored_run(0, 834.9), "capped": _stored_run(128, 644.5)}
    for name, payload in runs.items():
        _common.write_results(name, payload, f"Description of {name}.\n\n" + _common.markdown_table(payload["summary"]))
    assert solar_slow_storage.main(["--merge", "uncapped", "capped", "--name", "merged"]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    md = (tmp_path / "merged.md").read_text()
    assert merged["merged_from"] == ["uncapped", "capped"]
    for run, (name, payload) in zip(merged["runs"], runs.items(), strict=True):
        assert run["name"] == name and run["summary"] == payload["summary"] and run["epochs"] == payload["epochs"]
        stored_md = (tmp_path / f"{name}.md").read_text()
        assert stored_md.split("\n\n", 1)[1].strip() in md, "each run's machine line, text and table verbatim"
    assert "page cache uncapped (run `uncapped`)" in md and "capped at use + 128 MiB (run `capped`)" in md
    assert md.index("834.9") < md.index("644.5")
    # merging the merged set with a new run keeps one level of runs; a run listed twice is refused
    _common.write_results("third", _stored_run(64, 700.0), "third")
    assert solar_slow_storage.main(["--merge", "merged", "third", "--name", "merged"]) == 0
    assert json.loads((tmp_path / "merged.json").read_text())["merged_from"] == ["uncapped", "capped", "third"]
    with pytest.raises(ValueError, match="listed twice"):
        solar_slow_storage.main(["--merge", "merged", "capped"])
