import os
import pickle
import stat

import h5py
import numpy as np
import pytest

from lightning_sdp.datamodules.solar import reader as reader_module
from lightning_sdp.datamodules.solar.ptycho import make_ptycho_h5, simulate_ptycho
from lightning_sdp.datamodules.solar.reader import (
    HDF5Reader,
    PositionalFile,
    coalesce_runs,
    inspect_h5,
    read_coalesced,
    read_per_sample,
)


def _runs_reference(ids, max_gap):
    runs = []
    for i in ids:
        if runs and i - (runs[-1][1] - 1) - 1 <= max_gap:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [tuple(r) for r in runs]


@pytest.mark.parametrize("max_gap", [0, 1, 4])
def test_coalesce_runs_matches_reference(max_gap):
    rng = np.random.default_rng(max_gap)
    for _ in range(20):
        ids = np.unique(rng.integers(0, 200, size=rng.integers(1, 80)))
        assert coalesce_runs(ids, max_gap) == _runs_reference(ids.tolist(), max_gap)
    assert coalesce_runs(np.array([], dtype=np.int64)) == []
    assert coalesce_runs(np.array([3, 4, 5, 9])) == [(3, 6), (9, 10)]


@pytest.fixture(scope="module")
def h5file(tmp_path_factory):
    path = tmp_path_factory.mktemp("solar") / "rows.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["x"] = rng.standard_normal((97, 2, 3)).astype(np.float32)
        f.create_dataset("chunked", data=rng.standard_normal((97, 5)).astype(np.float64), chunks=(8, 5))
        f["y"] = np.arange(97, dtype=np.int64)
        f["short"] = np.zeros(10)
    return path


@pytest.mark.parametrize("key", ["x", "chunked", "y"])
@pytest.mark.parametrize("max_gap", [0, 3])
def test_coalesced_reads_return_requested_rows_in_order(h5file, key, max_gap):
    rng = np.random.default_rng(1)
    with h5py.File(h5file, "r") as f:
        dset = f[key]
        for size in (0, 1, 17, 64):
            ids = rng.integers(0, 97, size=size)  # any order, repeats allowed
            fast, nbytes, requests = read_coalesced(dset, ids, max_gap)
            ref = read_per_sample(dset, ids)
            assert fast.dtype == ref.dtype and fast.shape == ref.shape
            assert np.array_equal(fast, ref)
            uniq = np.unique(ids)
            runs = coalesce_runs(uniq, max_gap)
            assert requests == len(runs)
            row = dset.dtype.itemsize * int(np.prod(dset.shape[1:]))
            assert nbytes == sum(b - a for a, b in runs) * row
            if max_gap == 0:
                assert nbytes == len(uniq) * row


def test_coalesced_read_rejects_out_of_range(h5file):
    with h5py.File(h5file, "r") as f, pytest.raises(IndexError, match="outside the dataset's 97 rows"):
        read_coalesced(f["x"], [3, 97])


def test_inspect_errors(h5file, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        inspect_h5(tmp_path / "nope.h5", ["x"])
    with pytest.raises(ValueError, match="no dataset 'z'"):
        inspect_h5(h5file, ["x", "z"])
    with pytest.raises(ValueError, match="different lengths"):
        inspect_h5(h5file, ["x", "short"])
    corrupt = tmp_path / "corrupt.h5"
    corrupt.write_bytes(b"\x89HDF\r\n\x1a\n" + b"garbage" * 100)
    with pytest.raises(ValueError, match="corrupt"):
        inspect_h5(corrupt, ["x"])
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(h5file.read_bytes()[:2000])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        inspect_h5(truncated, ["x"])
    info = inspect_h5(h5file, ["x", "y"])
    assert info.num_samples == 97 and info.shapes == {"x": (2, 3), "y": ()}
    assert info.sample_nbytes == 2 * 3 * 4 + 8


def test_reader_pickles_without_handle_and_reads(h5file):
    reader = HDF5Reader(h5file, ["x", "y"])
    first = reader.read([5, 1])
    assert reader.bytes_read == 2 * (24 + 8)
    clone = pickle.loads(pickle.dumps(reader))
    assert clone._file is None
    again = clone.read([5, 1])
    assert np.array_equal(first["x"], again["x"]) and again["y"].tolist() == [5, 1]
    baseline = HDF5Reader(h5file, ["x"], coalesce=False)
    assert np.array_equal(baseline.read([5, 1])["x"], first["x"])
    assert baseline.requests == 2


def test_positional_file_reads_at_offsets_and_counts(tmp_path):
    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes(range(256)))
    f = PositionalFile(path, readahead=False)
    buf = bytearray(8)
    assert f.pread_into(buf, 100) == 8 and bytes(buf) == bytes(range(100, 108))
    assert (f.bytes_read, f.requests) == (8, 1)
    with pytest.raises(OSError, match="unexpected end of file at byte 256"):
        f.pread_into(bytearray(8), 252)
    f.close()
    f.close()


