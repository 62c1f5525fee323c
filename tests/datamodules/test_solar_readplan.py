"""SOLAR's device-aware read plan (window, gap, memory split), the storage probe and the read-ahead thread."""

from __future__ import annotations

import collections
import math
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from lightning_sdp.datamodules.solar import make_ptycho_h5, prefetch
from lightning_sdp.datamodules.solar.prefetch import ReadAhead
from lightning_sdp.datamodules.solar.reader import coalesce_runs
from lightning_sdp.datamodules.solar.readplan import (
    FAST_LOCAL_STORAGE,
    ReadCosts,
    StorageProfile,
    anonymous_headroom,
    available_memory,
    memory_cgroup_limits,
    plan_reads,
    probe_storage,
    profile_reads,
    read_costs,
    window_reads,
    working_samples,
)
from tests.datamodules._solar import solar_datamodule

SLOW = StorageProfile(40e6, 400.0, 0.0)


def _reference_window_reads(num_samples, world_size, batch_size, buffer, window, gaps, seed):
    """The same drawn epoch, window by window through coalesce_runs, distinct rows through a set."""
    span = num_samples // world_size
    misses = int(round(span * (1 - min(1.0, buffer / num_samples))))
    steps = math.ceil(num_samples / (world_size * batch_size))
    per_window = max(1, math.ceil(misses / math.ceil(steps / window)))
    order = np.random.default_rng(seed).permutation(span)[:misses]
    out = []
    for gap in gaps:
        runs, rows, seen = 0, 0, set()
        for start in range(0, misses, per_window):
            for a, b in coalesce_runs(np.sort(order[start : start + per_window]), gap):
                runs, rows = runs + 1, rows + b - a
                seen.update(range(a, b))
        out.append((float(runs), float(rows), float(len(seen))))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_window_reads_match_coalesced_runs_of_the_same_drawn_epoch(seed):
    rng = np.random.default_rng(100 + seed)
    n, p, b = int(rng.integers(200, 3000)), int(rng.integers(1, 5)), int(rng.integers(4, 40))
    buffer, window = int(rng.integers(0, n // 2)), int(rng.integers(1, 12))
    gaps = [0, 1, 3, 8, 40]
    got = window_reads(
        num_samples=n, world_size=p, batch_size=b, buffer_samples=buffer, read_window=window, max_gaps=gaps, seed=seed
    )
    assert got == _reference_window_reads(n, p, b, buffer, window, gaps, seed)


def test_storage_profile_combines_request_and_transfer_costs_by_overlap():
    assert StorageProfile(1e6, 100.0, 1.0).seconds(2e6, 300) == pytest.approx(2 + 3)  # a disk: seek, then transfer
    assert StorageProfile(1e6, 100.0, 0.0).seconds(2e6, 300) == pytest.approx(3)  # separate limits: the larger
    for bad in ({"bandwidth_bytes_per_s": 0, "requests_per_s": 1}, {"bandwidth_bytes_per_s": 1, "requests_per_s": -1}):
        with pytest.raises(ValueError, match="must be a positive number"):
            StorageProfile(**bad)
    with pytest.raises(ValueError, match=r"overlap must be in \[0, 1\]"):
        StorageProfile(1.0, 1.0, overlap=2.0)


def _plan(storage, memory=512, **kw):
    args = dict(
        num_samples=2048,
        world_size=1,
        ranks_per_device=1,
        batch_size=32,
        memory_samples=memory,
        row_nbytes=[16384] * 3,
        storage=storage,
    )
    return plan_reads(**{**args, **kw})


def test_a_fast_device_gets_exact_reads_and_the_largest_buffer_a_slow_one_long_requests():
    fast, slow = _plan(FAST_LOCAL_STORAGE), _plan(SLOW, page_cache=True)
    assert (fast.read_window, fast.max_gap) == (1, 0)
    assert fast.buffer_samples == max(_plan(FAST_LOCAL_STORAGE, read_window=w).buffer_samples for w in (1, 2, 4))
    assert slow.predicted_requests < fast.predicted_requests / 4 and slow.max_gap > 0
    for plan in (fast, slow):
        assert plan.buffer_samples + plan.read_ahead_samples == 512
        assert 0 < plan.read_ahead_samples <= 512
    # the chosen plan is the fastest predicted one (within the tie margin) of every window and gap
    for w in (1, 4, 8):
        for g in (0, 4, 24):
            other = _plan(SLOW, page_cache=True, read_window=w, max_gap=g)
            assert slow.predicted_epoch_s <= other.predicted_epoch_s * 1.02 + 1e-9


def test_windows_that_need_more_memory_than_given_are_not_chosen():
    plan = _plan(SLOW, memory=100, page_cache=True)
    assert plan.read_ahead_samples == plan.read_window * 2 * 32 <= 100
    tiny = _plan(SLOW, memory=10, read_window=4)  # a fixed window larger than the memory still runs, unbuffered
    assert (tiny.buffer_samples, tiny.read_ahead_samples) == (0, 10)
    alone = _plan(SLOW, memory=64 * 4, with_buffer=False)
    assert alone.buffer_samples == 0 and alone.read_ahead_samples <= 256


@pytest.mark.parametrize("world_size", [1, 4])
def test_a_memory_budget_holds_the_loaders_working_memory_beside_buffer_and_read_ahead(world_size):
    sample = 3 * 16384
    budget = 2048  # samples over all ranks: 96 MiB
    for storage, page_cache in ((FAST_LOCAL_STORAGE, False), (SLOW, True)):
        plain = _plan(storage, memory=budget, world_size=world_size, page_cache=page_cache, io_threads=4)
        plan = _plan(
            storage, memory=budget, world_size=world_size, page_cache=page_cache, io_threads=4, reserve_working=True
        )
        assert plain.working_samples == 0
        # by hand: 4 MiB and the batches in flight per rank; a 1 MiB piece per I/O thread with gaps
        per_rank = 4 * 2**20 + 3 * 32 * sample + (4 * 2**20 if plan.max_gap else 0)
        assert plan.working_samples == world_size * -(-per_rank // sample)
        assert plan.working_samples == world_size * working_samples(32, plan.max_gap, sample, 4)
        assert plan.buffer_samples + plan.read_ahead_samples + plan.working_samples == budget
        assert plan.read_ahead_samples == 2 * plan.read_window * 32 * world_size
        assert f"working {plan.working_samples}" in plan.describe()
    # without gaps no pieces are reserved: the exact plan keeps 1 MiB per thread more for its buffer
    exact, gaps = (
        _plan(FAST_LOCAL_STORAGE, memory=budget, world_size=world_size, io_threads=4, reserve_working=True, **fixed)
        for fixed in ({"read_window": 1, "max_gap": 0}, {"read_window": 1, "max_gap": 8})
    )
    piece = working_samples(32, 8, sample, 4) - working_samples(32, 0, sample, 4)
    assert piece in (4 * 2**20 // sample, 4 * 2**20 // sample + 1)
    assert gaps.working_samples - exact.working_samples == world_size * piece
    assert exact.buffer_samples - gaps.buffer_samples == gaps.working_samples - exact.working_samples


FILE_BYTES = 2048 * 3 * 16384  # _plan's training set


def _stream_and_misses_s(bandwidth, iops, memory=512):
    """Device seconds per epoch on separate byte and request limits: the file streamed in 1 MiB requests, and the
    misses alone at one request per sample per dataset (their bytes at the bandwidth where that is longer)."""
    misses = 2048 - memory
    stream = max(FILE_BYTES / bandwidth, FILE_BYTES / 2**20 / iops)
    return stream, max(misses * 3 * 16384 / bandwidth, misses * 3 / iops)


@pytest.mark.parametrize("iops", [100, 400, 1000, 1700, 2200, 5000, 1e6])
def test_with_the_page_cache_the_plan_reads_through_gaps_exactly_when_streaming_beats_the_misses(iops):
    # 40 MB/s: streaming the 96 MiB costs 2.5 s; the 1536 misses x 3 datasets cost 4608 requests (1831/s: as much)
    stream_s, misses_s = _stream_and_misses_s(40e6, iops)
    plan = _plan(StorageProfile(40e6, iops, 0.0), page_cache=True)
    assert plan.costs == ReadCosts(pytest.approx(stream_s), pytest.approx(misses_s))
    if stream_s < misses_s:  # bandwidth-bound: the whole file at the bandwidth is the cheaper
        assert plan.costs.through_gaps and plan.max_gap > 0
        assert "reads through the gaps" in plan.describe()
    else:  # requests to spare: the misses alone, with the largest buffer a window of one step leaves
        assert not plan.costs.through_gaps and (plan.read_window, plan.max_gap) == (1, 0)
        assert plan.buffer_samples == _plan(StorageProfile(40e6, iops, 0.0), read_window=1).buffer_samples
        assert "reads only the misses" in plan.describe()


def test_read_costs_price_both_ways_for_the_ranks_sharing_a_device():
    disk = StorageProfile(100e6, 200.0, 1.0)  # a disk: a request's seek, then its transfer
    costs = read_costs(
        num_samples=4000, world_size=4, ranks_per_device=2, buffer_samples=1000, row_nbytes=[1000, 3000], storage=disk
    )
    misses = 2 * 1000 * 0.75  # two ranks of 1000 samples each, a quarter of them buffered
    assert costs.through_gaps_s == pytest.approx(16e6 / 100e6 + 16e6 / 2**20 / 200)
    assert costs.misses_s == pytest.approx(misses * 4000 / 100e6 + misses * 2 / 200)
    assert costs.seconds == costs.through_gaps_s and costs.through_gaps
    tie = ReadCosts(through_gaps_s=1.0, misses_s=1.015)  # within 2%: the misses (fewer bytes) win
    assert not tie.through_gaps and tie.seconds == 1.0


def test_the_plan_is_not_split_by_the_two_costs_where_the_page_cache_cannot_hold_the_file_or_the_gap_is_fixed():
    assert _plan(SLOW).costs is None  # gaps re-read by every window: weighed by the drawn epoch instead
    assert _plan(SLOW, page_cache=True, max_gap=4).costs is None


class _SimulatedDevice:
    """Reads that advance a simulated clock by a device's cost, except the first ``burst`` reads of each size
    (a throttled device serves a burst at once). ``additive``: a request's fixed cost and its transfer add up (a
    disk); else the larger counts (separate byte and request limits)."""

    def __init__(self, bandwidth, iops, additive=False, burst=64):
        self.bandwidth, self.iops, self.additive, self.burst = bandwidth, iops, additive, burst
        self.now, self._free, self._lock = 0.0, collections.Counter(), threading.Lock()

    def clock(self):
        return self.now

    def read(self, offset, length):
        with self._lock:
            if self._free[length] < self.burst:
                self._free[length] += 1
            else:
                transfer, fixed = length / self.bandwidth, 1 / self.iops
                self.now += transfer + fixed if self.additive else max(transfer, fixed)
        return length


def test_the_probe_does_not_time_a_throttled_devices_burst():
    device = _SimulatedDevice(40e6, 400.0)
    profile = profile_reads(device.read, 2**30, threads=4, clock=device.clock)
    # the free reads are not timed: 40 MB/s and 400 requests/s, not the burst's rates
    assert profile.bandwidth_bytes_per_s == pytest.approx(40e6, rel=0.01)
    assert profile.requests_per_s == pytest.approx(400.0, rel=0.01)
    assert profile.overlap == pytest.approx(0.0, abs=0.05)
    disk = _SimulatedDevice(40e6, 400.0, additive=True)
    profile = profile_reads(disk.read, 2**30, threads=4, clock=disk.clock)
    assert profile.requests_per_s == pytest.approx(1 / (1 / 400 + 4096 / 40e6), rel=0.01)
    assert profile.bandwidth_bytes_per_s == pytest.approx(2**20 / (2**20 / 40e6 + 1 / 400), rel=0.01)
    assert profile.overlap > 0.7


def test_probe_measures_positive_rates_once_per_file_system(tmp_path):
    small = tmp_path / "small.bin"
    small.write_bytes(b"\0" * 4096)
    assert probe_storage(small) is FAST_LOCAL_STORAGE  # too small to measure: served from the page cache anyway
    big = tmp_path / "big.bin"
    big.write_bytes(np.random.default_rng(0).bytes(40 * 2**20))
    profile = probe_storage(big, io_threads=2)
    assert profile.source == "probe" and 0.0 <= profile.overlap <= 1.0
    assert profile.bandwidth_bytes_per_s > 1e6 and profile.requests_per_s > 10
    assert probe_storage(big, io_threads=2) is profile


def _reader(delay=0.0, fail_on=None):
    def read(key, ids):
        if fail_on is not None and key == fail_on:
            raise ValueError(f"bad read {key}")
        time.sleep(delay)
        return {"x": ids.copy()}, 8 * len(ids)

    return read


def test_read_ahead_keeps_order_stays_within_its_budget_and_reads_while_the_consumer_works():
    window = 10 * 100
    ra = ReadAhead(_reader(delay=0.01), sample_nbytes=100, limit_bytes=2 * window)
    keys = [(0, s) for s in range(6)]
    for k in keys:
        ra.submit(k, np.arange(10) + k[1])
    got = []
    for k in keys:
        res = ra.get()
        got.append(res.key)
        assert np.array_equal(res.data["x"], np.arange(10) + k[1])
        if k[1] < 5:  # while this window is trained on, the thread reads the next one, and no further
            deadline = time.monotonic() + 10
            while ra._held < 2 * window and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.05)
            assert ra._held == 2 * window
        ra.release(res)
    assert got == keys
    assert ra.peak_held_bytes == 2 * window
    ra.close()


def test_read_ahead_waits_for_memory_beyond_its_first_window_and_reads_once_there_is_room():
    window = 10 * 100
    room = {"bytes": window}  # what the cgroup could give before the reads: the first window's worth
    ra = ReadAhead(
        _reader(),
        sample_nbytes=100,
        limit_bytes=3 * window,
        memory_headroom=lambda: room["bytes"] - ra._held,  # what the reads held take from it
        memory_sharers=2,
    )
    for step in range(3):
        ra.submit((0, step), np.arange(10) + step)
    first = ra.get()  # nothing held: read whatever the memory says
    time.sleep(0.3)
    assert first.key == (0, 0) and ra._held == window  # the budget has room for two more, the memory for none
    assert ra.memory_waits == 1
    room["bytes"] = 3 * window - 1  # one window's room, but two processes share it
    time.sleep(0.3)
    assert ra._held == window
    room["bytes"] = 3 * window  # room for both processes' next window: the thread sees it without a notification
    deadline = time.monotonic() + 10
    while ra._held < 2 * window and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.2)
    assert ra._held == 2 * window  # and no further: the third would not leave room for the other process's
    ra.release(first)
    assert [ra.get().key for _ in range(2)] == [(0, 1), (0, 2)]
    ra.close()


def test_anonymous_headroom_leaves_the_page_cache_out_of_every_capped_cgroup(tmp_path):
    unlimited = 2**63 - 4096
    v1 = _fake_cgroups(
        tmp_path / "v1",
        "4:memory:/arena/run\n",
        {
            "memory": _v1(unlimited, 5 * 2**30),
            "memory/arena": _v1(2**30, 900 * 2**20),
            "memory/arena/run": _v1(700 * 2**20, 690 * 2**20),
        },
    )
    assert anonymous_headroom(**v1) == 4000000 * 1024  # no memory.stat: MemAvailable alone
    (tmp_path / "v1/sys/memory/arena/run/memory.stat").write_text(
        f"cache {400 * 2**20}\nrss {290 * 2**20}\ntotal_rss {290 * 2**20}\n"
    )
    assert anonymous_headroom(**v1) == 410 * 2**20  # 690 MiB used, 400 of it page cache the kernel reclaims first
    (tmp_path / "v1/sys/memory/arena/memory.stat").write_text(f"total_rss {800 * 2**20}\n")
    assert anonymous_headroom(**v1) == 224 * 2**20  # the ancestor's cap, less everything anonymous under it
    v2 = _fake_cgroups(
        tmp_path / "v2",
        "0::/job\n",
        {"job": {"memory.max": str(300 * 2**20), "memory.current": "0", "memory.stat": f"anon {250 * 2**20}\n"}},
    )
    assert anonymous_headroom(**v2) == 50 * 2**20
    assert anonymous_headroom(**_fake_cgroups(tmp_path / "none", "", {})) == 4000000 * 1024
    assert anonymous_headroom(tmp_path / "absent", tmp_path / "absent", tmp_path / "absent") is None


def test_read_ahead_reset_drops_what_was_queued_and_errors_reach_the_consumer():
    ra = ReadAhead(_reader(fail_on=(0, 1)), sample_nbytes=1, limit_bytes=100)
    ra.submit((0, 0), np.arange(3))
    ra.submit((0, 1), np.arange(3))
    assert ra.get().key == (0, 0)
    with pytest.raises(ValueError, match=r"bad read \(0, 1\)"):
        ra.get()
    ra.submit((5, 0), np.arange(4))
    ra.reset()
    assert ra.queued_keys == []
    ra.submit((6, 0), np.arange(2))
    assert ra.get().key == (6, 0)
    with pytest.raises(RuntimeError, match="no request queued"):
        ra.get()
    ra.close()
    assert not any(t.name == "solar-read-ahead" and t.is_alive() for t in threading.enumerate() if t is ra._thread)


def _dm(path, **kw):
    args = dict(input_key="diffraction", target_key=["amplitude", "phase"], batch_size=8, buffer_size=32)
    return solar_datamodule(path, **{**args, "batch_format": "dict", "max_epochs": 3, **kw})


def test_the_next_epoch_is_read_during_this_one_and_gives_the_same_batches(tmp_path):
    path = make_ptycho_h5(tmp_path / "train.h5", num_samples=96, size=16, seed=0)
    epochs = []
    for across in (True, False):
        dm = _dm(path)
        dm.setup("fit")
        loader = dm.train_dataloader()
        loader.read_across_epochs = across
        batches = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            batches += [b for b in loader]
            if across and epoch < 2:  # the next epoch's first window is queued (or read) before its iter()
                assert loader._read_ahead.queued_keys[0] == (epoch + 1, 0)
        epochs.append(batches)
        loader.close()
    for a, b in zip(*epochs, strict=True):
        assert all(torch_equal(a[k], b[k]) for k in ("index", "input", "target"))


def torch_equal(a, b):
    import torch

    return torch.equal(a, b)


def test_a_resume_keeps_the_checkpoints_plan_when_the_device_measures_differently(tmp_path):
    path = make_ptycho_h5(tmp_path / "train.h5", num_samples=96, size=16, seed=0)
    first = _dm(path, storage={"bandwidth_bytes_per_s": 40e6, "requests_per_s": 400, "overlap": 0.0})
    first.setup("fit")
    state = first.state_dict()
    second = _dm(path)  # a fast local disk plans differently
    second.setup("fit")

    def knobs(dm):
        return dm.resolved_read_window, dm.resolved_max_gap, dm.read_plan.buffer_samples

    assert knobs(second) != knobs(first)
    second.load_state_dict(state)
    assert second.schedule.schedule_hash == first.schedule.schedule_hash
    assert knobs(second) == knobs(first)
    with pytest.raises(ValueError, match="buffer_size: checkpoint 32 vs now 16 samples"):
        other = _dm(path, buffer_size=16)
        other.setup("fit")
        other.load_state_dict(state)


def _fake_cgroups(tmp_path, membership, groups):
    """A /proc/self/cgroup file and a cgroup mount holding ``{relative dir: {file: text}}``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "cgroup"
    proc.write_text(membership)
    for relative, files in groups.items():
        directory = tmp_path / "sys" / relative
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (directory / name).write_text(text)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemAvailable:   4000000 kB\n")
    return {"proc_cgroup": proc, "sysfs": tmp_path / "sys", "meminfo": meminfo}


def _v1(limit, usage):
    return {"memory.limit_in_bytes": str(limit), "memory.usage_in_bytes": str(usage)}


def test_free_memory_counts_the_cap_of_the_processs_own_memory_cgroup_and_its_ancestors_v1(tmp_path):
    unlimited = 2**63 - 4096
    paths = _fake_cgroups(
        tmp_path,
        "4:memory:/arena/run\n7:blkio:/arena\n0::/\n",
        {
            "memory": _v1(unlimited, 5 * 2**30),
            "memory/arena": _v1(2**30, 100 * 2**20),
            "memory/arena/run": _v1(700 * 2**20, 650 * 2**20),  # a loader's run: 50 MiB left
        },
    )
    assert available_memory(**paths) == 50 * 2**20
    assert [limit.parent.name for limit, _ in memory_cgroup_limits(paths["proc_cgroup"], paths["sysfs"])] == [
        "run",
        "arena",
        "memory",
    ]
    # page cache read once (inactive) is reclaimed before anything else: it counts as free
    (tmp_path / "sys/memory/arena/run/memory.stat").write_text(
        f"cache {40 * 2**20}\ntotal_inactive_file {30 * 2**20}\n"
    )
    assert available_memory(**paths) == 80 * 2**20
    (tmp_path / "sys/memory/arena/run/memory.limit_in_bytes").write_text(str(unlimited))  # the ancestor's cap holds
    assert available_memory(**paths) == 2**30 - 100 * 2**20


def test_free_memory_reads_v2_caps_and_a_containers_own_root(tmp_path):
    v2 = _fake_cgroups(
        tmp_path / "v2",
        "0::/job/step\n",
        {
            "": {"memory.max": "max", "memory.current": "0"},
            "job": {"memory.max": str(300 * 2**20), "memory.current": str(200 * 2**20)},
            "job/step": {"memory.max": "max", "memory.current": str(200 * 2**20)},
        },
    )
    assert available_memory(**v2) == 100 * 2**20
    (tmp_path / "v2/sys/job/memory.stat").write_text(f"anon {150 * 2**20}\ninactive_file {20 * 2**20}\n")
    assert available_memory(**v2) == 120 * 2**20
    # in a container the membership names a path above the mount, whose root is the container's own group
    container = _fake_cgroups(tmp_path / "c", "4:memory:/docker/abc\n", {"memory": _v1(2**30, 2**29)})
    assert available_memory(**container) == 2**29
    no_cgroups = _fake_cgroups(tmp_path / "none", "", {})
    assert available_memory(**no_cgroups) == 4000000 * 1024  # MemAvailable alone


def test_a_file_larger_than_the_cgroups_free_memory_is_planned_without_the_page_cache(tmp_path, monkeypatch):
    from lightning_sdp.datamodules.solar import readplan

    path = make_ptycho_h5(tmp_path / "train.h5", num_samples=200, size=16, seed=1)
    args = dict(input_key="diffraction", target_key=["amplitude", "phase"], batch_size=8, buffer_size=48)
    slow = {"bandwidth_bytes_per_s": 4e7, "requests_per_s": 400.0, "overlap": 0.0}  # streaming beats the misses
    monkeypatch.setattr(readplan, "available_memory", lambda: 2**40)
    roomy = solar_datamodule(path, storage=slow, warm_page_cache=True, log_metrics=False, **args)
    roomy.setup("fit")
    monkeypatch.setattr(readplan, "available_memory", lambda: path.stat().st_size)  # under twice the file
    tight = solar_datamodule(path, storage=slow, warm_page_cache=True, log_metrics=False, **args)
    tight.setup("fit")
    assert roomy.read_plan.costs is not None and roomy.cold_gap is not None
    assert tight.read_plan.costs is None and tight.cold_gap is None  # no file streamed into a cache that evicts it


_TRIM_PROBE = """
import numpy as np
from lightning_sdp.datamodules.solar.prefetch import return_free_memory

def anon():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("RssAnon"))

raised = np.ones(4 * 2**20, dtype=np.uint8)
del raised  # a freed mmapped block raises glibc's mmap threshold: the next 1 MiB arrays come from the heap
windows, kept = [], []
for _ in range(64):
    windows.append(np.ones(2**20, dtype=np.uint8))
    kept.append(np.ones(2048))  # small arrays kept between them: the heap cannot shrink at its top
windows.clear()
before = anon()
return_free_memory()
print(before - anon())
"""


@pytest.mark.skipif(prefetch._MALLOC_TRIM is None, reason="glibc's malloc_trim: Linux with glibc only")
def test_freed_window_rows_go_back_to_the_os():
    # in a fresh interpreter: a test process's heap holds whatever earlier tests left in it
    returned = subprocess.run([sys.executable, "-c", _TRIM_PROBE], capture_output=True, text=True, check=True)
    assert int(returned.stdout.split()[-1]) > 32 * 2**20  # of the 64 MiB freed
