import gc
import os
import shutil
import time
import weakref
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sdp.callbacks import SolarMetrics
from lightning_sdp.datamodules.solar import SolarDataModule, SolarReadOptions, make_ptycho_h5
from lightning_sdp.datamodules.solar.loader import EpochStats, SolarLoader, StepStats
from lightning_sdp.datamodules.solar.reader import FileChangedError, data_fingerprint
from lightning_sdp.datamodules.solar.readplan import working_samples
from lightning_sdp.models.ptychonn import PtychoNN
from tests.datamodules._solar import solar_datamodule

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "solar_ptycho.yaml"


@pytest.fixture(autouse=True)
def _one_thread():
    # two intra-op threads on a shared 2-core machine make a tiny CNN ~100x slower (spinning OpenMP threads)
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ptycho(tmp_path_factory):
    return make_ptycho_h5(tmp_path_factory.mktemp("solar") / "train.h5", num_samples=96, size=16, seed=0)


def _dm(path, **kw):
    # dict batches: the tests read the sample ids and the loss scale
    args = dict(
        input_key="diffraction", target_key=["amplitude", "phase"], batch_size=8, buffer_size=24, batch_format="dict"
    )
    args.update(kw)
    return solar_datamodule(path, **args)


def _model(**kw):
    return PtychoNN(image_size=16, base_channels=4, depth=2, **kw)


def _trainer(tmp_path=None, **kw):
    args = dict(
        accelerator="cpu",
        devices=1,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    args.update(kw)
    return Trainer(**args)


class Recorder(Callback):
    def __init__(self):
        self.indices, self.scales, self.hits = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.indices.append(batch["index"].tolist())
        self.scales.append(float(batch["loss_scale"]))


def test_standalone_loader_serves_file_rows_every_sample_once(ptycho):
    dm = _dm(ptycho, max_epochs=2)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader, SolarLoader) and len(loader) == 12
    with h5py.File(ptycho, "r") as f:
        x, amp, ph = f["diffraction"][:], f["amplitude"][:], f["phase"][:]
    hits = []
    for epoch in range(2):
        seen = []
        for sp, batch in zip(dm.schedule.epoch_plan(epoch), loader, strict=True):
            ids = batch["index"].numpy()
            assert np.array_equal(ids, sp.ranks[0].indices)
            assert torch.equal(batch["input"], torch.from_numpy(x[ids]))
            assert torch.equal(batch["target"], torch.from_numpy(np.concatenate([amp[ids], ph[ids]], axis=1)))
            assert float(batch["loss_scale"]) == pytest.approx(1 / len(ids))
            seen += ids.tolist()
            hits.append(loader.last_stats.hits)
        assert sorted(seen) == list(range(96))
        if epoch == 0:
            assert sum(hits) == 0
    buffer = dm.schedule.buffer_size  # the buffer's share of buffer_size=24; the read-ahead holds the rest
    assert 0 < buffer < 24 and buffer + dm.read_plan.read_ahead_samples == 24
    assert sum(hits) == buffer  # C/N of the second epoch, served from the store
    assert len(loader.store) == buffer


def test_worker_processes_give_identical_batches(ptycho):
    out = []
    for workers in (0, 2):
        dm = _dm(ptycho, num_workers=workers, max_epochs=2)
        dm.setup("fit")
        loader = dm.train_dataloader()
        out.append([b for _ in range(2) for b in loader])
        loader.close()
    assert len(out[0]) == len(out[1]) == 24
    for a, b in zip(*out, strict=True):
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["input"], b["input"])
        assert torch.equal(a["target"], b["target"])