def test_ptycho_generator_is_deterministic_and_physical(tmp_path):
    a = make_ptycho_h5(tmp_path / "a.h5", num_samples=40, size=16, seed=3, block=16)
    b = make_ptycho_h5(tmp_path / "b.h5", num_samples=40, size=16, seed=3, block=16)
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        for k in ("diffraction", "amplitude", "phase"):
            assert fa[k].shape == (40, 1, 16, 16)
            assert np.array_equal(fa[k][:], fb[k][:])
        assert fa["amplitude"][:].min() >= 0.6 - 1e-6 and fa["amplitude"][:].max() <= 1 + 1e-6
        assert np.abs(fa["phase"][:]).max() <= np.pi / 2 + 1e-6
    with pytest.raises(FileExistsError):
        make_ptycho_h5(a, num_samples=4, size=16)
    # noiseless physics check: the input is log1p of the normalised |FFT(probe * object)|^2
    d = simulate_ptycho(3, 16, seed=1, photons=0)
    obj = d["amplitude"][:, 0] * np.exp(1j * d["phase"][:, 0])
    axis = np.arange(16) - 7.5
    xx, yy = np.meshgrid(axis, axis, indexing="ij")
    probe = np.exp(-(xx**2 + yy**2) / (2 * (16 / 5) ** 2))
    intensity = np.abs(np.fft.fftshift(np.fft.fft2(probe * obj), axes=(1, 2))) ** 2
    intensity /= intensity.sum(axis=(1, 2), keepdims=True)
    expected = np.log1p(intensity * 1e6) / np.log1p(1e6)
    np.testing.assert_allclose(d["diffraction"][:, 0], expected, rtol=1e-4, atol=1e-5)


def test_ptycho_cli(tmp_path, capsys):
    from lightning_sdp.datamodules.solar.ptycho import main

    out = tmp_path / "cli.h5"
    assert main(["--out", str(out), "--num-samples", "8", "--size", "16", "--seed", "1"]) == 0
    assert "8 samples" in capsys.readouterr().out
    with h5py.File(out, "r") as f:
        assert f["diffraction"].shape == (8, 1, 16, 16)
    # an existing file is refused with a message, not a traceback
    assert main(["--out", str(out), "--num-samples", "8"]) == 2
    assert "exists" in capsys.readouterr().err


def test_ptycho_write_leaves_only_the_file_with_the_usual_mode(tmp_path):
    path = make_ptycho_h5(tmp_path / "sub" / "p.h5", num_samples=20, size=8, block=8)
    assert [p.name for p in path.parent.iterdir()] == ["p.h5"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600
    first_block = simulate_ptycho(8, 8, seed=int(np.random.SeedSequence(0).spawn(3)[0].generate_state(1)[0]))
    with h5py.File(path, "r") as f:
        assert f["phase"].shape == (20, 1, 8, 8)
        assert np.array_equal(f["phase"][:8], first_block["phase"])


def test_a_failed_ptycho_write_leaves_no_temporary_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    from lightning_sdp.datamodules.solar import ptycho

    blocks = []

    def fail_on_second_block(*args, **kwargs):
        blocks.append(args)
        if len(blocks) == 2:
            raise MemoryError("injected")
        return simulate_ptycho(*args, **kwargs)

    monkeypatch.setattr(ptycho, "simulate_ptycho", fail_on_second_block)
    with pytest.raises(MemoryError, match="injected"):
        make_ptycho_h5(tmp_path / "new.h5", num_samples=20, size=8, block=8)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    old = make_ptycho_h5(tmp_path / "old.h5", num_samples=4, size=8)
    before = old.read_bytes()
    blocks.clear()
    monkeypatch.setattr(ptycho, "simulate_ptycho", fail_on_second_block)
    with pytest.raises(MemoryError):
        make_ptycho_h5(old, num_samples=20, size=8, block=8, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["old.h5"] and old.read_bytes() == before


@pytest.mark.parametrize("max_gap,piece_rows", [(0, None), (2, None), (3, 1), (6, 4)])
def test_threaded_direct_reads_match_hyperslab_reference(tmp_path, monkeypatch, max_gap, piece_rows):
    path = make_ptycho_h5(tmp_path / "p.h5", num_samples=50, size=8, seed=2)
    if piece_rows is not None:  # runs with gaps read in pieces of a few rows (one row of a dataset: 8 x 8 x 4 bytes)
        monkeypatch.setattr(reader_module, "GAP_PIECE_BYTES", piece_rows * 8 * 8 * 4)
    keys = ["diffraction", "amplitude", "phase"]
    fast = HDF5Reader(path, keys, max_gap=max_gap, io_threads=4)
    ref = HDF5Reader(path, keys, max_gap=max_gap, readahead=True)  # h5py hyperslab reads
    assert fast.direct_layout() is not None
    rng = np.random.default_rng(max_gap)
    for size in (1, 7, 40):
        ids = rng.integers(0, 50, size=size)
        a, b = fast.read(ids), ref.read(ids)
        for k in keys:
            assert np.array_equal(a[k], b[k])
    assert fast.bytes_read == ref.bytes_read and fast.requests == ref.requests
    with pytest.raises(IndexError):
        fast.read([50])


def test_threaded_reader_falls_back_on_chunked_data(h5file):
    reader = HDF5Reader(h5file, ["x", "chunked"], io_threads=3)
    assert reader.direct_layout() is None
    ids = [4, 2, 2, 90]
    assert np.array_equal(reader.read(ids)["chunked"], HDF5Reader(h5file, ["chunked"]).read(ids)["chunked"])


def test_large_arrays_of_read_rows_get_their_own_memory_map():
    import mmap

    big = reader_module.mapped_empty((64, 1, 32, 32), np.dtype("float32"))  # 256 KiB
    small = reader_module.mapped_empty((2, 1, 32, 32), np.dtype("float32"))
    assert big.shape == (64, 1, 32, 32) and big.dtype == np.float32 and big.flags.writeable

    def owner(array):
        while isinstance(array, np.ndarray):
            array = array.base
        return array.obj if isinstance(array, memoryview) else array

    assert isinstance(owner(big), mmap.mmap) and len(owner(big)) == big.nbytes
    assert owner(small) is None and small.shape == (2, 1, 32, 32)
    big[:] = 3.0
    assert float(big.sum()) == 3.0 * big.size
