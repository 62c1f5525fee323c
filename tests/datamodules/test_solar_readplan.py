"""SOLAR's device-aware read plan (window, gap, memory split), the storage probe and the read-ahead thread."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from lightning_sdp.datamodules.solar import make_ptycho_h5
from lightning_sdp.datamodules.solar.prefetch import ReadAhead
from lightning_sdp.datamodules.solar.reader import coalesce_runs
from lightning_sdp.datamodules.solar.readplan import (
    FAST_LOCAL_STORAGE,
    StorageProfile,
    plan_reads,
    probe_storage,
    window_reads,
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
    assert plan.read_ahead_samples <= 100 and plan.read_window * 2 * 32 * (1 - plan.buffer_samples / 2048) <= 100
    tiny = _plan(SLOW, memory=10, read_window=4)  # a fixed window larger than the memory still runs, unbuffered
    assert (tiny.buffer_samples, tiny.read_ahead_samples) == (0, 10)
    alone = _plan(SLOW, memory=64 * 4, with_buffer=False)
    assert alone.buffer_samples == 0 and alone.read_ahead_samples <= 256


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
