"""The per-sample HDF5 baseline dataset that the demo and the SOLAR benchmarks compare SOLAR with."""

from __future__ import annotations

import pickle

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_sdp.datamodules.solar import PerSampleHDF5Dataset, SolarDataModule, StorageThrottle, make_ptycho_h5

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


def test_a_private_hook_throttles_the_datamodules_reads(ptycho, monkeypatch):
    requests = []

    def cost(self, nbytes):
        requests.append(nbytes)
        return 0.0

    monkeypatch.setattr(StorageThrottle, "cost", cost)

    def epoch(throttle):
        dm = SolarDataModule(
            str(ptycho),
            KEYS[0],
            KEYS[1:],
            batch_size=4,
            buffer_size=6,
            max_epochs=1,
            val_split=0.25,
            batch_format="dict",
        )
        if throttle is not None:
            dm._storage_throttle = throttle
        dm.setup("fit")
        loader = dm.train_dataloader()
        assert sum(len(b["index"]) for b in loader) == 18
        return dm, loader

    epoch(None)
    assert requests == [], "plain files unless an experiment sets the hook"
    dm, loader = epoch(StorageThrottle(latency_s=1e-3))
    # every planned read is costed (plus h5py's metadata reads when it opens the file)
    assert len(requests) >= loader.reader.requests > 0
    before = len(requests)
    next(iter(dm.val_dataloader()))
    assert len(requests) > before, "validation reads too"


def test_missing_dataset_is_named(ptycho):
    with pytest.raises(KeyError, match=r"no dataset \['labels'\].*amplitude"):
        PerSampleHDF5Dataset(ptycho, KEYS[0], ["labels"])
    with pytest.raises(ValueError, match="target_keys"):
        PerSampleHDF5Dataset(ptycho, KEYS[0], [])
