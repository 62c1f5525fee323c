"""InteractionsDataModule: a fit resumed from a mid-epoch checkpoint sees the batches of an uninterrupted fit."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DistributedSampler

from lightning_sdp.datamodules.interactions import InteractionsDataModule
from lightning_sdp.datamodules.sampling import DistributedEpochSeededBatchSampler, EpochSeededBatchSampler
from lightning_sdp.models.simplex import SimpleXModule

_DATA = {"num_users": 60, "num_items": 40, "batch_size": 64, "eval_batch_size": 64, "val_fraction": 0, "seed": 0}
_MODEL = {"dim": 8, "num_negatives": 4, "max_history": 10, "backend": "reference", "lr": 0.05, "seed": 0}


class _Record(Callback):
    """Every training batch as ``(epoch, batch_idx, users, items)``."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int, list[int], list[int]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        users, items = batch
        self.batches.append((trainer.current_epoch, batch_idx, users.tolist(), items.tolist()))


class _Killed(Exception):
    pass


class _KillAfter(Callback):
    """Saves a checkpoint after ``step`` optimizer steps (as ``ModelCheckpoint(every_n_train_steps=...)`` does, in
    ``on_train_batch_end``), then dies."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            raise _Killed


def _trainer(*callbacks: Callback, **kw) -> Trainer:
    args = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "callbacks": list(callbacks),
    }
    args.update(kw)
    return Trainer(**args)


def _params(model: SimpleXModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _straight(**model_kw) -> tuple[list, dict[str, torch.Tensor]]:
    record, model = _Record(), SimpleXModule(**{**_MODEL, **model_kw})
    _trainer(record).fit(model, InteractionsDataModule(**_DATA))
    return record.batches, _params(model)


@pytest.mark.parametrize(
    ("kill_after", "model_kw", "workers"),
    [
        (3, {}, 0),  # mid first epoch
        (7, {"optimizer": "adam", "lr": 0.01, "lr_schedule": "linear"}, 0),  # mid second epoch; optimiser, schedule
        (7, {}, 1),  # a worker draws indices as soon as its iterator exists, before Lightning sets the epoch
    ],
)
def test_a_fit_killed_mid_epoch_resumes_at_the_next_batch_bit_exactly(tmp_path, kill_after, model_kw, workers):
    data = {**_DATA, "num_workers": workers}
    batches, params = _straight(**model_kw)
    per_epoch = len(batches) // 2
    assert 0 < kill_after % per_epoch, "the kill must fall mid-epoch"

    first, ckpt = _Record(), tmp_path / "killed.ckpt"
    with pytest.raises(_Killed):
        _trainer(first, _KillAfter(kill_after, ckpt)).fit(
            SimpleXModule(**{**_MODEL, **model_kw}), InteractionsDataModule(**data)
        )
    assert torch.load(ckpt, weights_only=False)["InteractionsDataModule"]["step"] == kill_after % per_epoch

    second, resumed = _Record(), SimpleXModule(**{**_MODEL, **model_kw})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*dataloader is not resumable.*")  # Lightning's warning
        _trainer(second).fit(resumed, InteractionsDataModule(**data), ckpt_path=str(ckpt))
    assert first.batches + second.batches == batches  # each positive once per epoch, in the same order
    for name, value in _params(resumed).items():
        torch.testing.assert_close(value, params[name], rtol=0, atol=0, msg=name)


class _KillAtValidationEnd(Callback):
    """Saves a checkpoint at the end of the ``count``-th validation (as ``ModelCheckpoint(monitor=...)`` does), then
    dies."""

    def __init__(self, count: int, path: Path) -> None:
        self.count, self.path, self.seen = count, path, 0

    def on_validation_end(self, trainer, pl_module) -> None:
        self.seen += 1
        if self.seen == self.count:
            trainer.save_checkpoint(self.path)
            raise _Killed


@pytest.mark.parametrize(("count", "epoch"), [(1, 0), (3, 1)])  # validations after batches 2, 4 (the end), 6, 8
def test_a_checkpoint_of_a_mid_epoch_validation_resumes_after_it(tmp_path, count, epoch):
    data, quiet = {**_DATA, "val_fraction": 0.2}, {"val_check_interval": 2, "limit_val_batches": 1}
    straight, model = _Record(), SimpleXModule(**_MODEL)
    _trainer(straight, **quiet).fit(model, InteractionsDataModule(**data))
    first, ckpt = _Record(), tmp_path / "val.ckpt"
    with pytest.raises(_Killed):
        _trainer(first, _KillAtValidationEnd(count, ckpt), **quiet).fit(
            SimpleXModule(**_MODEL), InteractionsDataModule(**data)
        )
    state = torch.load(ckpt, weights_only=False)["InteractionsDataModule"]
    assert (state["epoch"], state["step"]) == (epoch, 2)
    second, resumed = _Record(), SimpleXModule(**_MODEL)
    _trainer(second, **quiet).fit(resumed, InteractionsDataModule(**data), ckpt_path=str(ckpt))
    assert first.batches + second.batches == straight.batches
    expected = _params(model)
    for name, value in _params(resumed).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)


def test_a_fit_stopped_by_max_steps_resumes_at_the_start_of_the_next_epoch(tmp_path):
    # Lightning ends the epoch when max_steps stops a fit (epoch end hooks, epoch counted), and a fit resumed from it
    # starts the next epoch: the datamodule must not skip batches of that one
    batches, _ = _straight()
    per_epoch = len(batches) // 2
    first, ckpt = _Record(), tmp_path / "stopped.ckpt"
    trainer = _trainer(first, max_steps=2)
    trainer.fit(SimpleXModule(**_MODEL), InteractionsDataModule(**_DATA))
    trainer.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=False)["InteractionsDataModule"]["step"] == 0
    second = _Record()
    _trainer(second).fit(SimpleXModule(**_MODEL), InteractionsDataModule(**_DATA), ckpt_path=str(ckpt))
    assert first.batches == batches[:2]
    assert second.batches == batches[per_epoch:]


@pytest.mark.numba
def test_the_fused_backend_resumes_mid_epoch_bit_exactly(tmp_path):
    from lightning_sdp.plugins.heat import HEATAccelerator

    fused = {**_MODEL, "backend": "fused", "lr": 0.3}

    def fit(*callbacks: Callback, ckpt: Path | None = None) -> SimpleXModule:
        model = SimpleXModule(**fused)
        trainer = _trainer(*callbacks, accelerator=HEATAccelerator(num_threads=1))
        trainer.fit(model, InteractionsDataModule(**_DATA), ckpt_path=str(ckpt) if ckpt else None)
        return model

    straight = _params(fit())
    ckpt = tmp_path / "killed.ckpt"
    with pytest.raises(_Killed):
        fit(_KillAfter(3, ckpt))
    resumed = _params(fit(ckpt=ckpt))
    for name, value in resumed.items():
        torch.testing.assert_close(value, straight[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"batch_size": 32}, "batch_size: checkpoint 64, now 32"),
        ({"seed": 1}, "seed: checkpoint 0, now 1"),  # also another split: the pairs' hash differs too
        ({"val_fraction": 0.2}, "train_pairs: checkpoint 256, now 196; train_pairs_hash"),  # other pairs, same tables
        ({"shuffle": False}, "shuffle: checkpoint True, now False"),
    ],
)
def test_a_checkpoint_of_other_batches_is_refused(tmp_path, change, match):
    ckpt = tmp_path / "killed.ckpt"
    with pytest.raises(_Killed):
        _trainer(_KillAfter(2, ckpt)).fit(SimpleXModule(**_MODEL), InteractionsDataModule(**_DATA))
    with pytest.raises(ValueError, match=match) as info:
        _trainer().fit(SimpleXModule(**_MODEL), InteractionsDataModule(**{**_DATA, **change}), ckpt_path=str(ckpt))
    assert "SimpleXModule.load_from_checkpoint" in str(info.value)  # says what to do instead


def test_a_mid_epoch_checkpoint_of_another_number_of_processes_is_refused(tmp_path):
    ckpt = tmp_path / "killed.ckpt"
    with pytest.raises(_Killed):
        _trainer(_KillAfter(2, ckpt)).fit(SimpleXModule(**_MODEL), InteractionsDataModule(**_DATA))
    state = torch.load(ckpt, weights_only=False)
    state["InteractionsDataModule"]["processes"] = 2  # as saved by a 2-process DDP run
    torch.save(state, ckpt)
    with pytest.raises(ValueError, match=r"2 process\(es\) sharing the batches, but this run has 1"):
        _trainer().fit(SimpleXModule(**_MODEL), InteractionsDataModule(**_DATA), ckpt_path=str(ckpt))


def test_a_checkpoint_without_the_position_is_resumed_with_a_warning(tmp_path, caplog):
    ckpt = tmp_path / "killed.ckpt"
    with pytest.raises(_Killed):
        _trainer(_KillAfter(2, ckpt)).fit(SimpleXModule(**_MODEL), InteractionsDataModule(**_DATA))
    state = torch.load(ckpt, weights_only=False)
    del state["InteractionsDataModule"]  # as saved before the datamodule had a state
    torch.save(state, ckpt)
    with caplog.at_level("WARNING", logger="lightning_sdp.datamodules.interactions.datamodule"):
        _trainer().fit(SimpleXModule(**_MODEL), InteractionsDataModule(**_DATA), ckpt_path=str(ckpt))
    (message,) = [r.getMessage() for r in caplog.records if "holds no position" in r.getMessage()]
    assert str(ckpt) in message and "restarts that epoch at its first batch" in message


def test_testing_a_checkpoint_ignores_the_training_position(tmp_path):
    ckpt = tmp_path / "killed.ckpt"
    with pytest.raises(_Killed):
        _trainer(_KillAfter(2, ckpt)).fit(SimpleXModule(**_MODEL), InteractionsDataModule(**_DATA))
    dm = InteractionsDataModule(**{**_DATA, "batch_size": 32})  # another training batch size is fine for testing
    (result,) = _trainer().test(SimpleXModule(**_MODEL), dm, ckpt_path=str(ckpt), verbose=False)
    assert np.isfinite(result["test/recall@20"])
    assert dm._resume is None


def test_sampler_resume_skips_the_trained_batches_of_that_epoch_only():
    def passes(sampler: EpochSeededBatchSampler) -> list[list[int]]:
        return [b.tolist() for b in sampler]

    full = EpochSeededBatchSampler(50, 8, seed=3)
    full.set_epoch(2)
    epoch2 = passes(full)
    resumed = EpochSeededBatchSampler(50, 8, seed=3)
    resumed.resume_at(2, 3)
    assert resumed.epoch == 2  # set before the Trainer does: DataLoader workers draw indices early
    resumed.set_epoch(2)
    assert passes(resumed) == epoch2[3:]
    assert passes(resumed) == epoch2  # once
    other = EpochSeededBatchSampler(50, 8, seed=3)
    other.resume_at(2, 3)
    other.set_epoch(3)
    full.set_epoch(3)
    assert passes(other) == passes(full)  # another epoch: no skip
    with pytest.raises(ValueError, match="cannot resume 7 batches into an epoch of 7"):
        other.resume_at(0, 7)


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_sampler_shares_the_epoch_and_resumes_every_share(world_size):
    full = EpochSeededBatchSampler(83, 8, seed=1)  # 11 batches: not a multiple of the world size
    full.set_epoch(1)
    epoch = [b.tolist() for b in full]
    shares = []
    for rank in range(world_size):
        share = DistributedEpochSeededBatchSampler(83, 8, world_size, rank, seed=1)
        assert isinstance(share, DistributedSampler)  # so Lightning keeps it instead of wrapping it
        share.set_epoch(1)
        shares.append([b.tolist() for b in share])
        assert len(shares[-1]) == len(share) == -(-len(epoch) // world_size)
        share.resume_at(1, 2)
        assert [b.tolist() for b in share] == shares[-1][2:]
    padded = [batch for step in zip(*shares, strict=True) for batch in step]  # rank r takes r, r + W, ...
    assert padded[: len(epoch)] == epoch and padded[len(epoch) :] == epoch[: len(padded) - len(epoch)]
    with pytest.raises(ValueError, match="rank must be in"):
        DistributedEpochSeededBatchSampler(83, 8, world_size, world_size)


def _ddp_kill_and_resume(rank: int, world_size: int, folder: str) -> dict[str, object]:
    """In every rank: an uninterrupted fit, a fit killed mid-epoch, and its resumption (reference backend, gloo)."""
    ddp = {"accelerator": "cpu", "devices": world_size, "strategy": "ddp_find_unused_parameters_true"}  # g=1: V unused
    data = {**_DATA, "batch_size": 16}  # 16 batches per epoch: 8 per rank
    straight = _Record()
    _trainer(straight, **ddp).fit(SimpleXModule(**_MODEL), InteractionsDataModule(**data))
    ckpt = Path(folder) / "killed.ckpt"
    first = _Record()
    try:
        _trainer(first, _KillAfter(5, ckpt), **ddp).fit(SimpleXModule(**_MODEL), InteractionsDataModule(**data))
    except _Killed:
        pass
    second, resumed = _Record(), SimpleXModule(**_MODEL)
    trainer = _trainer(second, **ddp)
    trainer.fit(resumed, InteractionsDataModule(**data), ckpt_path=str(ckpt))
    return {
        "sampler": type(trainer.train_dataloader.sampler).__name__,
        "straight": straight.batches,
        "resumed": first.batches + second.batches,
        "weights": resumed.item_embedding.weight.detach().numpy().copy(),
    }


@pytest.mark.slow
def test_ddp_ranks_resume_at_their_next_batch(tmp_path):
    from tests._distributed import run_distributed

    results = run_distributed(_ddp_kill_and_resume, 2, str(tmp_path), init_group=False, timeout=240)
    for r in results:
        assert r["sampler"] == "DistributedEpochSeededBatchSampler"  # the datamodule's, not Lightning's wrapper
        assert r["resumed"] == r["straight"]
    epoch0 = [sorted(zip(*b[2:], strict=True)) for r in results for b in r["straight"] if b[0] == 0]
    pairs = [p for batch in epoch0 for p in batch]
    assert len(pairs) == len(set(pairs))  # the two shares of an epoch are disjoint (16 batches, no padding)
    np.testing.assert_array_equal(results[0]["weights"], results[1]["weights"])  # DDP kept the replicas equal
