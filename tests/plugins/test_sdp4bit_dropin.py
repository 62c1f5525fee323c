"""SDP4BitStrategy as a drop-in for ``strategy="ddp"``.

One launch of 2 gloo processes runs every multi-process scenario next to Lightning's ``ddp`` on the same model and
data: frozen and unused parameters, zero gradients next to non-zero ones, manual optimization with
``clip_gradients``, ``grad_norm`` at ``on_before_optimizer_step``, ``BackboneFinetuning`` adding a param group,
gradients too large to quantise, and the process groups left behind by each ``fit``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests._distributed import run_distributed

WORLD, STEPS, LR = 2, 10, 1e-2


def _data(n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, torch.sin(x[:, :2] * 3))


def _loader(module) -> DataLoader:
    """Rank r of W sees samples r, r + W, ... in batches of 8 / W: the same global batches for any W."""
    trainer = module.trainer
    sampler = DistributedSampler(_data(), num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
    return DataLoader(_data(), batch_size=8 // trainer.world_size, sampler=sampler)


def _module(
    optimizer: str = "adamw", manual_clip: float | None = None, huge_grad_at: int | None = None, hook: str = "sdp"
):
    """A small net with a frozen layer, a parameter no rank uses, and one whose gradient is exactly zero.

    ``hook``: what ``on_before_optimizer_step`` does: ``"sdp"`` records ``lightning_sdp``'s ``grad_norm``;
    ``"lightning"`` records Lightning's own ``grad_norm`` and halves ``l2.weight``'s gradient in place (as a user's
    hook may), which reads and edits the parameters' ``.grad``.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    from lightning_sdp.plugins.sdp4bit import grad_norm

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.l1 = nn.Linear(4, 5)  # 25 values: what follows does not start on a Hadamard block
            self.zero = nn.Parameter(torch.randn(7))  # used with weight 0: gradient exactly zero, not None
            self.frozen = nn.Linear(3, 3)
            self.frozen.requires_grad_(False)
            self.unused = nn.Parameter(torch.randn(5))  # never used: gradient None on every rank
            self.l2 = nn.Linear(5, 2)
            self.norms: list[dict[str, float]] = []
            self.automatic_optimization = manual_clip is None

        def forward(self, x):
            return self.l2(torch.tanh(self.l1(x)) + 0.0 * self.zero.sum())

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            if manual_clip is not None:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                self.clip_gradients(opt, gradient_clip_val=manual_clip, gradient_clip_algorithm="norm")
                opt.step()
            return loss

        def on_after_backward(self):
            if huge_grad_at is not None and self.global_step == huge_grad_at and self.global_rank == 0:
                self.l1.weight.grad.fill_(1e38)  # finite, but 32 of them summed by the Hadamard transform are not

        def on_before_optimizer_step(self, optimizer):
            if hook == "sdp":
                self.norms.append({k: float(v) for k, v in grad_norm(self, 2).items()})
                return
            self.norms.append({k: float(v) for k, v in lightning_grad_norm(self, 2).items()})
            if self.l2.weight.grad is not None:
                self.l2.weight.grad.mul_(0.5)

        def configure_optimizers(self):
            params = list(self.parameters())
            if optimizer == "sgd":
                return torch.optim.SGD(params, lr=LR * 10, momentum=0.9, weight_decay=0.1)
            if optimizer == "adam":
                return torch.optim.Adam(params, lr=LR)
            return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)

        def train_dataloader(self):
            return _loader(self)

    return Net()


