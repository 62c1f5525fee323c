"""Two gloo processes: SOLAR's schedule is identical on every rank, and with unequal local batches the DDP
gradient (loss = loss_scale * sum of per-sample losses) equals the single-process global-mean gradient."""

import hashlib

import h5py
import numpy as np
import pytest
import torch

from lightning_sdp.datamodules.solar import SolarDataModule, make_ptycho_h5
from lightning_sdp.models.ptychonn import PtychoNN
from tests._distributed import run_distributed

# dict batches: the loss scale makes DDP's gradient the global mean with unequal local batches
KEYS = dict(input_key="diffraction", target_key=["amplitude", "phase"], batch_format="dict")


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ptycho(tmp_path_factory):
    return str(make_ptycho_h5(tmp_path_factory.mktemp("solar_ddp") / "train.h5", num_samples=64, size=16, seed=1))


def _tiny_model():
    torch.manual_seed(0)
    return PtychoNN(image_size=16, base_channels=4, depth=2, optimizer="sgd", learning_rate=0.1)


def _plan_digest(schedule, epochs):
    h = hashlib.sha256()
    for e in range(epochs):
        for sp in schedule.epoch_plan(e):
            for rs in sp.ranks:
                for arr in (rs.indices, rs.hit, rs.inserts, rs.evicts):
                    h.update(np.ascontiguousarray(arr).tobytes() + b"|")
    return h.hexdigest()


def _unequal_step(schedule):
    for sp in schedule.epoch_plan(1):
        sizes = [len(rs.indices) for rs in sp.ranks]
        if len(set(sizes)) > 1 and min(sizes) > 0:
            return sp.step
    raise AssertionError("no step with unequal local batches")


def _ddp_gradient(rank, world_size, path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dm = SolarDataModule(path, batch_size=8, buffer_size=64, max_epochs=2, **KEYS)
    dm.rank, dm.world_size = rank, world_size
    dm.setup("fit")
    digest = _plan_digest(dm.schedule, 2)
    digests = [None] * world_size
    dist.all_gather_object(digests, digest)
    loader = dm.train_dataloader()
    loader.set_epoch(1)
    target = _unequal_step(dm.schedule)
    batch = next(b for t, b in enumerate(loader) if t == target)
    model = _tiny_model()
    ddp = DistributedDataParallel(model)
    losses = model.per_sample_loss(ddp(batch["input"]), batch["target"])
    (losses.sum() * batch["loss_scale"]).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    # numpy, not tensors: a tensor crosses the result queue as a shared-memory handle that dies with the process
    return {"digests": digests, "indices": batch["index"].tolist(), "grad": grad.numpy(), "step": target}


@pytest.mark.slow  # two spawned processes
def test_ddp_gradient_with_unequal_local_batches_equals_global_mean(ptycho):
    out = run_distributed(_ddp_gradient, 2, ptycho)
    assert out[0]["digests"][0] == out[0]["digests"][1]  # the schedule is identical on both ranks
    sizes = [len(o["indices"]) for o in out]
    assert sizes[0] != sizes[1] and sum(sizes) == 16
    ids = np.array(out[0]["indices"] + out[1]["indices"])
    # single process: plain mean over the same global batch
    dm = SolarDataModule(ptycho, batch_size=16, max_epochs=2, **KEYS)
    dm.setup("fit")
    step = out[0]["step"]
    assert np.array_equal(np.sort(ids), np.sort(dm.schedule.global_batch(1, step)))
    reader = dm._reader(ptycho)
    rows = reader.read(ids)
    x = torch.from_numpy(rows["diffraction"])
    y = torch.cat([torch.from_numpy(rows["amplitude"]), torch.from_numpy(rows["phase"])], dim=1)
    model = _tiny_model()
    model.per_sample_loss(model(x), y).mean().backward()
    ref = torch.cat([p.grad.flatten() for p in model.parameters()])
    np.testing.assert_allclose(out[0]["grad"], out[1]["grad"], rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(out[0]["grad"], ref.numpy(), rtol=1e-4, atol=1e-6)
    assert np.abs(ref.numpy()).max() > 1e-4  # a real gradient, not zeros


class _Record:
    def __init__(self):
        from lightning.pytorch import Callback

        class Rec(Callback):
            seen: list = []
            val: list = []

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                self.seen.append(batch["index"].tolist())

            def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
                if not trainer.sanity_checking:
                    self.val += batch["index"].tolist()

        self.cb = Rec()
        self.cb.seen, self.cb.val = [], []


def _fit(devices, batch_size, strategy):
    from lightning.pytorch import Trainer, seed_everything

    seed_everything(3)
    rec = _Record().cb
    model = PtychoNN(image_size=16, base_channels=4, depth=2, optimizer="sgd", learning_rate=0.05)
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=2,  # use_distributed_sampler left at its default (True): SOLAR needs no flag
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rec],
    )
    return trainer, model, rec


