"""``lightning-sdp demo``: every part on ``--quick`` settings, the report, part selection and failure handling.

The ``gpt`` part's quick run is covered by ``tests/test_cli.py::test_demo_quick_writes_report``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_sdp import demo
from lightning_sdp.cli import main as cli_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run_part(part: str, out: Path) -> dict:
    assert demo.main(["--quick", "--only", part, "--out", str(out)]) == 0
    result = json.loads((out / part / "result.json").read_text())
    png = Path(result["png"])
    assert png.parent == out / part, "each part writes its picture into <out>/<part>/"
    assert png.read_bytes()[:8] == PNG_MAGIC
    index = (out / "index.md").read_text()
    assert result["headline"] in index
    assert f"]({part}/{png.name})" in index, "index.md links the part's picture"
    return result


@pytest.mark.slow
def test_sdp4bit_part_sends_fewer_bytes(tmp_path):
    r = _run_part("sdp4bit", tmp_path)
    assert r["processes"] == 2
    # 4-bit weights (qWD) and 4-bit gradients between the emulated nodes: several times fewer bytes than fp32
    assert r["bytes_per_step_sdp4bit"] < r["bytes_per_step_uncompressed"] / 4
    assert r["weight_bits_per_element"] == pytest.approx(4.0, abs=0.5)
    assert r["train_loss_sdp4bit"] == pytest.approx(r["train_loss_uncompressed"], abs=0.2)


@pytest.mark.open_clip
@pytest.mark.slow
def test_fastclip_part_reports_both_losses(tmp_path):
    r = _run_part("fastclip", tmp_path)
    for loss in ("openclip", "fastclip_v3"):
        assert 0.0 <= r[loss]["zeroshot_top1"] <= 100.0
        assert r[loss]["final_tau"] > 0
    assert r["batch"] == 16


def test_solar_part_counts_reads_and_quotes_the_real_device(tmp_path):
    r = _run_part("solar", tmp_path)
    assert Path(r["file"]).parent == tmp_path / "solar", "the generated HDF5 file lives in the output folder"
    bound, file_mib, n = r["hit_rate_bound"], r["file_mib"], r["samples"]
    assert 0 < bound < 0.25, "buffer_size is the buffer and the read-ahead together"
    for plan, plan_bound in (("solar", r["solar_hit_rate_bound"]), ("solar_exact", bound)):
        assert r[f"{plan}_hit_rate"][0] == 0.0  # the buffer starts empty, then serves C/N of every epoch
        assert r[f"{plan}_hit_rate"][-1] == pytest.approx(plan_bound, abs=0.02)
    # a plain DataLoader reads every sample of every dataset, one request each (h5py metadata on top)
    assert len(r["dataloader_requests"]) == 2 and min(r["dataloader_requests"]) >= 3 * n
    assert r["dataloader_storage_mib"][-1] == pytest.approx(file_mib, rel=0.01)
    # the exact plan reads only the misses; the default plan far fewer, longer requests
    assert r["solar_exact_storage_mib"][-1] == pytest.approx((1 - bound) * file_mib)
    assert r["solar_exact_requests"][-1] < r["dataloader_requests"][-1]
    assert 0 < 10 * max(r["solar_requests"]) < min(r["dataloader_requests"])
    for text in (f"hit rate {bound:.2f}", f"in {r['dataloader_requests'][-1]:,.0f}", f"{file_mib:.1f} MiB in"):
        assert text in r["headline"]
    # no speed measured here: any speed in the headline is the real-device benchmark's, and says so
    assert "samples/s" not in r["headline"] and "emulat" not in (r["headline"] + r["note"]).lower()
    real = r["real_device"]
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "solar_vs_loaders.json"
    if results.exists():
        assert real["source"] == str(results) and "solar_vs_loaders.json" in r["headline"]
        summary = json.loads(results.read_text())["summary"]
        measured = [row for row in summary if isinstance(row["samples/s"], int | float)]
        solar = sorted(row["vs best DataLoader"] for row in measured if row["loader"] == "solar")
        assert (
            f"{solar[0]:.2f}" in r["headline"] and f"{solar[-1]:.2f}x as fast as the best DataLoader" in r["headline"]
        )
        assert real["source"] in r["note"] and "40 MB/s" in r["note"]
        for row in summary:  # a run that did not finish is named, not dropped
            assert (row in measured) or f"{row['loader']} at P={row['P']} ({row['samples/s']})" in r["note"]


def test_real_device_summary_names_runs_that_did_not_finish(tmp_path):
    from lightning_sdp.demo.solar import real_device_summary

    def row(p, loader, speed, ratio=None):
        columns = {"vs best DataLoader": ratio, "device MiB/epoch": 96.0, "device requests/epoch": 100}
        return {"P": p, "loader": loader, "samples/s": speed, **(columns if ratio is not None else {})}

    summary = [row(1, "dl0", 100.0, 1.0), row(1, "solar", 250.0, 2.5), row(2, "dl0", 200.0, 1.0)]
    summary += [row(2, "solar", "failed"), row(2, "litdata", "oom-killed")]
    path = tmp_path / "solar_vs_loaders.json"
    path.write_text(json.dumps({"summary": summary}))
    real = real_device_summary(path)
    assert [r["P"] for r in real["rows"]] == [1] and real["rows"][0]["solar_vs_dataloader"] == 2.5
    assert real["failed"] == ["solar at P=2 (failed)", "litdata at P=2 (oom-killed)"]


def test_solar_part_without_the_benchmark_file_says_so(tmp_path, monkeypatch):
    from lightning_sdp.demo import solar

    monkeypatch.setattr(solar, "find_benchmark_results", lambda name=solar.RESULTS_NAME: None)
    r = _run_part("solar", tmp_path)
    assert r["real_device"] is None
    assert "no real-device result here" in r["headline"] and "x as fast" not in r["headline"]


@pytest.mark.numba
@pytest.mark.slow
def test_heat_part_measures_both_backends(tmp_path):
    r = _run_part("heat", tmp_path)
    rates = r["positives_per_s"]
    assert set(rates) == {"reference", "fused"} and min(rates.values()) > 0
    assert r["speedup"] == pytest.approx(rates["fused"] / rates["reference"])
    assert r["speedup"] > 1.0  # ~30x on 2 loaded cores; fused must at least not be slower


@pytest.mark.slow
def test_profiler_part_reports_engine_shares(tmp_path):
    r = _run_part("profiler", tmp_path)
    assert sum(r["fractions"].values()) == pytest.approx(1.0, abs=0.02)
    assert r["fractions"]["matrix"] > 0 and r["fractions"]["vector"] > 0
    assert "attention" in r["top_modules"]
    assert Path(r["report_json"]).exists()


def test_only_is_repeatable_and_keeps_order(tmp_path, monkeypatch, capsys):
    calls = []

    def fake(name):
        def run(out: Path, quick: bool) -> dict:
            calls.append((name, out, quick))
            return {"headline": f"{name} headline"}

        return run

    monkeypatch.setitem(demo.PARTS, "heat", fake("heat"))
    monkeypatch.setitem(demo.PARTS, "solar", fake("solar"))
    assert cli_main(["demo", "--quick", "--only", "solar", "--only", "heat", "--out", str(tmp_path)]) == 0
    assert [c[0] for c in calls] == ["solar", "heat"]
    assert calls[0][1] == tmp_path / "solar" and calls[0][2] is True
    table = (tmp_path / "index.md").read_text()
    assert table.index("| solar | solar headline") < table.index("| heat | heat headline")
    out = capsys.readouterr().out
    assert "solar: solar headline" in out and str((tmp_path / "index.md").resolve()) in out


def test_a_failing_part_is_reported_and_the_rest_still_run(tmp_path, monkeypatch, capsys):
    def broken(out: Path, quick: bool) -> dict:
        raise RuntimeError("disk on fire")

    monkeypatch.setitem(demo.PARTS, "heat", broken)
    monkeypatch.setitem(demo.PARTS, "solar", lambda out, quick: {"headline": "fine"})
    assert demo.main(["--only", "heat", "--only", "solar", "--out", str(tmp_path)]) == 1
    index = (tmp_path / "index.md").read_text()
    assert "FAILED: RuntimeError: disk on fire" in index and "| solar | fine" in index
    assert "disk on fire" in json.loads((tmp_path / "heat" / "result.json").read_text())["error"]


def test_unknown_part_is_refused(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--only", "nope"])
    assert "invalid choice" in capsys.readouterr().err


README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_demo_commands_run_as_written(tmp_path, monkeypatch):
    """Every ``lightning-sdp demo ...`` line in the README parses and runs (with stand-in parts)."""
    import shlex

    lines = [ln.split("#")[0].strip() for ln in README.read_text().splitlines()]
    commands = [ln for ln in lines if ln.startswith(".venv/bin/lightning-sdp demo")]
    assert len(commands) >= 3
    for name in demo.PARTS:
        monkeypatch.setitem(demo.PARTS, name, lambda out, quick, name=name: {"headline": f"{name} ok"})
    for command in commands:
        argv = shlex.split(command)[1:] + ["--out", str(tmp_path)]
        assert cli_main(argv) == 0, command


def test_readme_links_point_to_existing_files():
    import re

    root = README.parent
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)\)", README.read_text()) if "://" not in t]
    assert any(t.endswith(".png") for t in targets)
    missing = [t for t in targets if not (root / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_each_part_lives_in_its_own_module():
    assert list(demo.PARTS) == ["sdp4bit", "fastclip", "solar", "heat", "profiler", "gpt"]
    for name, run in demo.PARTS.items():
        assert run.__module__ == f"lightning_sdp.demo.{name}"


def test_python_dash_m_runs_the_demo(tmp_path):
    """``python -m lightning_sdp.demo`` is the same command as ``lightning-sdp demo``."""
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "lightning_sdp.demo", "--only", "nope"], capture_output=True, text=True, cwd=tmp_path
    )
    assert res.returncode == 2 and "invalid choice: 'nope'" in res.stderr
    assert "lightning-sdp demo" in res.stderr  # the same parser as the console script
