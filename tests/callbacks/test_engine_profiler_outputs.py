"""EngineProfiler's output files: checked trace export, atomic JSON, and the closing message on where things went."""

from __future__ import annotations

import errno
import gzip
import json
import logging
import os
from pathlib import Path

import pytest
import torch

from lightning_sdp._files import write_text_atomic
from lightning_sdp.callbacks import EngineProfiler
from lightning_sdp.callbacks.engine_profiler import outputs
from lightning_sdp.callbacks.engine_profiler.outputs import TraceExportError, export_trace
from tests._full_disk import small_disk
from tests.callbacks.test_engine_profiler import _loader, _model, _trainer

TRACE = {"traceEvents": [{"name": "aten::mm", "ph": "X", "ts": 1.0, "dur": 2.0}]}


@pytest.fixture(autouse=True)
def _tiny_device_measurement(monkeypatch):
    """Keep a measurement of the device ceilings to a few milliseconds (one tiny GEMM and vector size)."""
    import lightning_sdp.profiling.engine_bench as eb

    monkeypatch.setitem(eb._GEMMS, ("cpu", True), ((64, 64, 64),))
    monkeypatch.setitem(eb._VECTOR_SIZES, ("cpu", True), (1 << 12,))
    monkeypatch.setitem(eb._MIN_TIME_S, True, 1e-4)
    monkeypatch.setitem(eb._REPEATS, True, 1)


class _FakeProfiler:
    """Stands in for a stopped ``torch.profiler.profile``: ``export_chrome_trace`` runs ``write(path)``."""

    def __init__(self, write) -> None:
        self.write = write

    def export_chrome_trace(self, path: str) -> None:
        self.write(path)


def _write_trace(path: str) -> None:
    Path(path).write_text(json.dumps(TRACE))


def _raise_disk_full(path: str) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


# ------------------------------------------------------------------------------------------ trace export (unit)


def test_export_trace_writes_a_gzip_that_reads_back(tmp_path):
    path = tmp_path / "t.pt.trace.json.gz"
    assert export_trace(_FakeProfiler(_write_trace), path) == path
    with gzip.open(path, "rt") as fh:
        assert json.load(fh) == TRACE
    assert os.listdir(tmp_path) == [path.name], "no temporary file is left"
    (tmp_path / "by_open").write_text("")
    assert path.stat().st_mode & 0o777 == (tmp_path / "by_open").stat().st_mode & 0o777


@pytest.mark.parametrize(
    ("write", "reason"),
    [
        (lambda path: Path(path).write_bytes(b""), "torch wrote an empty trace"),
        (_raise_disk_full, r"export_chrome_trace failed \(OSError: .*No space left on device"),
        (lambda path: Path(path).write_bytes(b"\x00\x01garbage"), "torch's trace is not JSON"),
        (lambda path: None, "torch wrote no trace file .* MiB free"),
        (_write_trace, "over the bound of 0.0 MiB"),
    ],
    ids=["empty", "disk-full", "not-json", "nothing", "too-large"],
)
def test_failed_export_raises_its_reason_and_leaves_no_file(tmp_path, write, reason):
    path = tmp_path / "t.pt.trace.json.gz"
    path.write_bytes(b"an earlier run's trace")
    with pytest.raises(TraceExportError, match=reason):
        export_trace(_FakeProfiler(write), path, max_bytes=10 if write is _write_trace else None)
    assert os.listdir(tmp_path) == [], "neither temporary files nor a file under the trace's name remain"


def test_compression_failing_midway_leaves_no_partial_gz(tmp_path, monkeypatch):
    def partial_copy(src, dst, length=0):
        dst.write(src.read(5))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs.shutil, "copyfileobj", partial_copy)
    path = tmp_path / "t.pt.trace.json.gz"
    with pytest.raises(TraceExportError, match="compressing the trace failed .*No space left"):
        export_trace(_FakeProfiler(_write_trace), path)
    assert os.listdir(tmp_path) == []


def _torch_profile() -> torch.profiler.profile:
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(20)])
    with torch.profiler.profile() as prof:
        for _ in range(3):
            model(torch.randn(8, 32)).sum().backward()
    return prof


def _torch_fails_on_a_full_disk(path: str) -> None:
    """What torch's trace writer does on a full disk: a partial ``<path>.tmp``, an error message, no exception."""
    Path(path + ".tmp").write_text('{"traceEvents": [')


