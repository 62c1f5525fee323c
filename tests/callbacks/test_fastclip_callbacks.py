"""GammaScheduler, TemperatureScheduler and ZeroShotEvaluation on small stand-ins."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_sdp.callbacks import GammaScheduler, TemperatureScheduler, ZeroShotEvaluation
from lightning_sdp.callbacks.fastclip import gamma_at
from lightning_sdp.models.fastclip.losses import VARIANTS, GlobalContrastiveLoss, build_loss


class _Stub(nn.Module):
    """The parts of FastCLIPModule the callbacks use."""

    def __init__(self, variant: str, data_size: int = 8) -> None:
        super().__init__()
        self.variant = VARIANTS[variant]
        v = self.variant
        self.gcl_loss = (
            GlobalContrastiveLoss(data_size, objective=v.objective, temperature=v.temperature)
            if v.objective != "mbcl"
            else None
        )
        self.scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.register_buffer("tau_lr_factor", torch.tensor(1.0))
        self.logged: dict[str, float] = {}

    def logit_scale_parameter(self) -> nn.Parameter:
        return self.scale

    def log(self, name: str, value: float, **kwargs) -> None:
        self.logged[name] = float(value)


def test_gamma_schedule_values():
    assert gamma_at(0, 0.2, 10, "cosine") == 1.0
    assert gamma_at(5, 0.2, 10, "cosine") == pytest.approx(0.5 * 0.8 + 0.2)
    assert gamma_at(1, 0.2, 10, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 10)) * 0.8 + 0.2)
    assert gamma_at(10, 0.2, 10, "cosine") == gamma_at(25, 0.2, 10, "cosine") == 0.2
    assert gamma_at(0, 0.9, 10, "constant") == 1.0 and gamma_at(3, 0.9, 10, "constant") == 0.9
    values = [gamma_at(e, 0.3, 6, "cosine") for e in range(8)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))  # non-increasing


@pytest.mark.parametrize(("variant", "expected"), [("fastclip_v1", 0.6), ("sogclr", 0.2)])
def test_gamma_scheduler_sets_the_loss_and_round_trips(variant, expected):
    module = _Stub(variant)
    cb = GammaScheduler(gamma_min=0.2, decay_epochs=4)
    cb.on_train_epoch_start(SimpleNamespace(current_epoch=2), module)
    assert module.gcl_loss.gamma == pytest.approx(expected)
    assert module.gcl_loss.epoch == 2  # v2's official temperature update reads it
    assert module.logged["train/gamma_epoch"] == pytest.approx(expected)
    restored = GammaScheduler(gamma_min=0.2, decay_epochs=4)
    restored.load_state_dict(cb.state_dict())
    assert restored.gamma == pytest.approx(expected) and restored.epoch == 2
    GammaScheduler().on_train_epoch_start(SimpleNamespace(current_epoch=3), _Stub("openclip"))  # no-op
    with pytest.raises(ValueError, match="gamma_min"):
        GammaScheduler(gamma_min=0.0)


def test_temperature_scheduler_clamps_and_applies_v3_threshold_rule():
    module = _Stub("fastclip_v3")
    cb = TemperatureScheduler(tau_min=0.01, step_thresh=0.03)
    trainer = SimpleNamespace(global_step=1, log_every_n_steps=1)
    with torch.no_grad():
        module.scale.fill_(math.log(250.0))  # tau = 0.004 < 0.01
    cb.on_train_batch_end(trainer, module, None, None, 0)
    assert float(module.scale.detach()) == pytest.approx(math.log(100.0))
    assert module.logged["train/tau"] == pytest.approx(0.01)
    assert cb.switched and float(module.tau_lr_factor) == pytest.approx(1 / 3)
    restored = TemperatureScheduler()
    restored.load_state_dict(cb.state_dict())
    assert restored.switched
    # v1's constant temperature: clamped and logged, no learning-rate rule
    other = _Stub("fastclip_v1")
    with torch.no_grad():
        other.scale.fill_(-1.0)  # tau = e > 1
    TemperatureScheduler().on_train_batch_end(trainer, other, None, None, 0)
    assert float(other.scale.detach()) == 0.0 and float(other.tau_lr_factor) == 1.0


def test_v3_lr_tau_rule_is_rechecked_every_step():
    """lr_tau x 1/3 while tau <= step_thresh, back to lr_tau when tau rises above it (not latched)."""
    module = _Stub("fastclip_v3")
    cb = TemperatureScheduler(tau_min=0.01, step_thresh=0.03)
    trainer = SimpleNamespace(global_step=1, log_every_n_steps=1)
    with torch.no_grad():
        module.scale.fill_(math.log(1 / 0.02))
    cb.on_train_batch_end(trainer, module, None, None, 0)
    assert float(module.tau_lr_factor) == pytest.approx(1 / 3)
    with torch.no_grad():
        module.scale.fill_(math.log(1 / 0.05))
    cb.on_train_batch_end(trainer, module, None, None, 1)
    assert float(module.tau_lr_factor) == 1.0 and not cb.switched


def test_temperature_scheduler_logs_individual_temperature_spread():
    module = _Stub("fastclip_v2")
    loss = module.gcl_loss
    loss.tau_steps[:4] = 1
    loss.tau1[:4] = torch.tensor([0.01, 0.02, 0.03, 0.04])
    TemperatureScheduler().on_train_batch_end(
        SimpleNamespace(global_step=0, log_every_n_steps=1), module, None, None, 0
    )
    assert module.logged["train/tau_min"] == pytest.approx(0.01)
    assert module.logged["train/tau_max"] == pytest.approx(0.04)
    assert module.logged["train/tau"] == pytest.approx((0.1 + 4 * 0.03) / 8)


class _Encoder:
    """encode_texts: class prompts map to one-hot directions ('c3' -> e_3)."""

    training = False

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def encode_texts(self, texts):
        out = torch.zeros(len(texts), self.dim)
        for i, t in enumerate(texts):
            out[i, int(t.split("c")[1].split(" ")[0])] = 1.0
        return out

    def eval(self):
        return self

    def train(self, mode=True):
        return self


def test_zero_shot_and_retrieval_metrics():
    n, dim = 12, 6
    labels = torch.arange(n) % dim
    img = F.one_hot(labels, dim).float()
    val_set = SimpleNamespace(
        labels=labels,
        classnames=[f"c{i}" for i in range(dim)],
        templates=["{} thing", "a {}"],
        caption_groups=torch.arange(n),
    )
    cb = ZeroShotEvaluation(top_k=(1, 5), recall_k=(1, 5))
    txt = F.normalize(img + 0.01 * torch.arange(n)[:, None].float(), dim=1)  # ties broken towards larger index
    m = cb.compute(_Encoder(dim), img, txt, torch.arange(n), val_set)
    assert m["val/zeroshot_top1"] == 1.0 and m["val/zeroshot_top5"] == 1.0
    # each image matches two captions of its class equally well; R@1 finds the right one for about half
    assert 0.4 <= m["val/i2t_r1"] <= 0.6 and m["val/i2t_r5"] == 1.0
    # identical captions count as hits: with groups by class every retrieval is right
    val_set.caption_groups = labels.clone()
    m = cb.compute(_Encoder(dim), img, txt, torch.arange(n), val_set)
    assert m["val/i2t_r1"] == 1.0 and m["val/t2i_r1"] == 1.0
    # wrong labels lower the zero-shot accuracy
    val_set.labels = (labels + 1) % dim
    assert cb.compute(_Encoder(dim), img, txt, torch.arange(n), val_set)["val/zeroshot_top1"] == 0.0
    # no class names: retrieval only
    m = ZeroShotEvaluation().compute(_Encoder(dim), img, txt, torch.arange(n), SimpleNamespace(caption_groups=labels))
    assert "val/zeroshot_top1" not in m and m["val/t2i_r1"] == 1.0


@pytest.mark.open_clip
def test_zero_shot_classifier_comes_from_open_clip_and_takes_callable_templates(monkeypatch):
    import open_clip

    calls = []
    real = open_clip.build_zero_shot_classifier

    def spy(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(open_clip, "build_zero_shot_classifier", spy)
    n, dim = 12, 6
    labels = torch.arange(n) % dim
    img = F.one_hot(labels, dim).float()
    val_set = SimpleNamespace(labels=labels, classnames=[f"c{i}" for i in range(dim)], caption_groups=labels)
    cb = ZeroShotEvaluation(templates=[lambda c: f"{c} drawn", "a {}"])  # open_clip accepts callables too
    m = cb.compute(_Encoder(dim), img, img, torch.arange(n), val_set)
    assert m["val/zeroshot_top1"] == 1.0
    assert len(calls) == 1 and len(calls[0]) == 2


# ----------------------------------------------------------------- the callbacks on a user's own LightningModule
class _Pairs(Dataset):
    """16 random (image vector, text vector, index) pairs."""

    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.t = torch.randn(n, 6, generator=g), torch.randn(n, 5, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.t[i], i


class _PlainCLIP(pl.LightningModule):
    """A user's own CLIP module written without lightning-sdp in mind: two linear towers, OpenCLIP's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.img, self.txt = nn.Linear(6, 4), nn.Linear(5, 4)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.steps = 0

    def encode(self, x, t):
        return F.normalize(self.img(x), dim=-1), F.normalize(self.txt(t), dim=-1)

    def training_step(self, batch, batch_idx):
        self.steps += 1
        e1, e2 = self.encode(batch[0], batch[1])
        logits = self.logit_scale.exp() * e1 @ e2.T
        labels = torch.arange(len(e1))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _ProtocolCLIP(_PlainCLIP):
    """The same module with what GammaModule and TemperatureModule ask for, on FastCLIP-v3's loss."""

    variant = VARIANTS["fastclip_v3"]

    def __init__(self, data_size: int = 16) -> None:
        super().__init__()
        self.loss_fn = build_loss("fastclip_v3", data_size)
        self.register_buffer("tau_lr_factor", torch.tensor(1.0))

    @property
    def gcl_loss(self):
        return self.loss_fn

    def logit_scale_parameter(self):
        return self.logit_scale

    def training_step(self, batch, batch_idx):
        self.steps += 1
        e1, e2 = self.encode(batch[0], batch[1])
        return self.loss_fn(e1, e2, batch[2], self.logit_scale).loss


