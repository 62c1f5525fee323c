"""FastCLIP distributed reduction: 2 gloo processes give the same parameter gradient as 1 process."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_sdp.models.fastclip.distributed import GATHER_BYTES
from lightning_sdp.models.fastclip.losses import VARIANTS, build_loss
from tests._distributed import run_distributed

N, DATA, STEPS = 8, 24, 3


class _TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.img = nn.Linear(10, 6)
        self.txt = nn.Linear(7, 6)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.2)))
        self.logit_bias = nn.Parameter(torch.tensor(-2.0))  # used by siglip only

    def encode_image(self, x: torch.Tensor) -> torch.Tensor:
        return self.img(x)

    def encode_text(self, x: torch.Tensor) -> torch.Tensor:
        return self.txt(x)


def _run(variant: str, rank: int, world_size: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = _TwoTower().double()
    loss_fn = build_loss(variant, DATA, gamma=0.6, rho=1.0, lr_tau=0.05).double()
    temperature = VARIANTS[variant].temperature
    g = torch.Generator().manual_seed(1)
    grads = []
    b = N // world_size
    for _step in range(STEPS):
        x = torch.randn(N, 10, generator=g, dtype=torch.float64)
        t = x[:, :7] + 0.5 * torch.randn(N, 7, generator=g, dtype=torch.float64)
        idx = torch.randperm(DATA, generator=g)[:N]
        sl = slice(rank * b, (rank + 1) * b)
        model.zero_grad()
        e1 = F.normalize(model.encode_image(x[sl]), dim=-1)
        e2 = F.normalize(model.encode_text(t[sl]), dim=-1)
        ls = {"learnable": model.logit_scale, "constant": model.logit_scale.detach(), "individual": None}[temperature]
        out = loss_fn(e1, e2, idx[sl], ls, model.logit_bias) if variant == "siglip" else loss_fn(e1, e2, idx[sl], ls)
        out.loss.backward()
        if world_size > 1:  # what DDP does: average parameter gradients
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= world_size
        grads.append(
            {k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for k, p in model.named_parameters()}
        )
        with torch.no_grad():  # a plain SGD step so later steps see new features
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.5 * p.grad
    return {"grads": grads, "state": {k: v.clone() for k, v in loss_fn.state_dict().items()}}


def _rank_fn(rank: int, world_size: int, variants: list[str]) -> dict[str, dict[str, object]]:
    results = {}
    for variant in variants:
        GATHER_BYTES.reset()
        result = _run(variant, rank, world_size)
        # plain numpy crosses the process boundary without torch's shared-memory file descriptors
        results[variant] = {
            "grads": [{k: v.numpy() for k, v in step.items()} for step in result["grads"]],
            "state": {k: v.numpy() for k, v in result["state"].items()},
            "bytes": GATHER_BYTES.bytes_received,
        }
    # unequal local batch sizes are refused on every rank (the sizes are gathered before the features)
    loss_fn = build_loss("fastclip_v1", DATA)
    b = 3 if rank == 0 else 2
    e = F.normalize(torch.randn(b, 4), dim=1)
    try:
        loss_fn(e, e, torch.arange(b) + 10 * rank, 1.0)
        results["unequal"] = "no error"
    except ValueError as err:
        results["unequal"] = str(err)
    return results


def _variants() -> list[str]:
    from lightning_sdp._imports import _OPEN_CLIP_AVAILABLE

    return [v for v in sorted(VARIANTS) if v not in ("openclip", "siglip") or _OPEN_CLIP_AVAILABLE]


@pytest.fixture(scope="module")
def two_process_results() -> list[dict[str, dict[str, object]]]:
    """One pair of gloo processes runs every variant (spawning is the slow part)."""
    return run_distributed(_rank_fn, 2, _variants(), timeout=400)


def test_unequal_local_batch_sizes_are_refused(two_process_results):
    for r in two_process_results:
        assert "same local batch size" in r["unequal"] and "[3, 2]" in r["unequal"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_process_gradient_equals_one_process(variant, two_process_results):
    if variant in ("openclip", "siglip"):
        pytest.importorskip("open_clip")
    single = _run(variant, 0, 1)
    ranks = [r[variant] for r in two_process_results]
    for r in ranks:
        for step in range(STEPS):
            for name, grad in single["grads"][step].items():
                torch.testing.assert_close(
                    torch.from_numpy(r["grads"][step][name]),
                    grad,
                    rtol=1e-9,
                    atol=1e-12,
                    msg=f"{variant} {name} {step}",
                )
        for k, v in single["state"].items():
            torch.testing.assert_close(
                torch.from_numpy(r["state"][k]), v, rtol=1e-9, atol=1e-12, msg=f"{variant} state {k}"
            )
    if variant not in ("openclip", "siglip"):
        # the gradient of the logit scale is non-zero exactly where it is learned
        learned = VARIANTS[variant].temperature == "learnable"
        assert (float(single["grads"][0]["logit_scale"].abs()) > 0) == learned
        assert ranks[0]["bytes"] > 0  # features and estimator values went through the no-grad all-gather


MICRO = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 16, "layers": 1, "width": 16, "head_width": 8, "mlp_ratio": 1.0, "patch_size": 8},
    "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 8, "heads": 1, "layers": 1, "mlp_ratio": 1.0},
}


def _lightning_ddp(rank: int, world_size: int, root: str) -> dict[str, object]:
    import lightning.pytorch as pl

    from lightning_sdp.callbacks import GammaScheduler, TemperatureScheduler
    from lightning_sdp.datamodules import ImageTextDataModule
    from lightning_sdp.models import FastCLIPModule

    pl.seed_everything(0)
    dm = ImageTextDataModule(model=MICRO, num_train=26, num_val=8, batch_size=4, augment=False)
    module = FastCLIPModule(model=MICRO, loss="fastclip_v2", warmup_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
        callbacks=[GammaScheduler(), TemperatureScheduler()],
    )
    trainer.fit(module, dm)
    loss = module.gcl_loss
    return {
        "u1": loss.u1.numpy().copy(),
        "tau1": loss.tau1.numpy().copy(),
        "param": module.model.text_projection.detach().numpy().copy(),
        "steps": trainer.global_step,
    }


@pytest.mark.open_clip
def test_lightning_ddp_keeps_identical_estimators_on_every_rank(tmp_path):
    r0, r1 = run_distributed(_lightning_ddp, 2, str(tmp_path), init_group=False, timeout=400)
    # 26 samples, 2 ranks, drop_last: 13 per rank -> 3 local batches of 4 -> 24 distinct samples visited
    assert r0["steps"] == r1["steps"] == 3
    assert int((torch.from_numpy(r0["u1"]) > 0).sum()) == 24
    for key in ("u1", "tau1", "param"):
        assert (r0[key] == r1[key]).all(), key


# ---------------------------------------------------------------- resuming on another number of processes
RESUME_DATA, GLOBAL_BATCH = 32, 8  # 4 optimizer steps per epoch
STATE_KEYS = ("loss_fn.u1", "loss_fn.u2", "loss_fn.tau1", "loss_fn.tau2", "loss_fn.bound1", "loss_fn.m1", "loss_fn.v2")


def _resume_fit(
    world_size: int, root: str, epochs: int, ckpt: str | None = None, save: str | None = None, accumulate: int = 1
) -> dict[str, object]:
    """Train FastCLIP-v2 (per-sample estimators and temperatures) in float64 on ``world_size`` processes with the
    same global batches whatever ``world_size``; return the final state and the estimators right after loading."""
    import lightning.pytorch as pl

    from lightning_sdp.callbacks import GammaScheduler, TemperatureScheduler
    from lightning_sdp.datamodules import ImageTextDataModule
    from lightning_sdp.models import FastCLIPModule

    class _LoadedState(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = {k: v.detach().numpy().copy() for k, v in pl_module.state_dict().items() if k in STATE_KEYS}

    pl.seed_everything(0)
    batch = GLOBAL_BATCH // world_size // accumulate
    dm = ImageTextDataModule(model=MICRO, num_train=RESUME_DATA, num_val=8, batch_size=batch, augment=False)
    module = FastCLIPModule(
        model=MICRO, loss="fastclip_v2", data_size=RESUME_DATA, warmup_steps=2, lr=5e-3, max_steps=8
    )
    # float64 before the checkpoint is loaded: Lightning restores the weights before "64-true" converts the module
    module = module.double()
    loaded = _LoadedState()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy="ddp" if world_size > 1 else "auto",
        max_epochs=epochs,
        precision="64-true",
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
        callbacks=[GammaScheduler(gamma_min=0.5, decay_epochs=2), TemperatureScheduler(), loaded],
    )
    trainer.fit(module, dm, ckpt_path=ckpt)
    if save:
        trainer.save_checkpoint(save)
    return {
        "state": {k: v.detach().numpy().copy() for k, v in module.state_dict().items()},
        "loaded": loaded.state,
        "steps": trainer.global_step,
    }


def _two_ranks_resume(rank: int, world_size: int, root: str) -> dict[str, object]:
    """On 2 ranks: (a) resume the 1-process checkpoint of epoch 1 for epoch 2; (b) train epoch 1 and save it;
    (c) one epoch with gradient accumulation (2 micro-batches of 2 per rank: global batch 8)."""
    return {
        "from_one": _resume_fit(2, root, 2, ckpt=f"{root}/one.ckpt"),
        "first_epoch": _resume_fit(2, root, 1, save=f"{root}/two.ckpt"),
        "accumulated": _resume_fit(2, root, 1, accumulate=2),
    }


def _assert_state_close(ours: dict, ref: dict, what: str) -> None:
    assert ours.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(
            torch.from_numpy(ours[k]), torch.from_numpy(ref[k]), rtol=1e-9, atol=1e-12, msg=f"{what}: {k}"
        )


@pytest.mark.open_clip
def test_per_sample_state_resumes_on_another_number_of_processes(tmp_path):
    """1 -> 2 and 2 -> 1 processes. The per-sample state (u, v2's temperatures, bounds, moments) is loaded
    bit-identical on every rank, and training on continues as an uninterrupted one-process run to 1e-9 relative
    (float64: the two-process sums are taken in another order, so equality is to rounding, not to the bit)."""
    root = str(tmp_path)
    straight = _resume_fit(1, root, 2)
    _resume_fit(1, root, 1, save=f"{root}/one.ckpt")
    ranks = run_distributed(_two_ranks_resume, 2, root, init_group=False, timeout=500)
    saved_one = torch.load(f"{root}/one.ckpt", weights_only=False)["state_dict"]
    for r in ranks:  # 1 -> 2
        for k in STATE_KEYS:
            assert (r["from_one"]["loaded"][k] == saved_one[k].numpy()).all(), k
        assert r["from_one"]["steps"] == 8
        _assert_state_close(r["from_one"]["state"], straight["state"], "1 -> 2")
    back = _resume_fit(1, root, 2, ckpt=f"{root}/two.ckpt")  # 2 -> 1
    saved_two = torch.load(f"{root}/two.ckpt", weights_only=False)["state_dict"]
    for k in STATE_KEYS:
        assert (back["loaded"][k] == saved_two[k].numpy()).all(), k
        assert (ranks[0]["first_epoch"]["state"][k] == ranks[1]["first_epoch"]["state"][k]).all(), k
    _assert_state_close(back["state"], straight["state"], "2 -> 1")
    assert float(np.abs(straight["state"]["loss_fn.tau1"] - 0.03).max()) > 1e-3  # the temperatures moved
    # gradient accumulation on 2 processes: one epoch equals one epoch at the same global batch
    one_epoch = _resume_fit(1, root, 1)
    for r in ranks:
        _assert_state_close(r["accumulated"]["state"], one_epoch["state"], "accumulated on 2 ranks")