def test_trace_export_on_a_full_disk_leaves_no_partial_file(tmp_path):
    """torch's writer leaves ``<name>.tmp`` behind on a full disk (no exception): the export says so, and the
    private folder it wrote in is removed with that file."""
    with small_disk(tmp_path, 64) as disk:
        if disk is None:  # not root: emulate torch's behaviour on a full disk
            prof, folder = _FakeProfiler(_torch_fails_on_a_full_disk), tmp_path
        else:
            prof, folder = _torch_profile(), disk
        path = folder / "t.pt.trace.json.gz"
        with pytest.raises(TraceExportError, match="torch wrote no trace file"):
            export_trace(prof, path)
        assert [p for p in os.listdir(folder) if p != "small_disk"] == []


# ------------------------------------------------------------------------------------------ in a Trainer run


def test_failed_trace_in_a_run_warns_names_no_trace_and_writes_json_atomically(tmp_path, monkeypatch, caplog):
    _capture_info(caplog)
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", lambda self, path: None)
    written = []

    def spy(path, text):
        written.append(Path(path).name)
        return write_text_atomic(path, text)

    monkeypatch.setattr("lightning_sdp.callbacks.engine_profiler.callback.write_text_atomic", spy)
    out = tmp_path / "ep"
    cb = EngineProfiler(
        wait=0,
        warmup=1,
        active=1,
        repeat=1,
        dirpath=str(out),
        save_plot=False,
        measure_peaks=False,
        print_summary=False,
    )
    trace = out / "engine_profile-rank0-window0.pt.trace.json.gz"
    with pytest.warns(
        UserWarning, match=rf"could not write the trace of window 0 to {trace}: torch wrote no trace file"
    ):
        _trainer(tmp_path, cb, max_steps=2).fit(_model(), _loader())
    assert cb.reports[0].trace_file is None
    assert json.loads((out / "engine_profile-rank0.json").read_text())[0]["trace_file"] is None
    assert sorted(os.listdir(out)) == ["engine_profile-rank0.json", "engine_profile-summary.json"]
    assert written == ["engine_profile-rank0.json", "engine_profile-summary.json"]
    assert _closing_lines(caplog) == [], "print_summary=False: no closing message either"


def _capture_info(caplog) -> None:
    """INFO from ``rank_zero_info`` (logger ``lightning.pytorch.utilities.rank_zero``), whatever level an earlier test
    in this process left on ``lightning.pytorch`` (the demo's ``quiet_lightning`` sets WARNING); caplog restores it."""
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="lightning.pytorch")


def _closing_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "EngineProfiler: files in" in r.getMessage()]


def test_closing_message_says_where_files_went_and_where_ceilings_came_from(tmp_path, caplog):
    cache = tmp_path / "cache"
    _capture_info(caplog)

    def fit(folder: str, **kwargs) -> tuple[EngineProfiler, str]:
        caplog.clear()
        cb = EngineProfiler(
            wait=0, warmup=1, active=1, repeat=1, dirpath=str(tmp_path / folder), save_plot=False, **kwargs
        )
        _trainer(tmp_path, cb, max_steps=2).fit(_model(), _loader())
        (message,) = _closing_lines(caplog)  # logged once
        return cb, message

    cb, message = fit("a", peaks_cache_dir=str(cache))
    out = tmp_path / "a"
    cache_file = cb._device_profile_file
    assert cache_file is not None and Path(cache_file).parent == cache
    assert (
        f"files in {out.resolve()}: engine_profile-rank0.json, engine_profile-summary.json, 1 Chrome trace" in message
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "engine_profile-rank0-window0.pt.trace.json.gz",
        "engine_profile-rank0.json",
        "engine_profile-summary.json",
    ]
    assert "device ceilings measured in this run" in message and f"cached at {cache_file}" in message

    _, message = fit("b", peaks_cache_dir=str(cache))
    assert f"device ceilings read from the cache {cache_file}" in message
    assert "measured in this run" not in message

    _, message = fit("c", measure_peaks=False)
    assert "device ceilings not measured (measure_peaks=False)" in message


def test_closing_message_lists_each_file_once_and_names_the_ranks(tmp_path):
    files = [tmp_path / "p-rank0.json", tmp_path / "p-rank0.json", tmp_path / "p-summary.json"]
    message = outputs.closing_message(tmp_path, files, traces=3, world_size=4, ceilings=None)
    assert message.splitlines() == [
        f"EngineProfiler: files in {tmp_path.resolve()}: p-rank0.json, p-summary.json, 3 Chrome traces "
        "(*.pt.trace.json.gz).",
        "EngineProfiler: each of the 4 ranks writes its own -rank<R> files (on its own host).",
    ]
