"""SolarDataModule as a drop-in: ``(input, target)`` batches by default, dict and tuple batches, per-dataset sample
shapes, test / predict loaders, hints."""

import logging

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer

from lightning_sdp.datamodules.solar import SolarDataModule, make_ptycho_h5
from lightning_sdp.datamodules.solar.datamodule import _add_note_py310


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def labels(tmp_path_factory):
    """40 samples: ``x`` (40, 4) float32 features, ``y`` (40,) int64 class labels."""
    path = tmp_path_factory.mktemp("solar_labels") / "labels.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["x"] = rng.standard_normal((40, 4)).astype(np.float32)
        f["y"] = rng.integers(0, 3, size=40).astype(np.int64)
    return path


@pytest.fixture(scope="module")
def ptycho(tmp_path_factory):
    return make_ptycho_h5(tmp_path_factory.mktemp("solar_b") / "train.h5", num_samples=32, size=8, seed=0)


class Classifier(LightningModule):
    """A plain hand-written module: ``x, y = batch`` with tuple batches, ``batch["..."]`` with dicts."""

    def __init__(self, unpack: bool) -> None:
        super().__init__()
        self.unpack = unpack
        self.layer = torch.nn.Linear(4, 3)
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.seen: list[int] = []

    def _xy(self, batch):
        if self.unpack:
            x, y = batch
        else:
            x, y = batch["input"], batch["target"]
        self.shapes.append((tuple(x.shape), tuple(y.shape)))
        return x, y

    def training_step(self, batch, batch_idx):
        x, y = self._xy(batch)
        return F.cross_entropy(self.layer(x), y)

    def test_step(self, batch, batch_idx):
        x, y = self._xy(batch)
        if not self.unpack:
            self.seen += batch["index"].tolist()
        self.log("test/loss", F.cross_entropy(self.layer(x), y))

    def predict_step(self, batch, batch_idx):
        x, _ = self._xy(batch)
        return self.layer(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(**kw) -> Trainer:
    args = dict(
        accelerator="cpu",
        devices=1,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        max_epochs=1,
    )
    args.update(kw)
    return Trainer(**args)


def test_one_dimensional_labels_keep_their_shape(labels):
    dm = SolarDataModule(str(labels), batch_size=8, max_epochs=1, val_split=0.25, batch_format="dict")
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["target"].shape == (8,) and batch["target"].dtype == torch.int64
    assert next(iter(dm.val_dataloader()))["target"].shape == (8,)
    model = Classifier(unpack=False)
    _trainer().fit(model, dm)  # cross_entropy needs (B,) class indices
    assert model.shapes and all(y == (x[0],) for x, y in model.shapes)
    # the default pairs hold the same tensors
    pair = SolarDataModule(str(labels), batch_size=8, max_epochs=1, val_split=0.25)
    pair.setup("fit")
    x, y = next(iter(pair.train_dataloader()))
    assert torch.equal(x, batch["input"]) and torch.equal(y, batch["target"])
    x, y = next(iter(pair.val_dataloader()))
    assert x.shape == (8, 4) and y.shape == (8,)


def test_tuple_batches_unpack_in_key_order(labels, ptycho):
    model = Classifier(unpack=True)
    _trainer().fit(model, SolarDataModule(str(labels), batch_size=8, batch_format="tuple"))
    assert model.shapes == [((8, 4), (8,))] * 5
    # several targets: one tensor per dataset, in the configured order, same samples as the dict batches
    kw = dict(input_key="diffraction", target_key=["phase", "amplitude"], batch_size=8, max_epochs=1)
    dm_dict = SolarDataModule(str(ptycho), batch_format="dict", **kw)
    dm_tuple = SolarDataModule(str(ptycho), batch_format="tuple", **kw)
    dm_dict.setup("fit")
    dm_tuple.setup("fit")
    with h5py.File(ptycho, "r") as f:
        phase = f["phase"][:]
    for d, t in zip(dm_dict.train_dataloader(), dm_tuple.train_dataloader(), strict=True):
        assert isinstance(t, tuple) and len(t) == 3
        assert torch.equal(t[0], d["input"]) and torch.equal(t[1], torch.from_numpy(phase[d["index"].numpy()]))
        assert torch.equal(torch.cat([t[1], t[2]], dim=1), d["target"])


def test_unpacking_a_dict_batch_gets_a_hint(labels):
    with pytest.raises(ValueError, match="values to unpack") as err:
        _trainer().fit(Classifier(unpack=True), SolarDataModule(str(labels), batch_size=8, batch_format="dict"))
    assert any("batch_format at its default 'pair'" in note for note in getattr(err.value, "__notes__", []))


def test_reading_a_pair_batch_by_name_gets_a_hint(labels):
    with pytest.raises(TypeError, match="indices must be integers") as err:
        _trainer().fit(Classifier(unpack=False), SolarDataModule(str(labels), batch_size=8))
    notes = getattr(err.value, "__notes__", [])
    assert any("batch_format='pair'" in n and "batch_format='dict' gives" in n for n in notes), notes


def test_hint_fallback_for_python_310_keeps_the_note_and_logs_it(caplog):
    # Python 3.10 has no BaseException.add_note: the fallback must still record the hint and show it.
    err = KeyError(0)
    with caplog.at_level(logging.ERROR, logger="lightning_sdp.datamodules.solar.datamodule"):
        _add_note_py310(err, "first")
        _add_note_py310(err, "Hint: use batch['input']")
    assert err.__notes__ == ["first", "Hint: use batch['input']"]
    assert "KeyError: Hint: use batch['input']" in caplog.text


def test_test_and_predict_use_the_test_split_else_the_validation_split(labels, tmp_path):
    dm = SolarDataModule(str(labels), batch_size=8, val_split=0.25, batch_format="dict")  # 30 train, 10 validation
    model = Classifier(unpack=False)
    _trainer().test(model, dm)
    assert sorted(model.seen) == list(range(30, 40))
    tuple_dm = SolarDataModule(str(labels), batch_size=8, val_split=0.25, batch_format="tuple")
    preds = _trainer().predict(Classifier(unpack=True), tuple_dm)
    assert sum(len(p) for p in preds) == 10
    dm = SolarDataModule(str(labels), batch_size=8, val_split=0.25, test_split=0.25, batch_format="dict")  # 20/10/10
    model = Classifier(unpack=False)
    _trainer().test(model, dm)
    assert dm.num_train == 20 and sorted(model.seen) == list(range(30, 40))
    assert np.array_equal(dm._val_ids, np.arange(20, 30))
    other = tmp_path / "test.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.zeros((6, 4), np.float32)
        f["y"] = np.zeros(6, np.int64)
    model = Classifier(unpack=False)
    _trainer().test(model, SolarDataModule(str(labels), batch_size=4, test_path=str(other), batch_format="dict"))
    assert sorted(model.seen) == list(range(6))
    with pytest.raises(ValueError, match="test_split="):
        _trainer().test(Classifier(unpack=False), SolarDataModule(str(labels), batch_size=8))


def test_bad_batch_format_and_splits(labels):
    with pytest.raises(ValueError, match=r"batch_format must be one of 'pair', 'dict', 'tuple', got 'list'"):
        SolarDataModule(str(labels), batch_format="list")
    with pytest.raises(ValueError, match="val_split \\+ test_split"):
        SolarDataModule(str(labels), val_split=0.5, test_split=0.5)


def test_tuple_batches_under_ddp_with_balancing_warn(labels):
    dm = SolarDataModule(str(labels), batch_size=4, max_epochs=1, batch_format="tuple")
    dm.world_size = 2
    with pytest.warns(UserWarning, match="balance=False"):
        dm.setup("fit")
    dm = SolarDataModule(str(labels), batch_size=4, max_epochs=1, batch_format="tuple", balance=False)
    dm.world_size = 2
    dm.setup("fit")
    sizes = {len(sp.ranks[0].indices) - len(sp.ranks[1].indices) for sp in dm.schedule.epoch_plan(0)}
    assert sizes == {0}