def test_fit_follows_schedule_and_logs_metrics(ptycho):
    rec = Recorder()
    dm = _dm(ptycho, val_split=0.25, read_window=1, max_gap=0)  # exact reads: storage bytes = the plan's misses
    trainer = _trainer(max_epochs=2, callbacks=[rec, SolarMetrics()], log_every_n_steps=1)
    trainer.fit(_model(), dm)
    plans = dm.schedule.epoch_plan(0) + dm.schedule.epoch_plan(1)
    assert rec.indices == [sp.ranks[0].indices.tolist() for sp in plans]
    assert dm.num_train == 72 and sorted(sum(rec.indices[:9], [])) == list(range(72))
    m = trainer.callback_metrics
    for key in (
        "solar/hit_rate",
        "solar/storage_bytes",
        "solar/samples_per_s",
        "solar/load_time_s",
        "val/loss",
    ):
        assert key in m
    buffer = dm.schedule.buffer_size
    assert float(m["solar/epoch_hit_rate"]) == pytest.approx(buffer / 72)  # C/N in the second epoch
    sample_bytes = 3 * 16 * 16 * 4
    assert float(m["solar/epoch_storage_bytes"]) == (72 - buffer) * sample_bytes
    assert float(m["solar/epoch_samples_per_s"]) > 0 and float(m["solar/epoch_load_time_s"]) > 0