def _finetune_module():
    import lightning.pytorch as pl

    class MyAdamW(torch.optim.AdamW):  # a user's optimizer subclass
        pass

    class Finetune(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.backbone = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
            self.head = nn.Linear(6, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.head(self.backbone(x)), y)

        def configure_optimizers(self):
            return MyAdamW([p for p in self.parameters() if p.requires_grad], lr=LR)

        def train_dataloader(self):
            return _loader(self)

    return Finetune()


def _trainer(strategy, max_steps: int = STEPS, devices: int = WORLD, **kwargs):
    import lightning.pytorch as pl

    return pl.Trainer(
        strategy=strategy, devices=devices, accelerator="cpu", max_steps=max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, **kwargs,
    )  # fmt: skip


def _fit(module, strategy, max_steps: int = STEPS, devices: int = WORLD, **kwargs):
    trainer = _trainer(strategy, max_steps, devices, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    return trainer


def _state(module) -> dict[str, np.ndarray]:
    return {n: p.detach().clone().numpy() for n, p in module.named_parameters()}


def _run(rank: int, world: int) -> dict:
    from lightning.pytorch.callbacks import BackboneFinetuning
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.distributed_c10d import _world

    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy

    def ddp():
        return DDPStrategy(find_unused_parameters=True)

    def sdp(*modes, **kwargs):
        return SDP4BitStrategy(*(modes or ("qwd", "tlq_hs")), weight_group_size=256, **kwargs)

    out: dict = {"init": _state(_module())}
    # items 1 and 4: frozen / unused parameters with AdamW (weight decay) and SGD (momentum); grad_norm at the hook
    for opt in ("adamw", "sgd"):
        for name, strategy in (("ddp", ddp()), ("sdp", sdp()), ("none", sdp("none", "none"))):
            module = _module(opt)
            _fit(module, strategy)
            out[f"{opt}/{name}"] = _state(module)
            out[f"{opt}/{name}/norms"] = module.norms
        if opt == "adamw":
            out["pg_after_first_fits"] = len(_world.pg_map)
    out["pg_after_all_fits"] = len(_world.pg_map)
    # Lightning's grad_norm and an in-place edit of .grad in on_before_optimizer_step
    for name, strategy in (("ddp", ddp()), ("sdp", sdp()), ("none", sdp("none", "none"))):
        module = _module("adamw", hook="lightning")
        _fit(module, strategy)
        out[f"hook/{name}"] = _state(module)
        out[f"hook/{name}/norms"] = module.norms
    module = _module("adamw", hook="lightning")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(sdp("none", "none", gradients_in_hooks=False)).fit(module)
    out["hook/off/norms"] = module.norms
    out["hook/off/warnings"] = [str(w.message) for w in caught if "gradients_in_hooks=False" in str(w.message)]
    # item 2: Adam, a parameter whose gradient is exactly zero, default compression (qwd + tlq_hs)
    module = _module("adam")
    _fit(module, sdp(), max_steps=20)
    out["adam_zero/sdp"] = _state(module)
    # item 3: manual optimization with self.clip_gradients
    for name, strategy in (("ddp", ddp()), ("none", sdp("none", "none"))):
        module = _module("adamw", manual_clip=0.01)
        _fit(module, strategy)
        out[f"manual/{name}"] = _state(module)
    # item 5: BackboneFinetuning adds a param group at epoch 1 (5 steps per epoch); a user's AdamW subclass. The
    # reference is one process on the global batch: DDP itself never synchronises parameters that were frozen when
    # it wrapped the model, so its ranks drift apart after unfreezing.
    for name, strategy, devices in (("single", "auto", 1), ("none", sdp("none", "none"), WORLD)):
        module = _finetune_module()
        callbacks = [BackboneFinetuning(1, verbose=False)]
        trainer = _fit(module, strategy, max_steps=-1, max_epochs=3, devices=devices, callbacks=callbacks)
        out[f"finetune/{name}"] = _state(module)
        out[f"finetune/{name}/groups"] = len(trainer.optimizers[0].param_groups)
        if name == "none":
            consolidated = strategy.optimizer_state(trainer.optimizers[0])
            out["finetune/ckpt_groups"] = [g["params"] for g in consolidated["param_groups"]]
    # item 6: a finite gradient near the fp32 limit: too large to quantise, exchanged uncompressed instead
    for name, strategy in (("sdp", sdp()), ("none", sdp("none", "none"))):
        module = _module("sgd", huge_grad_at=2)
        _fit(module, strategy, max_steps=4)
        out[f"huge/{name}"] = _state(module)
        out[f"huge/{name}/skipped"] = strategy.skipped_steps
        out[f"huge/{name}/redone"] = strategy.redone_uncompressed
    return out


@pytest.fixture(scope="module")
def two():
    return run_distributed(_run, WORLD, timeout=600, init_group=False)


TRAINED = ("l1.weight", "l1.bias", "l2.weight", "l2.bias")


@pytest.mark.slow
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_frozen_and_unused_parameters_are_left_alone(two, opt):
    for res in two:
        init = res["init"]
        for name in ("frozen.weight", "frozen.bias", "unused"):
            assert np.array_equal(res[f"{opt}/ddp"][name], init[name])  # what DDP does
            assert np.array_equal(res[f"{opt}/sdp"][name], init[name]), name
            assert np.array_equal(res[f"{opt}/none"][name], init[name]), name
        for name in (*TRAINED, "zero"):  # the rest trains as under DDP (exact exchange: up to rounding)
            np.testing.assert_allclose(res[f"{opt}/none"][name], res[f"{opt}/ddp"][name], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_zero_gradient_next_to_nonzero_ones_stays_exactly_zero(two):
    for res in two:
        # Adam turns any noise into full-size steps; the zero-gradient parameter shares no Hadamard block now
        assert np.array_equal(res["adam_zero/sdp"]["zero"], res["init"]["zero"])
        assert not np.array_equal(res["adam_zero/sdp"]["l1.weight"], res["init"]["l1.weight"])


@pytest.mark.slow
def test_manual_optimization_clips_the_reduced_gradient(two):
    for res in two:
        for name in TRAINED:
            np.testing.assert_allclose(res["manual/none"][name], res["manual/ddp"][name], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_grad_norm_at_on_before_optimizer_step_matches_ddp(two):
    for res in two:
        ddp, ours = res["adamw/ddp/norms"], res["adamw/none/norms"]
        assert len(ddp) == len(ours) == STEPS
        assert len(ddp[0]) >= 6 and set(ddp[0]) == set(ours[0])
        for a, b in zip(ddp, ours, strict=True):
            for key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), key
        # compressed: the same keys, values close to the exact ones
        assert set(res["adamw/sdp/norms"][0]) == set(ddp[0])


@pytest.mark.slow
def test_the_gradients_are_visible_and_editable_at_on_before_optimizer_step(two):
    for res in two:
        ddp, ours, paper = res["hook/ddp/norms"], res["hook/none/norms"], res["hook/sdp/norms"]
        assert len(ddp) == len(ours) == len(paper) == STEPS
        # Lightning's own grad_norm: the same keys as under DDP (every trained parameter), the same values
        assert len(ddp[0]) >= 6 and set(ours[0]) == set(paper[0]) == set(ddp[0])
        for a, b in zip(ddp, ours, strict=True):
            for key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), key
        # the in-place edit of l2.weight's gradient reached the step, as under DDP
        for name in TRAINED:
            np.testing.assert_allclose(res["hook/none"][name], res["hook/ddp"][name], rtol=1e-4, atol=1e-6)
        # switched off: .grad stays None there (Lightning's grad_norm finds nothing), and a warning says so once
        assert all(norms == {} for norms in res["hook/off/norms"])
        assert len(res["hook/off/warnings"]) == (1 if res is two[0] else 0)  # rank zero


@pytest.mark.slow
def test_backbone_finetuning_adds_a_param_group(two):
    for res in two:
        assert res["finetune/single/groups"] == res["finetune/none/groups"] == 2
        assert res["finetune/ckpt_groups"] == [[0, 1], [2, 3]]
        for name, value in res["finetune/single"].items():
            np.testing.assert_allclose(res["finetune/none"][name], value, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_gradients_too_large_to_quantise_are_exchanged_uncompressed(two):
    for res in two:
        # 32 such values summed by the Hadamard transform overflow fp32: the divergence guard sends that step's
        # gradients uncompressed (where they fit), on every rank, instead of failing or skipping the step
        assert res["huge/sdp/skipped"] == 0 and res["huge/sdp/redone"] == 1
        assert all(np.isfinite(v).all() for v in res["huge/sdp"].values())
        # without compression nothing overflows: the step is taken, as before
        assert res["huge/none/skipped"] == 0 and res["huge/none/redone"] == 0


@pytest.mark.slow
def test_fits_do_not_leak_process_groups(two):
    for res in two:
        assert res["pg_after_all_fits"] == res["pg_after_first_fits"]


# ------------------------------------------------------------------------------------------------ single process


def test_subclassed_optimizers_are_accepted_and_unshardable_ones_explained():
    from lightning_sdp.plugins.sdp4bit.sharding import check_optimizer

    class MyAdamW(torch.optim.AdamW):
        pass

    class Lion(torch.optim.Optimizer):
        def __init__(self, params) -> None:
            super().__init__(params, {"lr": 1e-3})

    p = [nn.Parameter(torch.zeros(2))]
    check_optimizer(MyAdamW(p))
    with pytest.raises(ValueError, match="allow_any_optimizer=True"):
        check_optimizer(Lion(p))
    check_optimizer(Lion(p), allow_any=True)
    with pytest.raises(ValueError, match="re-evaluates the closure"):
        check_optimizer(torch.optim.LBFGS(p), allow_any=True)
    with pytest.raises(ValueError, match="sparse gradients"):
        check_optimizer(torch.optim.SparseAdam(p))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"seed": "abc"}, TypeError, "seed must be an int"),
        ({"weight_group_size": 2**24}, ValueError, "at most 65536"),
        ({"gradient_group_size": 2**20, "hadamard_size": 2**20}, ValueError, "at most"),
        ({"weight_bits": 4.0}, TypeError, "weight_bits must be an int"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy

    with pytest.raises(error, match=match):
        SDP4BitStrategy(**kwargs)


def test_no_trainable_parameter_is_a_clear_error(monkeypatch):
    import torch.distributed as dist
    from lightning.pytorch import LightningModule, Trainer

    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy
    from tests._distributed import find_free_port

    class Frozen(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 2).requires_grad_(False)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    trainer = Trainer(
        strategy=SDP4BitStrategy(), devices=1, accelerator="cpu", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ValueError, match="nothing to train"):
                trainer.fit(Frozen())
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
