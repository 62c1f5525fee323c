"""SDP4BitStrategy with one process: plain training, and checkpoints interchangeable with multi-process runs.

With world size 1 nothing is communicated, so the strategy leaves the model, the optimizer and the precision plugin
alone and Lightning's plain optimizer step runs. The fast tests compare it bit for bit with ``strategy="auto"``; the
slow ones resume a 1-process checkpoint in 2 gloo processes and a 2-process checkpoint in 1, and check in the same
launch what only several processes do (the ``sdp4bit/*`` metrics, the clipping wrapper).
"""

from __future__ import annotations

import csv
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests._distributed import find_free_port, run_distributed

LR, CLIP, STEPS = 0.05, 0.05, 6


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 8, generator=g)
    return TensorDataset(x, torch.sin(x @ torch.randn(8, 4, generator=g)))


def _module(manual: bool = False, unused: bool = False):
    """Two param groups (weights, biases: not the module's order); ``unused``: a parameter that never gets a
    gradient (a plain optimizer keeps no state for it)."""
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
            self.unused = nn.Parameter(torch.randn(3)) if unused else None
            self.automatic_optimization = not manual
            self.losses: list[float] = []
            self.built: torch.optim.Optimizer | None = None

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss.detach()))
            self.log("train/loss", loss)
            if manual:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
                opt.step()
            return loss

        def configure_optimizers(self):
            decay = [p for p in self.parameters() if p.dim() == 2]
            no_decay = [p for p in self.parameters() if p.dim() < 2]
            self.built = torch.optim.AdamW(
                [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=LR
            )
            return self.built

        def train_dataloader(self):
            # Lightning gives every strategy derived from DDP a shuffling DistributedSampler (seeded per epoch),
            # one process too; with `use_distributed_sampler=False` both strategies read this loader's order
            return DataLoader(_data(), batch_size=8 // self.trainer.world_size)

    return Tiny()


def _trainer(strategy, devices: int = 1, **kwargs):
    import lightning.pytorch as pl

    kwargs = {"max_steps": STEPS, "logger": False, **kwargs}
    return pl.Trainer(
        strategy=strategy, devices=devices, accelerator="cpu", enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **kwargs,
    )  # fmt: skip


def _fit(module, strategy, devices: int = 1, ckpt_path: str | None = None, **kwargs):
    trainer = _trainer(strategy, devices, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def _flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


@pytest.fixture
def single_process_group(monkeypatch):
    """A Trainer with a DDP-derived strategy initialises a 1-process group; remove it afterwards."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ one process


@pytest.mark.parametrize(
    "manual,clip", [(False, None), (False, CLIP), (True, None)], ids=["adamw", "gradient_clip_val", "manual"]
)
def test_one_process_steps_exactly_like_plain_training(single_process_group, manual, clip):
    from lightning.pytorch import Callback

    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy, grad_norm

    class Look(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.plugin = trainer.precision_plugin
            self.norms = grad_norm(pl_module, 2)
            self.strategy_norms = trainer.strategy.grad_norm(pl_module, 2)

    kwargs = {"use_distributed_sampler": False, **({"gradient_clip_val": clip} if clip else {})}
    plain = _module(manual)
    _fit(plain, "auto", **kwargs)
    ours, look, strategy = _module(manual), Look(), SDP4BitStrategy()
    trainer = _trainer(strategy, callbacks=[look], **kwargs)
    users_plugin = trainer.precision_plugin
    with pytest.warns(UserWarning, match="nothing is compressed and the strategy steps like plain training"):
        trainer.fit(ours)
    assert torch.equal(_flat(ours), _flat(plain)) and not torch.equal(_flat(ours), _flat(_module()))
    assert ours.losses == plain.losses
    # nothing sharded: the user's optimizer over the model's parameters, keyed by them; the user's precision plugin
    raw = trainer.strategy.optimizers[0]
    raw = getattr(raw, "_optimizer", raw)
    assert raw is ours.built and trainer.optimizers[0] is ours.built
    in_order = [ours.net[0].weight, ours.net[2].weight, ours.net[0].bias, ours.net[2].bias]
    assert [id(p) for g in raw.param_groups for p in g["params"]] == [id(p) for p in in_order]
    assert {id(p) for p in raw.state} == {id(p) for p in in_order}
    assert look.plugin is users_plugin and trainer.precision_plugin is users_plugin
    assert strategy.buckets == [] and strategy.topology is not None and strategy.topology.world_size == 1
    with pytest.raises(ValueError, match="with one process nothing is sharded"):
        strategy.master_shards(raw)
    # grad_norm reads the parameters' .grad, as Lightning's
    assert set(look.norms) == set(look.strategy_norms) and "grad_2.0_norm_total" in look.norms
    assert all(torch.equal(look.norms[k], look.strategy_norms[k]) for k in look.norms)
    # nothing communicated, nothing counted or logged
    assert strategy.comm_stats.bytes_per_step == 0 and strategy.comm_stats.steps == 0
    assert strategy.comm_stats.bits_per_element("weight") == 0.0
    assert not any(k.startswith("sdp4bit/") for k in trainer.callback_metrics)
    assert strategy._step == STEPS


def test_one_process_checkpoint_has_the_consolidated_format(single_process_group, tmp_path):
    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy

    module = _module(unused=True)
    trainer = _fit(module, SDP4BitStrategy())
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    ckpt = torch.load(tmp_path / "one.ckpt", weights_only=False)
    state = ckpt["optimizer_states"][0]
    assert set(state) == {"state", "param_groups", "sdp4bit"}
    assert {k: v for k, v in state["sdp4bit"].items() if k != "master"} == {
        "step": STEPS, "skipped_steps": 0, "world_size": 1,
    }  # fmt: skip
    # parameters numbered in param-group order, as the multi-process consolidation numbers them
    params = [module.net[0].weight, module.net[2].weight, module.unused, module.net[0].bias, module.net[2].bias]
    names = ["net.0.weight", "net.2.weight", "unused", "net.0.bias", "net.2.bias"]
    assert [g["params"] for g in state["param_groups"]] == [[0, 1], [2, 3, 4]]
    assert sorted(state["state"]) == [0, 1, 3, 4]  # the unused parameter has no state, as in plain torch
    for i, (p, name) in enumerate(zip(params, names, strict=True)):
        assert torch.equal(state["sdp4bit"]["master"][i], p.detach())
        assert torch.equal(ckpt["state_dict"][name], p.detach())
        if i in state["state"]:
            assert state["state"][i]["exp_avg"].shape == p.shape
    # the strategy's own optimizer state adds the section to what the optimizer itself returns
    plain = module.built.state_dict()
    assert plain["param_groups"] == state["param_groups"]


# ------------------------------------------------------------------------------------------------ 1 <-> 2 processes


def _two_processes(rank: int, world: int, tmp: str) -> dict:
    from lightning.pytorch import Callback
    from lightning.pytorch.loggers import CSVLogger

    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy
    from lightning_sdp.plugins.sdp4bit.precision import ShardedClippingPrecision

    out: dict = {}
    # a. the 1-process checkpoint, restored only (max_steps already reached): consolidated again, unchanged
    saved = torch.load(f"{tmp}/one.ckpt", weights_only=False)["optimizer_states"][0]
    module = _module(unused=True)
    strategy = SDP4BitStrategy("qwd", "tlq_hs", weight_group_size=256)
    trainer = _fit(module, strategy, world, ckpt_path=f"{tmp}/one.ckpt")
    state = strategy.optimizer_state(trainer.optimizers[0])
    out["same_state"] = all(
        torch.equal(state["state"][i][k], v) for i in saved["state"] for k, v in saved["state"][i].items()
    )
    out["same_masters"] = all(
        torch.equal(state["sdp4bit"]["master"][i], v) for i, v in saved["sdp4bit"]["master"].items()
    )
    out["same_groups"] = state["param_groups"] == saved["param_groups"]
    out["unused_state"] = {k: float(v.abs().max()) for k, v in state["state"][2].items() if v.dim() > 0}
    out["restored_step"] = strategy._step
    # b. the same checkpoint, trained on for 3 more steps (8 samples per step: 4 per rank)
    module = _module(unused=True)
    strategy = SDP4BitStrategy("qwd", "tlq_hs", weight_group_size=256)
    trainer = _fit(module, strategy, world, ckpt_path=f"{tmp}/one.ckpt", max_steps=STEPS + 3)
    out["resumed_global_step"] = trainer.global_step
    out["resumed_losses"] = module.losses
    out["resumed_params"] = _flat(module).numpy()

    # c. a 2-process run for the 1-process resume; the clipping wrapper and the metrics only several processes have
    class Look(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            plugin = trainer.precision_plugin
            out["wrapped"] = isinstance(plugin, ShardedClippingPrecision) and plugin.plugin is users

    module = _module(unused=True)
    logger = CSVLogger(f"{tmp}/logs_rank{rank}")
    trainer = _trainer(
        SDP4BitStrategy("qwd", "tlq_hs", weight_group_size=256), world, gradient_clip_val=CLIP, callbacks=[Look()], logger=logger,
        log_every_n_steps=2,
    )  # fmt: skip
    users = trainer.precision_plugin
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    out["unwrapped_after_fit"] = trainer.precision_plugin is users
    trainer.save_checkpoint(f"{tmp}/two.ckpt")
    out["two_params"] = _flat(module).numpy()
    out["metrics_file"] = logger.experiment.metrics_file_path if rank == 0 else None
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Save a 1-process checkpoint here, then run :func:`_two_processes` in 2 gloo processes."""
    tmp = tmp_path_factory.mktemp("sdp4bit_single")
    mp = pytest.MonkeyPatch()
    mp.setenv("MASTER_ADDR", "127.0.0.1")
    mp.setenv("MASTER_PORT", str(find_free_port()))
    try:
        from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy

        trainer = _fit(_module(unused=True), SDP4BitStrategy())
        trainer.save_checkpoint(tmp / "one.ckpt")
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        mp.undo()
    return tmp, run_distributed(_two_processes, 2, str(tmp), timeout=400, init_group=False)


@pytest.mark.slow
def test_one_process_checkpoint_resumes_in_two(launched):
    _, results = launched
    for res in results:
        # cut for 2 ranks and consolidated again: what the single process saved, state and master weights
        assert res["same_state"] and res["same_masters"] and res["same_groups"]
        assert res["unused_state"] == {"exp_avg": 0.0, "exp_avg_sq": 0.0}  # fresh state where plain torch had none
        assert res["restored_step"] == STEPS
        assert res["resumed_global_step"] == STEPS + 3 and len(res["resumed_losses"]) == 3
        assert all(math.isfinite(v) for v in res["resumed_losses"])
    assert (results[0]["resumed_params"] == results[1]["resumed_params"]).all()


@pytest.mark.slow
def test_two_process_checkpoint_resumes_in_one(launched, single_process_group):
    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy

    tmp, results = launched
    ckpt = torch.load(tmp / "two.ckpt", weights_only=False)
    saved = ckpt["optimizer_states"][0]
    assert saved["sdp4bit"]["world_size"] == 2
    # restore only: the user's optimizer holds the consolidated state, the model the master weights
    module = _module(unused=True)
    strategy = SDP4BitStrategy()
    trainer = _fit(module, strategy, ckpt_path=str(tmp / "two.ckpt"))
    assert trainer.optimizers[0] is module.built
    state = module.built.state_dict()
    assert all(torch.equal(state["state"][i][k], v) for i in saved["state"] for k, v in saved["state"][i].items())
    params = [module.net[0].weight, module.net[2].weight, module.unused, module.net[0].bias, module.net[2].bias]
    assert all(torch.equal(p.detach(), saved["sdp4bit"]["master"][i]) for i, p in enumerate(params))
    assert strategy._step == STEPS
    # the strategy saves it again in the same layout, master weights included
    again = strategy.optimizer_state(trainer.optimizers[0])
    assert all(torch.equal(again["sdp4bit"]["master"][i], v) for i, v in saved["sdp4bit"]["master"].items())
    # and trains on
    module = _module(unused=True)
    trainer = _fit(module, SDP4BitStrategy(), ckpt_path=str(tmp / "two.ckpt"), max_steps=STEPS + 3)
    assert trainer.global_step == STEPS + 3 and all(math.isfinite(v) for v in module.losses)
    assert not torch.equal(_flat(module), torch.from_numpy(results[0]["two_params"]))


@pytest.mark.slow
def test_several_processes_wrap_the_clipping_and_log_the_metrics(launched):
    _, results = launched
    for res in results:
        assert res["wrapped"] and res["unwrapped_after_fit"]
    with open(Path(results[0]["metrics_file"])) as f:
        rows = list(csv.DictReader(f))
    columns = sorted(c.removeprefix("sdp4bit/") for c in rows[0] if c.startswith("sdp4bit/"))
    assert columns == [
        "bytes_per_step", "codec_ms", "grad_bits_per_element_inter", "grad_bits_per_element_intra",
        "redone_uncompressed", "skipped_steps", "weight_bits_per_element", "weight_drift",
    ]  # fmt: skip
    for column in ("sdp4bit/bytes_per_step", "train/loss"):  # at the logger's cadence
        assert [int(r["step"]) for r in rows if r[column]] == [1, 3, 5], column
