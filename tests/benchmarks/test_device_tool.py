"""The throttled-storage runner of the SOLAR benchmarks refuses to start without root, saying why."""

import os

import pytest

from benchmarks.tools import device as ts


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


def test_cgroup_v2_files_limit_count_and_cap(tmp_path):
    from benchmarks.tools.cgroups import Cgroups, available_version

    group = tmp_path / "g"
    group.mkdir()
    (group / "io.stat").write_text("7:1 rbytes=5 wbytes=0 rios=1\n7:0 rbytes=8192 wbytes=4 rios=2 wios=1\n")
    (group / "memory.current").write_text("1000\n")
    (group / "memory.peak").write_text("5000\n")
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    cg = Cgroups(group, group, 2)
    cg.set_read_limits("7:0", 40_000_000, 0)
    assert (group / "io.max").read_text() == "7:0 rbps=40000000 riops=max"
    assert cg.device_reads("7:0") == (8192, 2) and cg.device_reads("8:0") == (0, 0)
    cg.set_memory_limit(3000)
    assert (group / "memory.max").read_text() == "3000"
    cg.set_memory_limit(None)
    assert (group / "memory.max").read_text() == "max"
    assert (cg.memory_usage(), cg.memory_peak(), cg.oom_kills()) == (1000, 5000, 1)
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    assert available_version(tmp_path / "none", tmp_path / "none", tmp_path) == 2
    assert available_version(tmp_path / "none", tmp_path / "none", tmp_path / "none") is None


def test_cgroup_v1_memory_files(tmp_path):
    from benchmarks.tools.cgroups import Cgroups

    blkio, memory = tmp_path / "blkio", tmp_path / "memory"
    blkio.mkdir()
    memory.mkdir()
    (memory / "memory.usage_in_bytes").write_text("700\n")
    (memory / "memory.max_usage_in_bytes").write_text("900\n")
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    cg = Cgroups(blkio, memory, 1)
    cg.set_read_limits("7:0", 1000, 400)
    assert (blkio / "blkio.throttle.read_iops_device").read_text() == "7:0 400"
    cg.set_memory_limit(None)
    assert (memory / "memory.limit_in_bytes").read_text() == "-1"
    assert (cg.memory_usage(), cg.memory_peak(), cg.oom_kills()) == (700, 900, 2)
    group = ts.ThrottleGroup(blkio, memory, "7:0", tmp_path)
    group.limit_memory(100)
    assert (memory / "memory.limit_in_bytes").read_text() == "800"


def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_what_a_killed_run_left_is_reaped_and_live_runs_are_kept(tmp_path):
    dead = _dead_pid()
    blkio = tmp_path / "blkio"
    (blkio / f"solar_bench_{dead}").mkdir(parents=True)  # an empty fake group: rmdir removes it
    (blkio / f"solar_bench_{os.getpid()}").mkdir()
    (blkio / "other_group_1").mkdir()
    stale, live, foreign = tmp_path / "throttled_a", tmp_path / "throttled_b", tmp_path / "throttled_c"
    for folder, owner in ((stale, dead), (live, os.getpid())):
        (folder / "mnt").mkdir(parents=True)
        (folder / "owner").write_text(str(owner))
    foreign.mkdir()  # no owner file: not ours to remove
    removed = ts.reap_stale("solar_bench", tmp_dir=tmp_path, cgroup_roots=(blkio, tmp_path / "absent"))
    assert sorted(removed) == sorted([str(blkio / f"solar_bench_{dead}"), str(stale)])
    assert not stale.exists() and live.exists() and foreign.exists()
    assert (blkio / f"solar_bench_{os.getpid()}").exists() and (blkio / "other_group_1").exists()
    assert ts.reap_stale("solar_bench", tmp_dir=tmp_path, cgroup_roots=(blkio,)) == []
