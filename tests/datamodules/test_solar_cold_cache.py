"""A plan that counts on the page cache, met with a cold cache: the file is streamed in, reads use short runs."""

import os
import time

import pytest
import torch

from lightning_sdp.datamodules.solar import SolarReadOptions
from lightning_sdp.datamodules.solar.prefetch import PageCacheWarmer
from lightning_sdp.datamodules.solar.ptycho import make_ptycho_h5
from lightning_sdp.datamodules.solar.reader import HDF5Reader
from tests.datamodules._solar import solar_datamodule

KEYS = ["diffraction", "amplitude", "phase"]


@pytest.fixture(scope="module")
def ptycho(tmp_path_factory):
    return make_ptycho_h5(tmp_path_factory.mktemp("cold") / "train.h5", num_samples=200, size=16, seed=3)


def _drop(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_page_cache_warmer_streams_its_share_and_restarts(ptycho):
    layout = HDF5Reader(ptycho, KEYS).direct_layout()
    _drop(ptycho)
    warmer = PageCacheWarmer(str(ptycho), layout, 50, 150, chunk_bytes=8 * 1024)
    try:
        assert warmer.passes_done == 0  # nothing is read before a pass is asked for
        warmer.start_pass()
        deadline = time.monotonic() + 30
        while warmer.passes_done < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert warmer.passes_done == 1
        share = sum(100 * row for _, row in layout.values())
        assert warmer.device_bytes <= share  # never more than its rows, fewer where they were already cached
        fd = os.open(ptycho, os.O_RDONLY)
        try:
            for offset, row in layout.values():  # the share is in the page cache now
                buf = bytearray(100 * row)
                assert os.preadv(fd, [buf], offset + 50 * row, os.RWF_NOWAIT) == len(buf)
        finally:
            os.close(fd)
        before = warmer.device_bytes
        warmer.start_pass()  # a warm pass copies from the cache: no device bytes
        while warmer.passes_done < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert warmer.passes_done == 2 and warmer.device_bytes == before
    finally:
        warmer.close()


def _batches(path, warm, epochs=2):
    dm = solar_datamodule(
        path,
        input_key="diffraction",
        target_key=["amplitude", "phase"],
        batch_size=8,
        buffer_size=48,
        batch_format="dict",
        max_epochs=epochs,
        read_window=4,
        max_gap=16,
        # requests cheap against bytes: a cold device is read with small gaps, the cached file with long runs
        storage={"bandwidth_bytes_per_s": 4e7, "requests_per_s": 40_000},
        warm_page_cache=warm,
        log_metrics=False,
    )
    dm.setup("fit")
    loader = dm.train_dataloader()
    out = []
    for epoch in range(epochs):
        _drop(path)  # every epoch starts cold
        loader.set_epoch(epoch)
        out += list(loader)
    deadline = time.monotonic() + 30
    while loader._warmer is not None and loader._warmer.passes_done < epochs and time.monotonic() < deadline:
        time.sleep(0.01)
    passes = loader._warmer.passes_done if loader._warmer is not None else 0
    assert loader.reader.max_gap == (dm.cold_gap if dm.cold_gap is not None else dm.resolved_max_gap)
    loader.close()
    return dm, out, passes


def test_warming_a_cold_page_cache_yields_the_same_batches(ptycho):
    dm, plain, passes = _batches(ptycho, False)
    assert dm.cold_gap is None and passes == 0
    dm, warmed, passes = _batches(ptycho, True)
    assert dm.cold_gap is not None and 0 <= dm.cold_gap < 16
    assert passes == 2  # one pass of the rank's share per epoch
    assert len(plain) == len(warmed) == 2 * 200 // 8
    for a, b in zip(plain, warmed, strict=True):
        for key in ("index", "input", "target", "loss_scale"):
            assert torch.equal(a[key], b[key])
    with pytest.raises(ValueError, match=r"warm_page_cache must be 'auto' or a bool \(True or False\), got 'yes'"):
        SolarReadOptions(warm_page_cache="yes")


def test_warming_is_off_for_exact_plans_and_worker_processes(ptycho):
    for kw in ({"max_gap": 0}, {"num_workers": 1}):
        args = dict(input_key="diffraction", target_key=["amplitude", "phase"], batch_size=8, buffer_size=48)
        dm = solar_datamodule(ptycho, read_window=4, warm_page_cache=True, log_metrics=False, **{**args, **kw})
        dm.setup("fit")
        assert dm.cold_gap is None


def test_a_reader_that_never_pauses_does_not_starve_the_warmer(ptycho):
    # loading alone, the read-ahead thread always has a read in flight: the warmer must still stream the file
    layout = HDF5Reader(ptycho, KEYS).direct_layout()
    _drop(ptycho)
    warmer = PageCacheWarmer(str(ptycho), layout, 0, 200, chunk_bytes=64 * 1024, yield_to=lambda: True)
    try:
        warmer.start_pass()
        deadline = time.monotonic() + 20
        while warmer.passes_done < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert warmer.passes_done == 1
    finally:
        warmer.close()


def test_a_read_waits_for_the_stream_to_pass_its_rows(ptycho):
    layout = HDF5Reader(ptycho, KEYS).direct_layout()
    _drop(ptycho)
    warmer = PageCacheWarmer(str(ptycho), layout, 0, 200, chunk_bytes=16 * 1024)
    try:
        warmer.wait_streamed(150)  # no pass asked for: nothing to wait for
        warmer.start_pass()
        warmer.wait_streamed(150)
        assert warmer.passes_done == 1 or warmer._position > 150  # the stream is past the row when the wait ends
        fd = os.open(ptycho, os.O_RDONLY)
        try:
            for offset, row in layout.values():  # row 150 is in the page cache: its read is a copy
                buf = bytearray(row)
                assert os.preadv(fd, [buf], offset + 150 * row, os.RWF_NOWAIT) == len(buf)
        finally:
            os.close(fd)
        warmer.wait_streamed(10_000)  # a row past the share waits for the pass's end
        assert warmer.passes_done == 1
    finally:
        warmer.close()
    warmer.wait_streamed(10)  # closed: returns at once
