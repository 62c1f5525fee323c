"""FastCLIPModule: Lightning training, checkpoint/resume, optimiser groups, bad input, the YAML config."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_sdp.callbacks import GammaScheduler, TemperatureScheduler
from lightning_sdp.datamodules import ImageTextDataModule
from lightning_sdp.models import FastCLIPModule
from lightning_sdp.models.fastclip.lamb import Lamb

pytestmark = pytest.mark.open_clip


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: on two shared cores OpenMP spin-waiting makes two threads several times slower."""
    torch.set_num_threads(1)


ROOT = Path(__file__).resolve().parents[2]
# a micro open_clip config keeps these Lightning runs fast on two shared cores
MICRO = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 16, "layers": 1, "width": 16, "head_width": 8, "mlp_ratio": 1.0, "patch_size": 8},
    "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 8, "heads": 1, "layers": 1, "mlp_ratio": 1.0},
}


def _dm(**kw) -> ImageTextDataModule:
    args = {"num_train": 48, "num_val": 24, "batch_size": 12, "augment": False, "seed": 3, "model": MICRO}
    args.update(kw)
    return ImageTextDataModule(**args)


def _trainer(tmp_path, max_epochs: int, **kw) -> pl.Trainer:
    args = dict(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        deterministic=True,
    )
    args.update(kw)
    return pl.Trainer(**args)


def _callbacks():
    return [GammaScheduler(gamma_min=0.3, decay_epochs=2), TemperatureScheduler()]


def test_fit_updates_estimators_gamma_and_temperature(tmp_path):
    pl.seed_everything(0)
    dm = _dm()
    module = FastCLIPModule(model=MICRO, loss="fastclip_v3", warmup_steps=2, lr_tau=0.05, rho=1.0)
    before = module.temperature
    trainer = _trainer(tmp_path, 2, callbacks=_callbacks())
    trainer.fit(module, dm)
    loss = module.gcl_loss
    assert loss.data_size == 48 == dm.data_size  # taken from the datamodule
    assert bool((loss.u1 > 0).all()) and bool((loss.u2 > 0).all())  # every sample visited (48 = 4 x 12)
    assert loss.gamma == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)) * 0.7 + 0.3)  # epoch 1 of 2
    assert module.temperature != pytest.approx(before)  # the temperature is learned
    assert 0.01 - 1e-6 <= module.temperature <= 1.0
    assert torch.isfinite(trainer.callback_metrics["train/objective"])


def test_last_batch_of_one_pair_is_dropped_by_default_and_explained_otherwise(tmp_path):
    # 25 pairs in batches of 12: the epoch's last batch holds one pair
    module = FastCLIPModule(model=MICRO, loss="fastclip_v1", warmup_steps=1)
    trainer = _trainer(tmp_path, 2, callbacks=_callbacks())
    trainer.fit(module, _dm(num_train=25))
    assert trainer.global_step == 4  # 2 full batches per epoch, the one-pair batch dropped
    kept = _dm(num_train=25, drop_last=False)
    with pytest.raises(ValueError, match=r"(?s)at least 2 pairs.*drop_last=True"):
        _trainer(tmp_path, 1).fit(FastCLIPModule(model=MICRO, loss="fastclip_v1", warmup_steps=1), kept)


@pytest.mark.parametrize("loss", ["fastclip_v3", "fastclip_v2"])
def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path, loss):
    def run(epochs: int, ckpt: str | None = None, save: str | None = None) -> FastCLIPModule:
        pl.seed_everything(0)
        module = FastCLIPModule(model=MICRO, loss=loss, warmup_steps=2, lr_tau=0.05, max_steps=8)
        trainer = _trainer(tmp_path, epochs, callbacks=_callbacks())
        trainer.fit(module, _dm(num_train=24, batch_size=8), ckpt_path=ckpt)
        if save:
            trainer.save_checkpoint(save)
        return module

    straight = run(2)
    ckpt = str(tmp_path / "half.ckpt")
    run(1, save=ckpt)
    resumed = run(2, ckpt=ckpt)
    a, b = straight.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    if loss == "fastclip_v2":
        assert {"loss_fn.tau1", "loss_fn.m1", "loss_fn.bound1"} <= set(a)


def test_load_from_checkpoint_rebuilds_estimators_and_refuses_other_loss(tmp_path):
    module = FastCLIPModule(model=MICRO, loss="fastclip_v1", warmup_steps=2)
    trainer = _trainer(tmp_path, 1, callbacks=_callbacks())
    trainer.fit(module, _dm())
    path = tmp_path / "v1.ckpt"
    trainer.save_checkpoint(path)
    loaded = FastCLIPModule.load_from_checkpoint(path)
    assert loaded.data_size == 48
    assert torch.equal(loaded.gcl_loss.u1, module.gcl_loss.u1)
    other = FastCLIPModule(model=MICRO, loss="fastclip_v3", warmup_steps=2)
    with pytest.raises(ValueError, match="loss='fastclip_v1'"):
        _trainer(tmp_path, 2).fit(other, _dm(), ckpt_path=str(path))


