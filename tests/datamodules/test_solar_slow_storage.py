"""Issue 16: SOLAR on slow storage (readahead, read windows), the artifact's eviction rule, bad input."""

import os

import h5py
import numpy as np
import pytest
import torch

from lightning_sdp.datamodules.solar import SolarDataModule, SolarSchedule, make_ptycho_h5
from lightning_sdp.datamodules.solar.buffer import ArtifactFIFOBuffer, make_buffer
from lightning_sdp.datamodules.solar.loader import SolarLoader
from lightning_sdp.datamodules.solar.reader import HDF5Reader, inspect_h5

KEYS = ["diffraction", "amplitude", "phase"]


@pytest.fixture(scope="module")
def ptycho(tmp_path_factory):
    return make_ptycho_h5(tmp_path_factory.mktemp("solar_slow") / "p.h5", num_samples=64, size=8, seed=0)


# ---------------------------------------------------------------------------- readahead
def test_reader_advises_random_access_so_device_reads_match_the_plan(ptycho, monkeypatch):
    """Without POSIX_FADV_RANDOM the kernel's readahead read the whole file every epoch on a loop device."""
    advised = []
    real = os.posix_fadvise

    def spy(fd, offset, length, advice):
        advised.append(advice)
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    reader = HDF5Reader(ptycho, KEYS)  # default: readahead off, serial positional reads
    rows = reader.read([5, 3, 9, 10])
    assert os.POSIX_FADV_RANDOM in advised
    assert reader.bytes_read == 4 * 3 * 64 * 4  # exactly the rows asked for
    with h5py.File(ptycho, "r") as f:
        assert np.array_equal(rows["phase"], f["phase"][...][[5, 3, 9, 10]])
    advised.clear()
    HDF5Reader(ptycho, KEYS, readahead=True).read([1])
    assert os.POSIX_FADV_RANDOM not in advised


def test_read_window_gives_identical_batches_with_fewer_requests(ptycho):
    def run(window):
        schedule = SolarSchedule(64, 2, 1, 8, buffer_size=16, seed=3)
        reader = HDF5Reader(ptycho, KEYS, max_gap=2)
        loader = SolarLoader(schedule, 0, reader, KEYS[0], KEYS[1:], read_window=window)
        out = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            out += [(b["index"].clone(), b["input"].clone(), b["target"].clone()) for b in loader]
        return out, reader.requests, loader.epoch_stats

    ref, ref_requests, _ = run(1)
    got, requests, stats = run(4)
    assert len(got) == len(ref)
    for (i0, x0, y0), (i1, x1, y1) in zip(ref, got, strict=True):
        assert torch.equal(i0, i1) and torch.equal(x0, x1) and torch.equal(y0, y1)
    assert requests < ref_requests
    assert stats.hits == 16 and stats.reads == 64 - 16


def test_read_window_must_be_positive(ptycho):
    schedule = SolarSchedule(64, 1, 1, 8)
    with pytest.raises(ValueError, match="read_window"):
        SolarLoader(schedule, 0, HDF5Reader(ptycho, KEYS), KEYS[0], KEYS[1:], read_window=0)


# ---------------------------------------------------------------------------- the artifact's rule
def test_artifact_fifo_rule_replays_a_hand_counted_trace():
    """Capacity 3. Hits do not reorder; a miss is inserted, then the oldest load-set sample goes (else the oldest)."""
    buf = ArtifactFIFOBuffer(3)
    hits = 0

    def access(x, load_set=frozenset()):
        nonlocal hits
        buf.begin_step(load_set)
        if x in buf:
            hits += 1
            buf.hit(x, 0)
            return None
        return buf.offer(x, 0)

    for x in (1, 2, 3):
        assert access(x) == (True, None)  # fill: [1, 2, 3]
    assert access(4) == (True, 1)  # plain FIFO: oldest out -> [2, 3, 4]
    assert access(2) is None  # hit, no reorder (LRU would move 2 to the back)
    assert access(5, {3, 5, 6}) == (False, None)  # load-set sample: side buffer, not inserted
    assert access(6, {4, 7}) == (True, 4)  # oldest *load-set* sample (4), not the oldest (2) -> [2, 3, 6]
    assert access(2) is None and access(3) is None  # two hits
    assert access(7) == (True, 2)  # empty load set: oldest -> [3, 6, 7]
    assert access(2) == (True, 3)  # 2 was evicted: a miss
    assert hits == 3
    assert sorted(buf.contents()) == [2, 6, 7]


def test_artifact_fifo_reaches_about_twice_the_consumed_first_reading():
    rates = {}
    for policy in ("solar", "artifact_fifo"):
        report = SolarSchedule(4000, 3, 1, 32, buffer_size=1000, eviction=policy, seed=0).simulate()
        rates[policy] = float(np.mean(report.hit_rate[1:]))
    assert 0.08 < rates["artifact_fifo"] < 0.12  # the transcription: about 0.09 at C/N = 0.25
    assert rates["solar"] < 0.06
    assert make_buffer("artifact_fifo", 2).policy == "artifact_fifo"


# ---------------------------------------------------------------------------- bad input
def _write(path, **arrays):
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f[k] = v
    return path


def test_non_finite_samples_warn_with_file_key_and_ids(tmp_path):
    x = np.ones((8, 2), np.float32)
    x[5, 1] = np.nan
    path = _write(tmp_path / "nan.h5", x=x, y=np.zeros(8, np.float32))
    reader = HDF5Reader(path, ["x", "y"])
    with pytest.warns(RuntimeWarning, match=r"nan\.h5.*'x'|x holds non-finite.*\[5\]"):
        reader.read([1, 5, 2])
    with pytest.raises(ValueError, match=r"non-finite.*\[5\]"):
        HDF5Reader(path, ["x", "y"], validate="raise").read([5])
    with pytest.raises(ValueError, match="validate"):
        HDF5Reader(path, ["x"], validate="maybe")


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (np.ones((4, 2), dtype=">f4"), "big-endian"),
        (np.array([b"a", b"b", b"c", b"d"]), "numeric arrays only"),
    ],
)
def test_bad_dtypes_are_refused_at_setup_naming_file_and_key(tmp_path, data, match):
    path = _write(tmp_path / "bad.h5", x=data, y=np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=match) as err:
        inspect_h5(path, ["x", "y"])
    assert "bad.h5" in str(err.value) and "x" in str(err.value)
    dm = SolarDataModule(str(path), "x", "y", batch_size=2)
    with pytest.raises(ValueError, match=match):
        dm.setup("fit")


def test_buffer_smaller_than_one_sample_warns(ptycho):
    dm = SolarDataModule(str(ptycho), "diffraction", ["amplitude", "phase"], batch_size=8, buffer_size="100B")
    with pytest.warns(UserWarning, match="less than one sample"):
        dm.setup("fit")
    assert dm.schedule.buffer_size == 0