def _fit(module, callbacks, tmp_path, max_epochs: int = 1, accumulate: int = 1):
    trainer = pl.Trainer(
        accumulate_grad_batches=accumulate,
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
    )
    trainer.fit(module, DataLoader(_Pairs(), batch_size=8, drop_last=True))
    return trainer


@pytest.mark.parametrize(
    ("callback", "protocol", "missing"),
    [
        (GammaScheduler(), "GammaModule", ["'gcl_loss'", "'variant.gamma_schedule'"]),
        (TemperatureScheduler(), "TemperatureModule", ["'variant.temperature'", "'variant.objective'"]),
    ],
    ids=["gamma", "temperature"],
)
def test_callbacks_refuse_a_module_without_their_protocol_at_setup(callback, protocol, missing, tmp_path):
    module = _PlainCLIP()
    with pytest.raises(TypeError, match=rf"follows lightning_sdp\.callbacks\.fastclip\.{protocol}") as err:
        _fit(module, [callback], tmp_path)
    assert all(name in str(err.value) for name in missing), str(err.value)
    assert "_PlainCLIP" in str(err.value)
    assert module.steps == 0  # refused before any training step, not silently ignored or crashed mid-epoch


def test_temperature_scheduler_names_a_missing_logit_scale_parameter(tmp_path):
    module = _PlainCLIP()
    module.variant = VARIANTS["openclip"]  # has a variant, but no logit_scale_parameter()
    with pytest.raises(TypeError, match=r"'logit_scale_parameter\(\)'"):
        _fit(module, [TemperatureScheduler()], tmp_path)
    gamma = GammaScheduler(schedule="cosine")  # no variant needed with an explicit schedule; gcl_loss still is
    with pytest.raises(TypeError, match=r"lacks 'gcl_loss' \("):
        _fit(_PlainCLIP(), [gamma], tmp_path)


