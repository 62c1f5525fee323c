from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sdp.callbacks import SolarMetrics
from lightning_sdp.datamodules.solar import EpochStats, SolarDataModule, SolarLoader, StepStats, make_ptycho_h5
from lightning_sdp.datamodules.solar.reader import resolve_max_gap, resolve_read_window
from lightning_sdp.models.ptychonn import PtychoNN

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "solar_ptycho.yaml"


@pytest.fixture(autouse=True)
def _one_thread():
    # two intra-op threads on a shared 2-core machine make a tiny CNN ~100x slower (spinning OpenMP threads)
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ptycho(tmp_path_factory):
    return make_ptycho_h5(tmp_path_factory.mktemp("solar") / "train.h5", num_samples=96, size=16, seed=0)


def _dm(path, **kw):
    args = dict(input_key="diffraction", target_key=["amplitude", "phase"], batch_size=8, buffer_size=24)
    args.update(kw)
    return SolarDataModule(str(path), **args)


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
    assert sum(hits) == 24  # C/N of the second epoch, served from the store
    assert len(loader.store) == 24


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
    assert float(m["solar/epoch_hit_rate"]) == pytest.approx(24 / 72)  # C/N in the second epoch
    sample_bytes = 3 * 16 * 16 * 4
    assert float(m["solar/epoch_storage_bytes"]) == (72 - 24) * sample_bytes
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
    assert epoch_stats.steps == 12 and epoch_stats.samples == 96 and epoch_stats.hits == 24
    assert epoch_stats.reads == 96 - 24 and epoch_stats.storage_bytes == (96 - 24) * 3 * 16 * 16 * 4
    assert epoch_stats.hit_rate == pytest.approx(0.25)
    assert epoch_stats.samples_per_s == pytest.approx(96 / epoch_stats.wall_s)
    assert list(step.to_dict()) == [
        "samples", "hits", "hit_rate", "reads", "bytes", "wait_s", "read_s", "samples_per_s",
    ]  # fmt: skip
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


def test_requires_use_distributed_sampler_false(ptycho):
    trainer = _trainer(max_epochs=1, use_distributed_sampler=True)
    with pytest.raises(ValueError, match="use_distributed_sampler=False"):
        trainer.fit(_model(), _dm(ptycho))


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


@pytest.mark.parametrize("buffer,expected", [(0, 0.0), (500, 1.0), ("1MB", 1.0)])
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


def test_auto_read_plan_is_sized_from_the_sample_bytes():
    # 48 KiB samples of three 16 KiB rows, local batch 32: 16 steps (24 MiB <= 32 MiB), gaps of 8 rows (128 KiB)
    assert resolve_read_window("auto", 32, 48 * 1024) == 16
    assert resolve_max_gap("auto", 16 * 1024) == 8
    # big samples: the window shrinks to stay within its memory bound, never below one step
    assert resolve_read_window("auto", 32, 4 * 2**20) == 1
    assert resolve_read_window("auto", 8, 1024 * 1024) == 4
    assert resolve_max_gap("auto", 1 * 2**20) == 0
    assert resolve_read_window(3, 32, 1) == 3 and resolve_max_gap(5, 1) == 5
    for bad in (0, -2, "big"):
        with pytest.raises(ValueError, match="read_window must be 'auto' or an int >= 1"):
            resolve_read_window(bad, 32, 1)
    with pytest.raises(ValueError, match="max_gap must be 'auto' or an int >= 0"):
        SolarDataModule("unused.h5", max_gap=-1)


def test_auto_read_plan_yields_the_exact_plans_batches_in_fewer_requests(ptycho):
    out, stats, requests = [], [], []
    for kw in ({"read_window": 1, "max_gap": 0}, {}):
        dm = _dm(ptycho, max_epochs=2, **kw)
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
    exact, auto = out
    assert len(exact) == len(auto) == 24
    for a, b in zip(exact, auto, strict=True):
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["input"], b["input"])
        assert torch.equal(a["target"], b["target"])
    # same plan (hit rate C/N), more bytes (whole windows) in fewer requests
    assert stats[0].hits == stats[1].hits == 24
    assert stats[1].storage_bytes >= stats[0].storage_bytes
    assert requests[1] < requests[0]