def test_load_from_checkpoint_of_a_module_built_from_an_nn_module_names_the_model_argument(tmp_path):
    import open_clip

    module = FastCLIPModule(model=open_clip.CLIP(**MICRO), loss="fastclip_v1", warmup_steps=2)
    trainer = _trainer(tmp_path, 1, callbacks=_callbacks(), max_steps=2)
    trainer.fit(module, _dm())
    path = tmp_path / "custom.ckpt"
    trainer.save_checkpoint(path)
    # the architecture of a module is not a hyper-parameter: say what to pass instead of a long key mismatch
    with pytest.raises(ValueError, match=r"(?s)model=<.*CLIP.*>.*load_from_checkpoint\(.*model="):
        FastCLIPModule.load_from_checkpoint(path)
    loaded = FastCLIPModule.load_from_checkpoint(path, model=open_clip.CLIP(**MICRO))
    for (name, a), b in zip(module.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("loss", ["fastclip_v3", "fastclip_v2", "openclip"])
def test_gradient_accumulation_equals_one_batch_as_large(tmp_path, loss):
    """accumulate_grad_batches=2 with batches of 6 trains as batches of 12 (as open_clip's --accum-freq): the two
    micro-batches form one contrastive batch and the estimators are updated once per optimizer step, from it."""

    def run(batch_size: int, accumulate: int) -> tuple[FastCLIPModule, pl.Trainer]:
        pl.seed_everything(0)
        module = FastCLIPModule(model=MICRO, loss=loss, warmup_steps=2, lr=5e-3, lr_tau=0.05)
        trainer = _trainer(tmp_path, 2, callbacks=_callbacks(), accumulate_grad_batches=accumulate, precision="64-true")
        trainer.fit(module, _dm(batch_size=batch_size))
        return module, trainer

    large, t_large = run(12, 1)
    accumulated, t_acc = run(6, 2)
    assert t_large.global_step == t_acc.global_step == 8  # 48 samples: 4 optimizer steps per epoch
    a, b = large.state_dict(), accumulated.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-9, atol=1e-12, msg=name)
    moved = FastCLIPModule(model=MICRO, loss=loss).double().state_dict()
    assert not torch.equal(moved["model.text_projection"], a["model.text_projection"])  # it trained
    if loss != "openclip":  # every sample's estimator was written (from the 12-pair batches)
        assert bool((accumulated.gcl_loss.u1 > 0).all())


def test_data_size_smaller_than_dataset_is_refused(tmp_path):
    module = FastCLIPModule(model=MICRO, loss="fastclip_v1", data_size=10)
    with pytest.raises(ValueError, match="data_size=10"):
        _trainer(tmp_path, 1).fit(module, _dm())


def test_datamodule_for_another_image_size_is_refused(tmp_path):
    module = FastCLIPModule(model=MICRO, loss="fastclip_v1")
    with pytest.raises(ValueError, match="32px images"):
        _trainer(tmp_path, 1).fit(module, _dm(model="tiny"))


def test_bad_model_and_loss_names():
    with pytest.raises(ValueError, match="Unknown open_clip model"):
        FastCLIPModule(model="ViT-Q-99")
    with pytest.raises(ValueError, match="Unknown FastCLIP loss"):
        FastCLIPModule(loss="clip")
    with pytest.raises(FileNotFoundError, match="local open_clip checkpoint"):
        FastCLIPModule(model="tiny", pretrained="laion2b_s34b_b79k")
    with pytest.raises(TypeError, match="encode_image"):
        FastCLIPModule(model=nn.Linear(2, 2))


class _Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.img = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 16))
        self.emb = nn.EmbeddingBag(49408, 4)
        self.proj = nn.Linear(4, 16)

    def encode_image(self, x):
        return self.img(x)

    def encode_text(self, t):
        return self.proj(self.emb(t))


def test_custom_module_and_param_groups(tmp_path):
    module = FastCLIPModule(model=_Towers(), loss="fastclip_v3", lr=1e-3, lr_tau=5e-4, weight_decay=0.2, max_steps=10)
    assert isinstance(module.logit_scale, nn.Parameter)  # own temperature for a model without one
    opt = module.configure_optimizers()["optimizer"]
    wd = [g["weight_decay"] for g in opt.param_groups]
    assert wd == [0.2, 0.0, 0.0]
    assert opt.param_groups[2]["params"][0] is module.logit_scale and opt.param_groups[2]["lr"] == 5e-4
    assert any(p is module.model.img[1].bias for p in opt.param_groups[1]["params"])
    _trainer(tmp_path, 1, callbacks=_callbacks(), max_steps=2).fit(module, _dm())
    assert int((module.gcl_loss.u1 > 0).sum()) == 24
    # DDP must not broadcast the data_size-long estimators from rank 0 on every forward
    assert {"loss_fn.u1", "loss_fn.u2"} <= set(module._ddp_params_and_buffers_to_ignore)
    # constant temperature is not trained; v1 defaults to tau = 0.07
    fixed = FastCLIPModule(model=MICRO, loss="fastclip_v1")
    assert not fixed.model.logit_scale.requires_grad and fixed.temperature == pytest.approx(0.07)
    names = [n for g in fixed.configure_optimizers()["optimizer"].param_groups for n in g["params"]]
    assert not any(p is fixed.model.logit_scale for p in names)


