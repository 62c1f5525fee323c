"""SDP4BitStrategy construction, registration, YAML, and errors users can cause (single process)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sdp  # registers the aliases
from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy
from lightning_sdp.plugins.sdp4bit.sharding import check_optimizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def single_process_group(monkeypatch):
    """A Trainer with a DDP-derived strategy initialises a 1-process group; remove it afterwards."""
    from tests._distributed import find_free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _tiny(optimizer: str = "adamw"):
    from lightning.pytorch import LightningModule

    class Tiny(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            if optimizer == "lbfgs":
                return torch.optim.LBFGS(self.parameters())
            return torch.optim.AdamW(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=4)

    return Tiny()


def _trainer(strategy, **kwargs):
    from lightning.pytorch import Trainer

    kwargs = {"max_steps": 3, "logger": False, **kwargs}
    return Trainer(
        strategy=strategy, devices=1, accelerator="cpu", enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **kwargs,
    )  # fmt: skip


def test_aliases_and_instance():
    from lightning.pytorch import Trainer

    assert isinstance(Trainer(strategy="sdp4bit", devices=1, accelerator="cpu").strategy, SDP4BitStrategy)
    spawn = Trainer(strategy="sdp4bit_spawn", devices=1, accelerator="cpu").strategy
    assert isinstance(spawn, SDP4BitStrategy) and spawn._start_method == "spawn"
    s = SDP4BitStrategy(weight_compression="qw", gradient_compression="ulq", intra_node_size=2)
    assert Trainer(strategy=s, devices=1, accelerator="cpu").strategy is s
    assert lightning_sdp.SDP4BitStrategy is SDP4BitStrategy
    assert s.alignment == 2048  # lcm of the weight group (2048), gradient group (128) and packing (2)


def test_forkserver_preloads_torch_lightning_and_the_strategy_and_other_methods_leave_it_alone(monkeypatch):
    import multiprocessing

    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    preloads: list[list[str]] = []
    monkeypatch.setattr(multiprocessing, "set_forkserver_preload", preloads.append)
    for method in ("spawn", "forkserver"):
        strategy = SDP4BitStrategy(start_method=method)
        Trainer(strategy=strategy, devices=2, accelerator="cpu")  # builds the launcher
        assert isinstance(strategy.launcher, _MultiProcessingLauncher)
        assert strategy.launcher._start_method == method
    assert preloads == [
        ["__main__", "torch", "torch.distributed", "lightning.pytorch", "lightning_sdp.plugins.sdp4bit"]
    ]


def test_yaml_config_builds_the_strategy(tmp_path):
    from lightning_sdp.cli import cli_main

    config = REPO / "examples" / "configs" / "gpt_sdp4bit.yaml"
    cli = cli_main(["--config", str(config), f"--trainer.default_root_dir={tmp_path}"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, SDP4BitStrategy)
    assert (
        strategy.config.weight_compression,
        strategy.config.gradient_compression,
        strategy.config.intra_node_size,
    ) == (
        "qwd",
        "tlq_hs",
        2,
    )
    cfg = tmp_path / "alias.yaml"
    cfg.write_text(
        "trainer:\n  strategy: sdp4bit\n  accelerator: cpu\n  devices: 2\n"
        "model:\n  class_path: lightning_sdp.models.GPT\n  init_args: {vocab_size: 10, n_layer: 1, n_embd: 16}\n"
        "data:\n  class_path: lightning_sdp.datamodules.CharTextDataModule\n"
    )
    assert isinstance(cli_main(["--config", str(cfg)], run=False).trainer.strategy, SDP4BitStrategy)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"weight_compression": "int4"}, "weight_compression"),
        ({"gradient_compression": "fp8"}, "gradient_compression"),
        ({"weight_bits": 2}, "weight_bits must be 4 or 8"),
        ({"gradient_group_size": 100}, "multiple of hadamard_size"),
        ({"weight_group_size": 0}, "positive even number"),
        ({"hadamard_size": 24}, "power of two"),
        ({"rounding": "up"}, "rounding"),
        ({"intra_node_size": 0}, "intra_node_size"),
        ({"nonfinite_gradients": "ignore"}, "nonfinite_gradients"),
        ({"optimizer_state": "replicate"}, "optimizer_state must be one of 'auto', 'shard'"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SDP4BitStrategy(**kwargs)


def test_unsupported_optimizer_message():
    check_optimizer(torch.optim.AdamW([nn.Parameter(torch.zeros(2))]))
    with pytest.raises(ValueError, match=r"LBFGS.*element-wise"):
        check_optimizer(torch.optim.LBFGS([nn.Parameter(torch.zeros(2))]))


def test_optimizer_step_needs_a_lightning_module():
    strategy = SDP4BitStrategy()
    optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(2))])
    with pytest.raises(TypeError, match=r"needs the LightningModule being trained.*got Linear"):
        strategy.optimizer_step(optimizer, lambda: None, model=nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"got NoneType"):  # no model given and no Trainer attached
        strategy.optimizer_step(optimizer, lambda: None)


def test_single_device_trains_and_warns(single_process_group):
    # one process: plain training (tests/plugins/test_sdp4bit_single_process.py compares it with strategy="auto")
    model = _tiny()
    before = model.net.weight.detach().clone()
    strategy = SDP4BitStrategy()
    with pytest.warns(UserWarning, match="nothing is compressed and the strategy steps like plain training"):
        _trainer(strategy).fit(model)
    assert not torch.equal(before, model.net.weight)
    assert strategy.comm_stats.bytes_per_step == 0
    # nothing sharded: the optimizer steps the model's parameters, no flat buckets or master shards
    assert strategy.buckets == []
    assert [p for g in strategy.optimizers[0].param_groups for p in g["params"]] == list(model.parameters())
    with pytest.raises(ValueError, match="with one process nothing is sharded"):
        strategy.master_shards(strategy.optimizers[0])


def test_fp16_precision_is_rejected(single_process_group):
    with pytest.raises(ValueError, match="bf16-mixed"):
        _trainer(SDP4BitStrategy(), precision="16-true").fit(_tiny())


def test_lbfgs_is_rejected_at_fit(single_process_group):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="cannot shard the optimizer"):
            _trainer(SDP4BitStrategy()).fit(_tiny("lbfgs"))


def test_bf16_mixed_single_device(single_process_group):
    model = _tiny()
    strategy = SDP4BitStrategy()
    trainer = _trainer(strategy, precision="bf16-mixed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    assert model.net.weight.dtype == torch.float32
    assert strategy.buckets == [] and trainer.precision == "bf16-mixed"


def test_strategy_pickles_for_spawn_after_a_fit(single_process_group):
    # Lightning pickles the strategy to start "spawn" processes; its worker threads and locks must not travel
    import pickle

    strategy = SDP4BitStrategy(start_method="spawn")
    strategy.comm_stats.add_codec_time(0.5)
    strategy._pipeline.submit(lambda: None, lambda: 1)
    clone = pickle.loads(pickle.dumps(strategy))
    assert clone.comm_stats.codec_seconds == 0.5
    clone.comm_stats.add_codec_time(0.25)  # a fresh lock in the new process
    assert clone.comm_stats.codec_seconds == 0.75


def test_one_process_keeps_the_users_precision_plugin(single_process_group):
    # several processes wrap it in ShardedClippingPrecision during fit (test_sdp4bit_single_process.py checks that);
    # one process clips the parameters' gradients as plain Lightning does
    from lightning.pytorch import Callback
    from lightning.pytorch.plugins.precision import MixedPrecision

    seen = {}

    class Look(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.update(plugin=trainer.precision_plugin, precision=trainer.precision)

    strategy = SDP4BitStrategy()
    trainer = _trainer(strategy, precision="bf16-mixed", callbacks=[Look()], gradient_clip_val=0.5)
    users = trainer.precision_plugin
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_tiny())
    assert seen["plugin"] is users and seen["precision"] == "bf16-mixed"
    assert isinstance(users, MixedPrecision) and trainer.precision_plugin is users


def test_clipping_wrapper_forwards_and_falls_back_for_optimizers_it_does_not_shard():
    from lightning.pytorch.plugins.precision import Precision

    from lightning_sdp.plugins.sdp4bit.precision import ShardedClippingPrecision

    class Recording(Precision):
        extra = "only on the wrapped plugin"

        def __init__(self) -> None:
            self.calls = []

        def clip_grad_by_norm(self, optimizer, clip_val):
            self.calls.append(("norm", clip_val))

        def clip_grad_by_value(self, optimizer, clip_val):
            self.calls.append(("value", clip_val))

        def state_dict(self):
            return {"kept": 1}

    sharded = object()
    requests = []

    def clip_shards(optimizer, kind, value):
        requests.append((kind, value))
        return optimizer is sharded

    user = Recording()
    wrapper = ShardedClippingPrecision(user, clip_shards)
    wrapper.clip_gradients(sharded, 2.0, "norm")  # type: ignore[arg-type]
    wrapper.clip_gradients(sharded, 3, "value")  # type: ignore[arg-type]
    assert requests == [("norm", 2.0), ("value", 3.0)] and user.calls == []
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    wrapper.clip_gradients(other, 1.5, "norm")
    wrapper.clip_gradients(other, 0.0, "value")  # clip_val <= 0: nothing, as Lightning's Precision
    assert user.calls == [("norm", 1.5)]
    assert wrapper.precision == "32-true" and wrapper.extra == user.extra and wrapper.state_dict() == {"kept": 1}
    with pytest.raises(TypeError, match="must not wrap itself"):
        ShardedClippingPrecision(wrapper, clip_shards)


def test_config_holds_the_checked_options():
    import dataclasses

    from lightning_sdp.plugins.sdp4bit import GradientFormat, SDP4BitConfig, WeightFormat

    strategy = SDP4BitStrategy("qw", "tlq", weight_bits=8, weight_group_size=256, log_metrics=False)
    assert strategy.config == SDP4BitConfig("qw", "tlq", weight_bits=8, weight_group_size=256, log_metrics=False)
    assert strategy.config.weight_format == WeightFormat("qw", 8, 256)
    assert strategy.config.gradient_format == GradientFormat(8, 4, None)
    assert strategy.config.weight_format.quantized and not strategy.config.weight_format.differences
    assert SDP4BitConfig(weight_compression="none").weight_format.quantized is False
    assert strategy.alignment == strategy.config.alignment == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.config.weight_bits = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match="weight_bits must be 4 or 8"):
        SDP4BitConfig(weight_bits=2)
    with pytest.raises(TypeError, match="log_metrics must be a bool"):
        SDP4BitStrategy(log_metrics="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gradients_in_hooks must be a bool"):
        SDP4BitStrategy(gradients_in_hooks="yes")  # type: ignore[arg-type]
    assert SDP4BitStrategy(optimizer_state="shard").config.optimizer_state == "shard"


def test_the_measurement_knob_is_not_an_option():
    import inspect

    params = inspect.signature(SDP4BitStrategy).parameters
    assert "align_hadamard_blocks" not in params and "log_metrics" in params
    with pytest.raises(TypeError, match="align_hadamard_blocks"):
        SDP4BitStrategy(align_hadamard_blocks=False)  # type: ignore[call-arg]


def _logging_tiny():
    class Logging(type(_tiny())):  # type: ignore[misc]
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train/loss", loss)
            return loss

    return Logging()


@pytest.mark.parametrize("log_metrics", [True, False])
def test_one_process_logs_no_sdp4bit_metrics_and_keeps_the_users_cadence(single_process_group, tmp_path, log_metrics):
    # nothing is communicated with one process: no sdp4bit/* scalars either way (several processes log them at the
    # logger's cadence: test_sdp4bit_single_process.py::test_several_processes_wrap_the_clipping_and_log_the_metrics)
    import csv

    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path)
    trainer = _trainer(SDP4BitStrategy(log_metrics=log_metrics), max_steps=6, log_every_n_steps=2, logger=logger)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_logging_tiny())
    with open(logger.experiment.metrics_file_path) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows if r["train/loss"]] == [1, 3, 5]  # the user's own metric: every 2nd step
    assert not any(c.startswith("sdp4bit/") for c in rows[0])
    assert not any(k.startswith("sdp4bit/") for k in trainer.callback_metrics)


@pytest.mark.parametrize(
    "manual,allow_any", [(False, False), (False, True), (True, False)], ids=["automatic", "allow_any", "manual"]
)
def test_a_module_without_an_optimizer_is_a_clear_error(single_process_group, manual, allow_any):
    # Lightning trains with a placeholder optimizer when configure_optimizers returns None; SDP4Bit cannot
    class NoOptimizer(type(_tiny())):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if manual:
                self.manual_backward(loss)
            return loss

        def configure_optimizers(self):
            return None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"needs an optimizer: `configure_optimizers` returned None.*Return an"):
            _trainer(SDP4BitStrategy(allow_any_optimizer=allow_any)).fit(NoOptimizer())


def test_a_module_without_configure_optimizers_gets_lightnings_error(single_process_group):
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch import LightningModule

    class NoMethod(type(_tiny())):  # type: ignore[misc]
        configure_optimizers = LightningModule.configure_optimizers  # not overridden

    with pytest.raises(MisconfigurationException, match=r"No `configure_optimizers\(\)` method defined"):
        _trainer(SDP4BitStrategy()).fit(NoMethod())


def test_parameters_live_in_the_flat_buffer_and_fall_back_to_copies():
    from lightning_sdp.plugins.sdp4bit.sharding import FlatBucket, ShardLayout

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5))]
    before = [p.detach().clone() for p in params]
    bucket = FlatBucket(params, ["w", "b"], ShardLayout(world_size=2, rank=0, alignment=8))
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    # the weight all-gather writes the flat buffer: the parameters see it without a copy
    bucket.model_flat[: bucket.numel].add_(1.0)
    assert torch.equal(params[0], before[0] + 1) and torch.equal(params[1], before[1] + 1)
    # a parameter given other storage (e.g. by user code) is copied into and out of the buffer instead
    params[1].data = torch.zeros(5)
    bucket.store_to_params()
    assert torch.equal(params[1], before[1] + 1)
    params[1].data.fill_(7.0)
    bucket.load_from_params()
    assert torch.equal(bucket.views(bucket.model_flat)[1], torch.full((5,), 7.0))
    assert torch.equal(bucket.model_flat[bucket.numel :], torch.zeros(bucket.padded - bucket.numel))  # padding
