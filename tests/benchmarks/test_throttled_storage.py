"""The throttled-storage runner of the SOLAR benchmarks refuses to start without root, saying why."""

import os

import pytest

from benchmarks import _throttled_storage as ts


def test_without_root_it_says_so_and_exits_non_zero(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="needs root"):
        ts.ThrottledStorage().__enter__()
    assert ts.main(["--", "true"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_byte_sizes_parse_and_bad_ones_are_named():
    assert ts.parse_bytes("40MB") == 40_000_000
    assert ts.parse_bytes("512MiB") == 512 * 2**20
    with pytest.raises(ValueError, match="12 parsecs"):
        ts.parse_bytes("12 parsecs")


def test_cleanup_before_setup_is_harmless():
    storage = ts.ThrottledStorage()
    storage.cleanup()  # nothing was created: no error, nothing touched
    storage.cleanup()


def test_group_reads_counters_of_its_device_only(tmp_path):
    blkio = tmp_path / "blkio"
    blkio.mkdir()
    (blkio / "blkio.throttle.io_service_bytes").write_text("7:0 Read 4096\n7:0 Write 10\n7:1 Read 99\nTotal 4205\n")
    (blkio / "blkio.throttle.io_serviced").write_text("7:0 Read 3\n7:1 Read 5\n")
    group = ts.ThrottleGroup(blkio, None, "7:0", tmp_path)
    assert group.device_read_bytes() == 4096
    assert group.device_read_requests() == 3
    with pytest.raises(PermissionError, match="memory"):
        group.limit_memory(1)