def test_loader_stats_are_typed_and_serialise_with_the_dict_keys(ptycho):
    dm = _dm(ptycho, max_epochs=2, read_window=1, max_gap=0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert loader.last_stats is None and loader.epoch_stats == EpochStats()
    for epoch in range(2):
        loader.set_epoch(epoch)
        for _ in loader:
            pass
    step, epoch_stats = loader.last_stats, loader.epoch_stats
    assert isinstance(step, StepStats) and isinstance(epoch_stats, EpochStats)
    buffer = dm.schedule.buffer_size
    assert epoch_stats.steps == 12 and epoch_stats.samples == 96 and epoch_stats.hits == buffer > 0
    assert epoch_stats.reads == 96 - buffer and epoch_stats.storage_bytes == (96 - buffer) * 3 * 16 * 16 * 4
    assert epoch_stats.hit_rate == pytest.approx(buffer / 96)
    assert epoch_stats.samples_per_s == pytest.approx(96 / epoch_stats.wall_s)
    step_keys = "samples hits hit_rate reads bytes wait_s read_s samples_per_s"
    assert list(step.to_dict()) == step_keys.split()
    assert step.to_dict()["hit_rate"] == step.hits / step.samples
    as_dict = epoch_stats.to_dict()
    assert list(as_dict) == ["samples", "hits", "reads", "bytes", "wait_s", "read_s", "steps", "wall_s"]
    assert as_dict["bytes"] == float(epoch_stats.storage_bytes) and as_dict["steps"] == 12.0


@pytest.mark.parametrize(
    ("with_callback", "log_metrics", "warns"), [(False, True, True), (False, False, False), (True, True, False)]
)
def test_warns_when_no_solar_metrics_callback_logs_the_counters(ptycho, with_callback, log_metrics, warns):
    import warnings

    trainer = _trainer(max_epochs=1, callbacks=[SolarMetrics()] if with_callback else [])
    dm = _dm(ptycho, log_metrics=log_metrics)
    dm.trainer = trainer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup("fit")
    named = [w for w in caught if "SolarMetrics" in str(w.message)]
    assert bool(named) == warns
    if warns:
        assert "lightning_sdp.callbacks.SolarMetrics()" in str(named[0].message)
        assert "log_metrics=False" in str(named[0].message)


class LitAutoEncoder(LightningModule):
    """Lightning's README module, as a user has it: ``x, y = batch``, a mean loss, nothing SOLAR-specific."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(16 * 16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        self.decoder = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 16 * 16))
        self.seen = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x.view(x.size(0), -1)
        loss = torch.nn.functional.mse_loss(self.decoder(self.encoder(x)), x)
        self.seen += len(x)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_plain_module_trains_with_default_batches_and_no_trainer_flags(ptycho, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default Trainer writes lightning_logs/ and checkpoints into the working directory
    model = LitAutoEncoder()
    data = SolarDataModule(str(ptycho), input_key="diffraction", target_key=["amplitude", "phase"], buffer_size="1MB")
    trainer = Trainer(max_epochs=1)
    trainer.fit(model, data)
    assert model.seen == 96  # every sample once
    assert trainer.state.finished and "train_loss" in trainer.callback_metrics


def test_evaluation_loaders_keep_lightnings_distributed_sampler_out(ptycho):
    from lightning.pytorch.trainer.states import RunningStage

    # a distributed Trainer with use_distributed_sampler=True (the default), built but not launched
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    assert trainer._accelerator_connector.is_distributed and trainer._accelerator_connector.use_distributed_sampler
    dm = _dm(ptycho, val_split=0.25)
    dm.setup("fit")
    val = dm.val_dataloader()
    prepared = trainer._data_connector._prepare_dataloader(val, shuffle=False, mode=RunningStage.VALIDATING)
    assert prepared is val, "Lightning would split the rank's share again"
    assert [b["index"].tolist() for b in val] == np.arange(72, 96).reshape(3, 8).tolist()


def _rewrite_in_place(path, seed):
    before = os.stat(path)
    time.sleep(0.02)  # beyond the file system's timestamp granularity
    other = make_ptycho_h5(path.with_name(f"new{seed}.h5"), num_samples=96, size=16, seed=seed)
    shutil.copyfile(other, path)  # opens the existing file for writing: same inode, new bytes
    after = os.stat(path)
    assert after.st_ino == before.st_ino and after.st_size == before.st_size, "rewritten in place, same length"
    assert after.st_mtime_ns != before.st_mtime_ns


@pytest.mark.parametrize("workers", [0, 1])
def test_file_rewritten_between_epochs_is_refused(tmp_path, workers):
    path = make_ptycho_h5(tmp_path / "train.h5", num_samples=96, size=16, seed=0)
    dm = _dm(path, max_epochs=2, num_workers=workers)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert sum(len(b["index"]) for b in loader) == 96
    _rewrite_in_place(path, seed=1)
    with pytest.raises(FileChangedError, match=r"changed while training read it \(modified .* after it was opened"):
        next(iter(loader))
    loader.close()


def test_file_replaced_or_changed_mid_epoch_is_refused_by_the_reader(tmp_path):
    path = make_ptycho_h5(tmp_path / "train.h5", num_samples=96, size=16, seed=0)
    dm = _dm(path, max_epochs=1, read_window=1, val_split=0.25)
    dm.setup("fit")
    batches = iter(dm.train_dataloader())
    next(batches)
    other = make_ptycho_h5(tmp_path / "other.h5", num_samples=96, size=16, seed=1)
    os.replace(other, path)  # a new file under the same name: the inode differs
    with pytest.raises(FileChangedError, match="replaced by another file"):
        next(batches)
    with pytest.raises(FileChangedError, match="Do not rewrite a file that a run is reading"):
        next(iter(dm.val_dataloader()))


def test_checkpoint_of_another_file_of_the_same_length_is_refused_a_copy_resumes(ptycho, tmp_path):
    trainer, _, _ = _run(ptycho, max_steps=3)
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    data = torch.load(ckpt, weights_only=False)["SolarDataModule"]["data"]
    assert data["num_samples"] == 96 and data["path"] == str(ptycho) and len(data["rows_sha256"]) == 64
    other = make_ptycho_h5(tmp_path / "other.h5", num_samples=96, size=16, seed=5)  # same length, shapes, dtypes
    with pytest.raises(
        ValueError, match=r"other data than .*other\.h5.*rows_sha256: checkpoint .*load_from_checkpoint"
    ):
        _run(other, ckpt_path=str(ckpt))
    copy = tmp_path / "copy.h5"
    shutil.copyfile(ptycho, copy)  # a new inode and modification time, the same samples
    _, _, rest = _run(copy, ckpt_path=str(ckpt))
    assert len(rest.indices) == 12  # saved after fit returned: an end-of-epoch checkpoint, so epoch 1 follows


def test_checkpoint_without_a_data_fingerprint_resumes_with_a_warning(ptycho):
    dm = _dm(ptycho, max_epochs=2)
    dm.setup("fit")
    state = dm.state_dict()
    del state["data"]
    with pytest.warns(UserWarning, match="no fingerprint of its training data"):
        dm.load_state_dict(state)


def test_fingerprint_reads_the_first_and_last_lines_of_large_rows(tmp_path):
    path = tmp_path / "big.h5"
    x = np.zeros((4, 3, 100, 100), np.float32)
    with h5py.File(path, "w") as f:
        f["x"] = x
    before = data_fingerprint(path, ["x"])
    x[3, 2, 99, 99] = 1.0  # the last element of the last row
    with h5py.File(path, "w") as f:
        f["x"] = x
    after = data_fingerprint(path, ["x"])
    assert before["shapes"] == after["shapes"] == {"x": [3, 100, 100]}
    assert before["rows_sha256"] != after["rows_sha256"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_workers": -1}, r"num_workers must be an integer >= 0, got -1"),
        ({"val_batch_size": 0}, r"val_batch_size must be an integer >= 1"),
        ({"max_epochs": 0}, r"max_epochs must be an integer >= 1"),
        ({"max_local_batch": 4}, r"max_local_batch must be an integer >= 32 \(None allows 2 \* batch_size\)"),
        (
            {"eviction": "beladi"},
            r"eviction must be one of 'belady', 'lru', .*'artifact_fifo', got 'beladi' \(did you mean 'belady'\?\)",
        ),
        ({"epoch_order": "TSP"}, r"epoch_order must be one of 'identity', 'tsp', got 'TSP'"),
        (
            {"validate": "warning"},
            r"validate must be one of 'warn', 'raise', 'off', got 'warning' \(did you mean 'warn'\?\)",
        ),
        ({"batch_format": "tuples"}, r"batch_format must be one of 'pair', 'dict', 'tuple', got 'tuples'"),
        ({"buffer_size": "8 gigs"}, r"cannot parse buffer_size '8 gigs'"),
    ],
)
def test_bad_options_are_refused_in_init_with_the_allowed_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SolarDataModule("never_opened.h5", **kwargs)  # before any file is touched


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": "32"}, r"SolarDataModule: batch_size must be an int, got '32' \(str\)"),
        ({"num_workers": 1.0}, r"num_workers must be an int, got 1.0 \(float\)"),
        ({"seed": True}, r"seed must be an int, got True \(bool\)"),
        ({"eviction": 3}, r"eviction must be one of 'belady', .*, got 3 \(int\)"),
    ],
)
def test_options_of_the_wrong_type_raise_type_error_naming_the_option(kwargs, match):
    with pytest.raises(TypeError, match=match):
        SolarDataModule("never_opened.h5", **kwargs)


def test_directory_paths_say_an_hdf5_file_is_expected(ptycho, tmp_path):
    with pytest.raises(
        IsADirectoryError, match=r"training file .* is a directory; it holds no .h5/.hdf5 file.*HDF5 file"
    ):
        _dm(tmp_path).setup("fit")
    with pytest.raises(IsADirectoryError, match=r"validation file .* is a directory; it holds train\.h5"):
        _dm(ptycho, val_path=str(ptycho.parent)).setup("fit")


def test_validation_file_of_another_dtype_is_refused_at_setup(ptycho, tmp_path):
    val = tmp_path / "val64.h5"
    with h5py.File(ptycho, "r") as src, h5py.File(val, "w") as f:
        f["diffraction"] = src["diffraction"][:16].astype(np.float64)
        f["amplitude"], f["phase"] = src["amplitude"][:16], src["phase"][:16]
    with pytest.raises(ValueError, match=r"sample shapes or dtypes .*diffraction: float64 \(1, 16, 16\) vs float32"):
        _dm(ptycho, val_path=str(val)).setup("fit")
    with pytest.raises(ValueError, match=r"test file .* does not match the training file"):
        _dm(ptycho, test_path=str(val)).setup("test")


def test_targets_that_cannot_be_joined_need_tuple_batches(tmp_path):
    path = tmp_path / "mixed.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((16, 4), np.float32)
        f["label"] = np.zeros(16, np.int64)
        f["box"] = np.zeros((16, 4), np.float32)
    for fmt in ("pair", "dict"):
        with pytest.raises(
            ValueError,
            match=r"joins the targets .*\(per sample: label int64 \(\), box float32 \(4,\)\).*batch_format='tuple'",
        ):
            SolarDataModule(str(path), target_key=["label", "box"], batch_format=fmt, batch_size=4).setup("fit")
    dm = SolarDataModule(str(path), target_key=["label", "box"], batch_format="tuple", batch_size=4, max_epochs=1)
    dm.setup("fit")
    x, label, box = next(iter(dm.train_dataloader()))
    assert label.dtype == torch.int64 and box.shape == (4, 4)


def _run(path, max_steps=-1, ckpt_path=None, callbacks=(), **dm_kw):
    seed_everything(7)
    rec = Recorder()
    model = _model()
    trainer = _trainer(
        max_epochs=2,
        max_steps=max_steps,
        callbacks=[rec, *callbacks],
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )
    trainer.fit(model, _dm(path, **dm_kw), ckpt_path=ckpt_path)
    return trainer, model, rec


def test_mid_epoch_resume_is_bit_exact(ptycho, tmp_path):
    # an uninterrupted run that checkpoints at global step 17 (step 5 of epoch 1), as a crashed job would have
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=17, save_top_k=-1, filename="{step}")
    _, full_model, full = _run(ptycho, callbacks=[saver])
    ckpt = tmp_path / "step=17.ckpt"
    state = torch.load(ckpt, weights_only=False)["SolarDataModule"]
    assert state["position"]["epoch"] == 1 and state["position"]["step"] == 5
    _, resumed_model, rest = _run(ptycho, ckpt_path=str(ckpt))
    assert len(full.indices) == 24
    assert rest.indices == full.indices[17:]  # the identical remaining sequence
    assert rest.scales == full.scales[17:]
    for a, b in zip(full_model.state_dict().values(), resumed_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_checkpoint_from_other_configuration_is_refused(ptycho, tmp_path):
    trainer, _, _ = _run(ptycho, max_steps=3)
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    with pytest.raises(ValueError, match=r"seed: checkpoint 0 vs now 1"):
        _run(ptycho, ckpt_path=str(ckpt), seed=1)
    with pytest.raises(ValueError, match=r"buffer_size: checkpoint 24 vs now 12"):
        _run(ptycho, ckpt_path=str(ckpt), buffer_size=12)


def test_a_budget_in_bytes_holds_the_loaders_working_memory_and_says_when_it_cannot(ptycho):
    sample = 3 * 16 * 16 * 4
    dm = _dm(ptycho, buffer_size="5MiB")
    dm.setup("fit")
    plan = dm.read_plan
    assert plan.working_samples == working_samples(8, plan.max_gap, sample, dm.reads.io_threads)
    assert plan.buffer_samples + plan.read_ahead_samples + plan.working_samples == 5 * 2**20 // sample
    assert plan.buffer_samples > 0
    counted = _dm(ptycho, buffer_size=5 * 2**20 // sample)  # the same size in samples: buffer and read-ahead only
    counted.setup("fit")
    assert counted.read_plan.working_samples == 0
    assert counted.read_plan.buffer_samples + counted.read_plan.read_ahead_samples == 5 * 2**20 // sample
    assert counted.read_plan.buffer_samples > plan.buffer_samples
    with pytest.warns(UserWarning, match=r"less than the loaders' working memory.*Give buffer_size >= '5MiB'"):
        _dm(ptycho, buffer_size="1MiB").setup("fit")


@pytest.mark.parametrize("buffer,expected", [(0, 0.0), (500, 1.0), ("16MB", 1.0)])
def test_buffer_zero_or_larger_than_data(ptycho, buffer, expected):
    dm = _dm(ptycho, buffer_size=buffer, max_epochs=2)
    dm.setup("fit")
    loader = dm.train_dataloader()
    for _ in loader:
        pass
    hits = sum(1 for _ in loader for _ in [0] if loader.last_stats.hits > 0)
    assert loader.epoch_stats.hits == expected * 96
    assert hits == (12 if expected else 0)


def test_bad_inputs(ptycho, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist.*ptycho-generate --out .*missing\.h5.*make_ptycho_h5"):
        _dm(tmp_path / "missing.h5").setup("fit")
    with pytest.raises(ValueError, match="no dataset 'x'"):
        _dm(ptycho, input_key="x").setup("fit")
    with h5py.File(tmp_path / "uneven.h5", "w") as f:
        f["diffraction"] = np.zeros((10, 1, 16, 16), np.float32)
        f["amplitude"] = np.zeros((9, 1, 16, 16), np.float32)
        f["phase"] = np.zeros((10, 1, 16, 16), np.float32)
    with pytest.raises(ValueError, match="different lengths"):
        _dm(tmp_path / "uneven.h5").setup("fit")
    (tmp_path / "corrupt.h5").write_bytes(b"not an hdf5 file" * 64)
    with pytest.raises(ValueError, match="corrupt"):
        _dm(tmp_path / "corrupt.h5").setup("fit")
    other = make_ptycho_h5(tmp_path / "val8.h5", num_samples=8, size=8)
    with pytest.raises(ValueError, match="sample shapes"):
        _dm(ptycho, val_path=str(other)).setup("fit")
    with pytest.raises(ValueError, match="batch_size"):
        _dm(ptycho, batch_size=0)
    with pytest.raises(ValueError, match="cannot parse buffer_size"):
        _dm(ptycho, buffer_size="big").setup("fit")
    # a sample shape the model does not expect: the message names both shapes
    trainer = _trainer(max_epochs=1)
    with pytest.raises(ValueError, match=r"expects inputs of shape \(batch, 1, 32, 32\).*got \(8, 1, 16, 16\)"):
        trainer.fit(PtychoNN(image_size=32, base_channels=4, depth=2), _dm(ptycho))


def test_separate_validation_file(tmp_path):
    path = make_ptycho_h5(tmp_path / "train.h5", num_samples=40, size=16, seed=0)
    val = make_ptycho_h5(tmp_path / "val.h5", num_samples=12, size=16, seed=9)
    dm = _dm(path, val_path=str(val))
    trainer = _trainer(max_epochs=1, limit_train_batches=2)
    trainer.fit(_model(), dm)
    assert dm.num_train == 40  # all of the training file trains
    assert len(dm._val_ids) == 12 and "val/loss" in trainer.callback_metrics


def test_lab_knobs_are_not_constructor_arguments(ptycho):
    # storage emulation and data generation are tools (benchmarks, make_ptycho_h5), not loading options
    for knob in ("storage_latency_s", "storage_bandwidth", "generate_if_missing", "synthetic_samples"):
        with pytest.raises(TypeError, match=knob):
            _dm(ptycho, **{knob: 1})


@pytest.mark.slow  # a 64x64 PtychoNN through the CLI
def test_yaml_config_trains_two_steps(tmp_path):
    from lightning_sdp.cli import main

    data = make_ptycho_h5(tmp_path / "ptycho.h5", num_samples=80, size=64)  # the config's sample shape
    main(
        [
            "fit",
            "--config",
            str(CONFIG),
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
            f"--data.init_args.path={data}",
            "--data.init_args.batch_size=4",
            "--data.init_args.num_workers=0",
            "--model.init_args.base_channels=4",
        ]
    )
    assert list(tmp_path.rglob("*.ckpt")), "fit should have written a checkpoint"


def test_tsp_epoch_order_needs_a_horizon_and_follows_it(ptycho):
    with pytest.raises(ValueError, match="fixed number of epochs"):
        _dm(ptycho, epoch_order="tsp").setup("fit")
    dm = _dm(ptycho, epoch_order="tsp", max_epochs=3)
    dm.setup("fit")
    loader = dm.train_dataloader()
    for epoch in range(3):
        ids = torch.cat([b["index"] for b in loader]).numpy()
        assert np.array_equal(ids, dm.schedule.permutation(epoch))
    assert sorted(dm.schedule._order) == [0, 1, 2]


def test_read_options_are_checked_up_front_naming_the_option():
    assert SolarReadOptions().fixed_window is None and SolarReadOptions(read_window=3).fixed_window == 3
    for bad in (0, -2):
        with pytest.raises(ValueError, match=r"SolarReadOptions: read_window must be 'auto' or an int >= 1"):
            SolarReadOptions(read_window=bad)
    with pytest.raises(TypeError, match=r"SolarReadOptions: read_window must be 'auto' or an int, got True"):
        SolarReadOptions(read_window=True)
    with pytest.raises(ValueError, match=r"read_window must be 'auto' or an int, got 'autos'"):
        SolarReadOptions(read_window="autos")
    with pytest.raises(ValueError, match="max_gap must be 'auto' or an int >= 0"):
        SolarReadOptions(max_gap=-1)
    with pytest.raises(ValueError, match=r"storage must be 'probe', a StorageProfile or a dict, got 'fast'"):
        SolarReadOptions(storage="fast")
    with pytest.raises(ValueError, match="requests_per_s must be a positive number"):
        SolarReadOptions(storage={"bandwidth_bytes_per_s": 1e8, "requests_per_s": 0})
    with pytest.raises(TypeError, match=r"io_threads must be an int, got '4' \(str\)"):
        SolarReadOptions(io_threads="4")
    with pytest.raises(ValueError, match=r"io_threads must be an int >= 1 \(1 reads one run after"):
        SolarReadOptions(io_threads=0)
    with pytest.raises(ValueError, match=r"prefetch_factor must be an int >= 1"):
        SolarReadOptions(prefetch_factor=0)
    with pytest.raises(TypeError, match=r"reads must be a SolarReadOptions or None"):
        SolarDataModule("unused.h5", reads={"read_window": 1})


def test_buffer_and_read_ahead_share_the_memory_budget(ptycho):
    dm = _dm(ptycho, buffer_size=48, max_epochs=2, storage={"bandwidth_bytes_per_s": 4e7, "requests_per_s": 400})
    dm.setup("fit")
    plan = dm.read_plan
    assert plan.buffer_samples + plan.read_ahead_samples == 48 and plan.read_ahead_samples > 0
    assert dm.schedule.buffer_size == plan.buffer_samples
    loader = dm.train_dataloader()
    for _ in loader:
        pass
    assert (
        0
        < loader.peak_read_ahead_bytes
        <= max(loader.read_ahead_bytes, plan.read_window * 2 * dm.batch_size * dm.info.sample_nbytes)
    )


def test_rows_alive_never_exceed_the_read_ahead_budget(ptycho):
    # a window's rows are freed before their bytes go back to the read-ahead, which then reads the next window: no
    # third window alive beside the two the plan counts (measured as arrays still reachable while training waits)
    dm = _dm(ptycho, buffer_size=48, read_window=2, max_gap=0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    read, alive = loader.reader.read, []

    def recording_read(ids):
        rows = read(ids)
        alive.extend(weakref.ref(v) for v in rows.values())
        return rows

    loader.reader.read = recording_read
    peaks = []
    for _ in loader:
        time.sleep(0.02)  # a slow training step: the read-ahead reads on to its budget meanwhile
        gc.collect()
        peaks.append(sum(a.nbytes for a in (r() for r in alive) if a is not None))
    assert len(peaks) > 2 * loader.read_window and 0 < max(peaks) <= loader.read_ahead_bytes


def test_read_window_and_gaps_yield_the_exact_plans_batches_in_fewer_requests(ptycho):
    out, stats, requests = [], [], []
    for gap in (0, 8):
        dm = _dm(ptycho, max_epochs=2, read_window=4, max_gap=gap)
        dm.setup("fit")
        loader = dm.train_dataloader()
        batches = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            batches += [b for b in loader]
        out.append(batches)
        stats.append(loader.epoch_stats)
        requests.append(loader.reader.requests)
        loader.close()
    exact, merged = out
    assert len(exact) == len(merged) == 24
    for a, b in zip(exact, merged, strict=True):
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["input"], b["input"])
        assert torch.equal(a["target"], b["target"])
    # same plan (hit rate C/N), more bytes (gap rows) in fewer requests
    assert stats[0].hits == stats[1].hits == dm.schedule.buffer_size
    assert stats[1].storage_bytes >= stats[0].storage_bytes
    assert requests[1] < requests[0]


def test_cli_reads_the_read_options_from_yaml_and_the_command_line(tmp_path):
    from lightning_sdp.cli import cli_main

    storage = "--data.init_args.reads.storage={bandwidth_bytes_per_s: 4.0e7, requests_per_s: 400}"
    args = ["--config", str(CONFIG), f"--trainer.default_root_dir={tmp_path}", "--data.init_args.reads.max_gap=3"]
    reads = cli_main([*args, storage], run=False).datamodule.reads
    assert isinstance(reads, SolarReadOptions) and reads.max_gap == 3 and reads.read_window == "auto"
    assert reads.storage.requests_per_s == 400 and reads.readahead is False