def test_callbacks_work_on_a_users_module_that_follows_the_protocols(tmp_path):
    module = _ProtocolCLIP()
    with torch.no_grad():
        module.logit_scale.fill_(math.log(50.0))  # tau = 0.02: below tau_min and v3's step threshold
    gamma = GammaScheduler(gamma_min=0.2, decay_epochs=2)
    temp = TemperatureScheduler(tau_min=0.025, step_thresh=0.03)
    with pytest.warns(UserWarning, match="nothing reads tau_lr_factor"):  # its single SGD group ignores the factor
        _fit(module, [gamma, temp], tmp_path, max_epochs=2)
    assert module.steps == 4
    assert module.loss_fn.gamma == pytest.approx(gamma_at(1, 0.2, 2, "cosine"))
    assert float(module.logit_scale.detach()) <= math.log(40.0) + 1e-6
    assert temp.switched and float(module.tau_lr_factor) == pytest.approx(1 / 3)


def test_callbacks_use_only_public_attributes_of_the_module():
    """The callbacks read the module through its public protocol (``logit_scale_parameter()``, ``gcl_loss``, ...)."""
    import ast
    from pathlib import Path

    import lightning_sdp.callbacks.fastclip as callbacks

    private = [
        f"{node.value.id}.{node.attr} (line {node.lineno})"
        for node in ast.walk(ast.parse(Path(callbacks.__file__).read_text()))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in ("pl_module", "module") and node.attr.startswith("_")
    ]  # fmt: skip
    assert private == []