def test_training_step_before_setup_explains_the_missing_loss():
    module = FastCLIPModule(model=_Towers(), loss="fastclip_v3")  # no data_size: the loss is built in setup
    assert module.loss_fn is None
    batch = (torch.randn(2, 3, 16, 16), torch.randint(0, 49408, (2, 5)), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match=r"built in setup\(\).*data_size=len\(train_set\)"):
        module.training_step(batch, 0)


def test_lamb_step_matches_formula():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 3))
    w0 = w.detach().clone()
    g = torch.randn(4, 3)
    w.grad = g.clone()
    Lamb([w], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01).step()
    update = (0.1 * g / 0.1) / ((0.01 * g * g / 0.01).sqrt() + 1e-6) + 0.01 * w0
    expected = w0 - 0.1 * (w0.norm() / update.norm()) * update
    torch.testing.assert_close(w.detach(), expected)
    module = FastCLIPModule(model=MICRO, optimizer="lamb", max_steps=5)
    assert isinstance(module.configure_optimizers()["optimizer"], Lamb)


def test_lamb_matches_timm_lamb_trust_ratio_only_with_weight_decay():
    """As the official code and timm: no trust ratio on tensors without weight decay (biases, logit_scale)."""
    timm_optim = pytest.importorskip("timm.optim")
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3)), nn.Parameter(torch.tensor(2.6))]
    twins = [nn.Parameter(p.detach().clone()) for p in params]

    def groups(ps):
        return [{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0}]

    ours = Lamb(groups(params), lr=0.05, betas=(0.9, 0.98), eps=1e-6)
    timm = timm_optim.Lamb(groups(twins), lr=0.05, betas=(0.9, 0.98), eps=1e-6, max_grad_norm=None)
    for _ in range(3):
        for p, q in zip(params, twins, strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        ours.step()
        timm.step()
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_one_source_of_defaults_per_variant():
    from lightning_sdp.models.fastclip.losses import DEFAULT_RHO, DEFAULT_TEMPERATURE, build_loss

    for name, objective in (("fastclip_v2", "rgcl"), ("isogclr", "rgcl"), ("fastclip_v3", "rgcl_g")):
        module = FastCLIPModule(model=MICRO, loss=name, data_size=10)
        assert module.rho == module.gcl_loss.rho == build_loss(name, 10).rho == DEFAULT_RHO[objective]
    v2 = FastCLIPModule(model=MICRO, loss="fastclip_v2", data_size=10)
    assert float(v2.gcl_loss.tau1[0]) == pytest.approx(DEFAULT_TEMPERATURE["individual"])
    assert float(build_loss("fastclip_v2", 10).tau1[0]) == pytest.approx(DEFAULT_TEMPERATURE["individual"])
    assert v2.gcl_loss.temperature_gradient == "reference"
    exact = FastCLIPModule(model=MICRO, loss="fastclip_v3", data_size=10, temperature_gradient="exact")
    assert exact.gcl_loss.temperature_gradient == "exact"
    with pytest.raises(ValueError, match="temperature_gradient"):
        FastCLIPModule(model=MICRO, loss="fastclip_v3", temperature_gradient="approx")


def test_siglip_peer_trains_temperature_and_bias(tmp_path):
    module = FastCLIPModule(model=MICRO, loss="siglip", warmup_steps=1, lr=5e-3)
    assert float(module.logit_bias_parameter().detach()) == -10.0
    assert module.temperature == pytest.approx(0.1)
    assert module.gcl_loss is None and module.data_size is None
    bias0 = float(module.logit_bias_parameter().detach())
    _trainer(tmp_path, 1).fit(module, _dm())
    assert float(module.logit_bias_parameter().detach()) != bias0
    assert module.temperature != pytest.approx(0.1)
    names = [n for n, _ in module.named_parameters()]
    assert "logit_bias" in names


def test_yaml_config_trains_two_steps(tmp_path):
    from lightning_sdp.cli import main

    main(
        [
            "fit",
            "--config",
            str(ROOT / "examples" / "configs" / "fastclip_tiny.yaml"),
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=1",
            "--trainer.val_check_interval=2",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--data.init_args.num_train=32",
            "--data.init_args.num_val=16",
            "--data.init_args.batch_size=8",
        ]
    )
    ckpts = list(tmp_path.rglob("*.ckpt"))
    assert ckpts
    state = torch.load(ckpts[0], weights_only=False)
    assert state["global_step"] == 2
    assert int((state["state_dict"]["loss_fn.u1"] > 0).sum()) == 16  # two batches of 8 visited