def _lightning_ddp(rank, world_size, path):
    torch.set_num_threads(1)
    trainer, model, rec = _fit(world_size, 8, "ddp")
    # reader processes and a validation split under DDP (this combination once hung)
    dm = SolarDataModule(path, batch_size=8, buffer_size=32, num_workers=1, val_split=0.2, **KEYS)
    trainer.fit(model, dm)
    return {"seen": rec.seen, "val": rec.val, "weights": [p.detach().numpy().copy() for p in model.parameters()]}


@pytest.mark.slow  # two spawned processes
def test_lightning_ddp_matches_single_process_training(ptycho):
    out = run_distributed(_lightning_ddp, 2, ptycho, init_group=False)
    trainer, model, rec = _fit(1, 16, "auto")
    dm = SolarDataModule(ptycho, batch_size=16, buffer_size=32, val_split=0.2, **KEYS)
    trainer.fit(model, dm)
    assert len(out[0]["seen"]) == len(out[1]["seen"]) == len(rec.seen) == 8
    unequal = 0
    for t, single in enumerate(rec.seen):
        both = out[0]["seen"][t] + out[1]["seen"][t]
        assert sorted(both) == sorted(single)  # same global batch membership as one process
        unequal += len(out[0]["seen"][t]) != len(out[1]["seen"][t])
    assert unequal > 0
    # each rank validates its own share (Lightning did not split it again): together the split, once per epoch
    val_ids = list(range(dm.num_train, 64))
    assert sorted(out[0]["val"] + out[1]["val"]) == sorted(val_ids * 2)
    assert not set(out[0]["val"]) & set(out[1]["val"])
    for a, b, ref in zip(out[0]["weights"], out[1]["weights"], model.parameters(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(a, ref.detach().numpy(), rtol=1e-4, atol=1e-5)


def _user_module():
    """A module written for ``x, y = batch`` with a mean loss, as a user's existing project has it."""
    from lightning.pytorch import LightningModule

    class MeanLoss(LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.seen, self.losses = [], []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.seen.append(x[:, 0].long().tolist())
            loss = torch.nn.functional.mse_loss(self.layer(x / 200).squeeze(1), y / 200)
            self.losses.append(float(loss))
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return MeanLoss()


def _mean_loss_ddp(rank, world_size, path):
    from lightning.pytorch import Trainer

    torch.set_num_threads(1)
    out = {}
    for balance in (True, False):
        model = _user_module()
        trainer = Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy="ddp",
            max_epochs=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        dm = SolarDataModule(path, batch_size=32, buffer_size=96, balance=balance, log_metrics=False)
        trainer.fit(model, dm)
        out[balance] = {"seen": model.seen, "losses": model.losses, "steps": dm.schedule.steps_per_epoch}
    return out


@pytest.mark.slow  # two spawned processes
def test_mean_loss_module_never_gets_an_empty_batch_under_ddp(tmp_path):
    # 193 samples, 2 ranks of 32: the last global batch would hold 1 sample, and one rank none (a nan mean loss)
    path = tmp_path / "ids.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.repeat(np.arange(193, dtype=np.float32)[:, None], 4, axis=1)
        f["y"] = np.arange(193, dtype=np.float32)
    out = run_distributed(_mean_loss_ddp, 2, str(path), init_group=False)
    for balance in (True, False):
        ranks = [o[balance] for o in out]
        for r in ranks:
            assert np.isfinite(r["losses"]).all()  # no mean over an empty batch
            assert min(len(b) for b in r["seen"]) >= 1
        steps = ranks[0]["steps"]
        assert steps == 3  # the 1-sample tail joined the third step
        assert all(len(r["seen"]) == 2 * steps for r in ranks)
        for epoch in range(2):
            ids = [x for r in ranks for b in r["seen"][epoch * steps : (epoch + 1) * steps] for x in b]
            assert sorted(ids) == list(range(193))  # every sample once per epoch