class _ReadingCLIP(_ProtocolCLIP):
    """The same module with the temperature in its own parameter group, whose learning rate follows tau_lr_factor."""

    def configure_optimizers(self):
        others = [p for name, p in self.named_parameters() if name != "logit_scale"]
        opt = torch.optim.SGD([{"params": others}, {"params": [self.logit_scale]}], lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda step: 1.0, lambda step: float(self.tau_lr_factor)])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _tau_lr_factor_warnings(module, tmp_path, monkeypatch, accumulate: int = 1) -> tuple[list[str], list[int]]:
    """Messages about tau_lr_factor from a 2-epoch fit that starts at tau = 0.02, below v3's step threshold (the
    rule switches after the first step), and how many times the scheduler checked the learning rate."""
    checks: list[int] = []
    check = TemperatureScheduler._warn_if_lr_ignored_factor

    def counted(self, trainer, pl_module):
        checks.append(trainer.global_step)
        return check(self, trainer, pl_module)

    monkeypatch.setattr(TemperatureScheduler, "_warn_if_lr_ignored_factor", counted)
    with torch.no_grad():
        module.logit_scale_parameter().fill_(math.log(50.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler = TemperatureScheduler(tau_min=0.01, step_thresh=0.03)
        _fit(module, [scheduler], tmp_path, max_epochs=2 * accumulate, accumulate=accumulate)
    return [str(w.message) for w in caught if "tau_lr_factor" in str(w.message)], checks


def test_temperature_scheduler_warns_once_when_nothing_reads_tau_lr_factor(tmp_path, monkeypatch):
    module = _ProtocolCLIP()  # has tau_lr_factor, but one SGD group with a fixed lr: the v3 rule does nothing
    messages, checks = _tau_lr_factor_warnings(module, tmp_path, monkeypatch)
    assert float(module.tau_lr_factor) == pytest.approx(1 / 3)
    assert len(messages) == 1 and checks == [2], (messages, checks)
    assert "_ProtocolCLIP.tau_lr_factor" in messages[0] and "did not follow" in messages[0]
    assert "float(module.tau_lr_factor)" in messages[0] and "step_thresh=None" in messages[0]


def test_temperature_scheduler_is_quiet_when_the_learning_rate_follows_tau_lr_factor(tmp_path, monkeypatch):
    module = _ReadingCLIP()
    messages, checks = _tau_lr_factor_warnings(module, tmp_path, monkeypatch)
    assert messages == [] and checks == [2]  # checked one step after the switch, and it followed
    assert module.trainer.optimizers[0].param_groups[1]["lr"] == pytest.approx(0.01 / 3)


def test_temperature_scheduler_acts_after_optimizer_steps_not_micro_batches(tmp_path, monkeypatch):
    """With gradient accumulation the clamp, the v3 rule and its one-step-later check follow optimizer steps."""
    module = _ReadingCLIP()
    messages, checks = _tau_lr_factor_warnings(module, tmp_path, monkeypatch, accumulate=2)
    assert messages == [] and checks == [2], (messages, checks)


@pytest.mark.open_clip
def test_temperature_scheduler_is_quiet_on_fastclip_module(tmp_path, monkeypatch):
    from lightning_sdp.datamodules import ImageTextDataModule
    from lightning_sdp.models import FastCLIPModule

    micro = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 16, "layers": 1, "width": 16, "head_width": 8, "mlp_ratio": 1.0, "patch_size": 8},
        "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 8, "heads": 1, "layers": 1, "mlp_ratio": 1.0},
    }
    module = FastCLIPModule(model=micro, loss="fastclip_v3", warmup_steps=1, temperature=0.02, max_steps=6)
    dm = ImageTextDataModule(model=micro, num_train=24, num_val=8, batch_size=8, augment=False)
    checks: list[int] = []
    check = TemperatureScheduler._warn_if_lr_ignored_factor
    monkeypatch.setattr(
        TemperatureScheduler, "_warn_if_lr_ignored_factor", lambda self, t, m: checks.append(1) or check(self, t, m)
    )
    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
        callbacks=[GammaScheduler(decay_epochs=1), TemperatureScheduler(step_thresh=0.03)],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, dm)
    assert [str(w.message) for w in caught if "tau_lr_factor" in str(w.message)] == []
    assert checks == [1] and float(module.tau_lr_factor) == pytest.approx(1 / 3)
