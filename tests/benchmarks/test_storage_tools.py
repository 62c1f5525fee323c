"""The storage doubles of the SOLAR benchmarks: the per-sample HDF5 baseline and the emulated slow device."""

from __future__ import annotations

import pickle
import time

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from benchmarks.tools.storage import PerSampleHDF5Dataset, StorageThrottle, ThrottledFile, ThrottledReader
from lightning_sdp.datamodules.solar import SolarDataModule, make_ptycho_h5
from lightning_sdp.datamodules.solar.reader import HDF5Reader

KEYS = ["diffraction", "amplitude", "phase"]


@pytest.fixture(scope="module")
def ptycho(tmp_path_factory):
    return make_ptycho_h5(tmp_path_factory.mktemp("baseline") / "p.h5", num_samples=24, size=8, seed=0)


def test_items_are_file_rows_and_batches_match_solar_dict_batches(ptycho):
    dataset = PerSampleHDF5Dataset(ptycho, KEYS[0], KEYS[1:])
    assert len(dataset) == 24
    with h5py.File(ptycho, "r") as f:
        x, amp, ph = f["diffraction"][:], f["amplitude"][:], f["phase"][:]
    xi, yi = dataset[5]
    assert torch.equal(xi, torch.from_numpy(x[5]))
    assert torch.equal(yi, torch.from_numpy(np.concatenate([amp[5], ph[5]], axis=0)))
    dm = SolarDataModule(str(ptycho), KEYS[0], KEYS[1:], batch_size=4, log_metrics=False, batch_format="dict")
    dm.setup("fit")
    solar = next(iter(dm.train_dataloader()))
    ids = solar["index"].tolist()
    xb, yb = next(iter(DataLoader(dataset, batch_size=4, sampler=ids)))
    assert torch.equal(xb, solar["input"]) and torch.equal(yb, solar["target"])  # same tensors to the model
    single = PerSampleHDF5Dataset(ptycho, KEYS[0], ["phase"])
    assert torch.equal(single[3][1], torch.from_numpy(ph[3]))  # one target keeps its own shape


def test_open_handle_is_not_pickled_so_workers_open_their_own(ptycho):
    dataset = PerSampleHDF5Dataset(ptycho, KEYS[0], KEYS[1:])
    dataset[0]  # opens the file in this process
    assert dataset._file is not None
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone._file is None and torch.equal(clone[7][0], dataset[7][0])
    with_workers = [x for x, _ in DataLoader(dataset, batch_size=8, num_workers=1)]
    assert torch.equal(torch.cat(with_workers), torch.stack([dataset[i][0] for i in range(24)]))


def test_throttle_costs_every_read_request(ptycho, monkeypatch):
    requests = []

    def cost(self, nbytes):
        requests.append(nbytes)
        return 0.0

    monkeypatch.setattr(StorageThrottle, "cost", cost)
    dataset = PerSampleHDF5Dataset(ptycho, KEYS[0], KEYS[1:], throttle=StorageThrottle())
    dataset[2]
    assert requests, "reads go through the throttled file"
    before = len(requests)
    dataset[3]
    assert len(requests) > before
    assert not PerSampleHDF5Dataset(ptycho, KEYS[0], KEYS[1:]).throttle  # plain file by default


def test_throttled_reader_costs_every_request_and_reads_the_same_rows(ptycho):
    throttle = StorageThrottle(latency_s=0.005)
    plain = HDF5Reader(ptycho, KEYS)
    ids = np.arange(3, 20)
    for io_threads in (1, 4):  # h5py hyperslab reads, and positional reads through the same file object
        reader = ThrottledReader(ptycho, KEYS, throttle=throttle, io_threads=io_threads, max_gap=2)
        start = time.perf_counter()
        rows = reader.read(ids)
        for key in KEYS:
            assert np.array_equal(rows[key], plain.read(ids)[key])
        fileobj = reader.fileobj
        assert isinstance(fileobj, ThrottledFile)
        assert fileobj.requests >= 1 and fileobj.bytes_read >= rows[KEYS[0]].nbytes
        assert time.perf_counter() - start >= 0.005 * fileobj.requests * 0.9
        clone = pickle.loads(pickle.dumps(reader))
        assert clone.fileobj is None and np.array_equal(clone.read(ids)[KEYS[1]], rows[KEYS[1]])
        reader.close()
    assert StorageThrottle(0.001, 1e6).cost(10**6) == pytest.approx(1.001)


def test_missing_dataset_is_named(ptycho):
    with pytest.raises(KeyError, match=r"no dataset \['labels'\].*amplitude"):
        PerSampleHDF5Dataset(ptycho, KEYS[0], ["labels"])
    with pytest.raises(ValueError, match="target_keys"):
        PerSampleHDF5Dataset(ptycho, KEYS[0], [])


def test_the_library_and_its_demo_import_nothing_from_the_benchmarks():
    import ast
    from pathlib import Path

    import lightning_sdp

    package = Path(lightning_sdp.__file__).parent
    bad = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{path.relative_to(package)}: {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not bad, "library code must not import the benchmarks:\n" + "\n".join(bad)
