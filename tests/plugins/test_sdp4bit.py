"""SDP4BitStrategy inside Lightning: equivalence with single-process training, checkpoints, logging, bad input.

Multi-process tests start 4 (or 2) gloo processes, each building its own ``Trainer`` from the environment
variables (``run_distributed(..., init_group=False)``). Process start-up dominates on 2 cores, so each launch runs
several scenarios.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests._distributed import run_distributed

pytestmark = pytest.mark.slow  # every test reads the results of one launch of 4 gloo processes

N_SAMPLES, BATCH, WORLD = 64, 4, 4
ACCUM, CLIP, LR = 2, 0.05, 0.05


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, 8, generator=g)
    y = torch.sin(x @ torch.randn(8, 4, generator=g))
    return TensorDataset(x, y)


def _lambda(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def _optim(net: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    decay = [p for p in net.parameters() if p.dim() == 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, _lambda)


def _module(nan_at_step: int | None = None, partial_at_step: int | None = None):
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if partial_at_step is not None and self.global_step == partial_at_step and self.global_rank == 2:
                # this rank leaves net.2 unused (its gradients stay None); the collectives still run everywhere
                loss = self.net[0](x).pow(2).mean()
            if nan_at_step is not None and self.global_step == nan_at_step and self.global_rank == 1:
                loss = loss * float("nan")
            self.losses.append(float(loss.detach()))
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            opt, sched = _optim(self)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            # no shuffling (Lightning's automatic sampler always shuffles), so the reference sees the same batches
            sampler = DistributedSampler(
                _data(), num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
            )
            return DataLoader(_data(), batch_size=BATCH, sampler=sampler)

    return Tiny()


def _trainer(strategy, world: int, max_epochs: int, **kwargs):
    import lightning.pytorch as pl

    return pl.Trainer(
        strategy=strategy, devices=world, accelerator="cpu", max_epochs=max_epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP, use_distributed_sampler=False, **kwargs,
    )  # fmt: skip


def _flat_params(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _identical_on_all_ranks(t: torch.Tensor) -> bool:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return all(torch.equal(everyone[0], e) for e in everyone)


def _paper_formats(**kwargs):
    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy

    return SDP4BitStrategy("qwd", "tlq_hs", intra_node_size=2, weight_group_size=256, **kwargs)


def _four_process_run(rank: int, world: int, tmp: str) -> dict:
    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy

    out: dict = {}
    # 1. both exchanges off: plain sharded data parallelism, compared with single-process training by the caller
    module = _module()
    _trainer(SDP4BitStrategy("none", "none", intra_node_size=2), world, max_epochs=3).fit(module)
    out["none_params"] = _flat_params(module.net)
    out["none_losses"] = module.losses

    # 2. SDP4Bit defaults (qwd + tlq_hs) on 2 emulated nodes x 2; uninterrupted, then 2 + 2 epochs with a checkpoint
    def sdp():
        return SDP4BitStrategy(
            "qwd", "tlq_hs", intra_node_size=2, weight_group_size=256, gradient_group_size=128, seed=1
        )

    module = _module()
    strategy = sdp()
    trainer = _trainer(strategy, world, max_epochs=4)
    trainer.fit(module)
    out["full_params"] = _flat_params(module.net)
    out["full_losses"] = module.losses
    out["identical"] = _identical_on_all_ranks(out["full_params"])
    out["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    out["topology"] = (strategy.topology.intra_size, strategy.topology.inter_size)
    out["state_dict_is_master"] = float(
        (torch.cat([v.reshape(-1) for v in strategy.lightning_module_state_dict().values()]) - out["full_params"])
        .abs()
        .max()
    )
    module = _module()
    trainer = _trainer(sdp(), world, max_epochs=2)
    trainer.fit(module)
    trainer.save_checkpoint(f"{tmp}/sdp4bit_w4.ckpt")
    module = _module()
    strategy = sdp()
    trainer = _trainer(strategy, world, max_epochs=4)
    trainer.fit(module, ckpt_path=f"{tmp}/sdp4bit_w4.ckpt")
    out["resumed_params"] = _flat_params(module.net)
    out["resumed_step"] = trainer.global_step

    # 3. exact resume with deterministic weights (none) and quantised gradients (tlq_hs, seeded stochastic rounding)
    def exact():
        return SDP4BitStrategy("none", "tlq_hs", intra_node_size=2, weight_group_size=256, seed=3)

    m1 = _module()
    _trainer(exact(), world, max_epochs=4).fit(m1)
    m2 = _module()
    t2 = _trainer(exact(), world, max_epochs=2)
    t2.fit(m2)
    t2.save_checkpoint(f"{tmp}/exact.ckpt")
    m3 = _module()
    _trainer(exact(), world, max_epochs=4).fit(m3, ckpt_path=f"{tmp}/exact.ckpt")
    out["exact_resume_diff"] = float((_flat_params(m1.net) - _flat_params(m3.net)).abs().max())

    # 4. NaN in one rank's gradient: skipped on every rank (counted), or raised naming the parameter
    module = _module(nan_at_step=1)
    strategy = SDP4BitStrategy("qwd", "tlq_hs", intra_node_size=2, nonfinite_gradients="skip", weight_group_size=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer(strategy, world, max_epochs=2)
        trainer.fit(module)
    out["skipped"] = strategy.skipped_steps
    out["skip_finite"] = bool(torch.isfinite(_flat_params(module.net)).all())
    out["skip_identical"] = _identical_on_all_ranks(_flat_params(module.net))
    out["skip_global_step"] = trainer.global_step
    module = _module(partial_at_step=1)
    _trainer(_paper_formats(), world, max_epochs=2).fit(module)
    out["partial_identical"] = _identical_on_all_ranks(_flat_params(module.net))
    module = _module(nan_at_step=1)
    try:
        _trainer(_paper_formats(), world, max_epochs=2).fit(module)
        out["raised"] = ""
    except FloatingPointError as err:
        out["raised"] = str(err)

    # 5. the GPT (tied embeddings) in bf16-true: bf16 model weights, fp32 master shards; checkpoint for a plain process
    import lightning.pytorch as pl

    from lightning_sdp.datamodules.text import CharTextDataModule
    from lightning_sdp.models.gpt import GPT

    dm = CharTextDataModule(block_size=16, batch_size=4)
    dm.setup("fit")
    torch.manual_seed(0)
    gpt = GPT(vocab_size=dm.vocab_size, n_layer=1, n_head=2, n_embd=32, block_size=16, max_steps=3, warmup_steps=1)
    strategy = SDP4BitStrategy("qwd", "tlq_hs", intra_node_size=2, weight_group_size=256)
    trainer = pl.Trainer(
        strategy=strategy, devices=world, accelerator="cpu", max_steps=3, precision="bf16-true", limit_val_batches=1,
        val_check_interval=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(gpt, dm)
    trainer.save_checkpoint(f"{tmp}/gpt.ckpt")
    out["gpt_dtypes"] = (
        str(gpt.lm_head.weight.dtype),
        str(strategy.master_shards(strategy.optimizers[0])[0].dtype),
    )
    out["gpt_identical"] = _identical_on_all_ranks(_flat_params(gpt).float())
    out["gpt_tied"] = gpt.lm_head.weight is gpt.transformer.wte.weight
    out["gpt_val"] = float(trainer.callback_metrics["val/loss"])
    return _plain(out)


def _plain(out: dict) -> dict:
    """Tensors as numpy arrays: torch's queue would pass tensors through shared memory the exiting worker owns."""
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def _two_process_resume(rank: int, world: int, tmp: str) -> dict:
    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy

    ckpt = torch.load(f"{tmp}/sdp4bit_w4.ckpt", weights_only=False)
    module = _module()
    strategy = SDP4BitStrategy("qwd", "tlq_hs", weight_group_size=256, seed=1)
    trainer = _trainer(strategy, world, max_epochs=2)  # already reached: restore only
    trainer.fit(module, ckpt_path=f"{tmp}/sdp4bit_w4.ckpt")
    state = strategy.optimizer_state(trainer.optimizers[0])
    saved = ckpt["optimizer_states"][0]
    same = all(
        torch.equal(state["state"][i][k], saved["state"][i][k]) for i in saved["state"] for k in saved["state"][i]
    ) and all(torch.equal(state["sdp4bit"]["master"][i], saved["sdp4bit"]["master"][i]) for i in saved["state"])
    order = [0, 2, 1, 3]  # optimizer index of net.0.weight, net.0.bias, net.2.weight, net.2.bias
    weights_are_master = all(
        torch.equal(p.detach(), saved["sdp4bit"]["master"][i])
        for i, p in zip(order, module.net.parameters(), strict=True)
    )
    module = _module()
    strategy = SDP4BitStrategy("qwd", "tlq_hs", weight_group_size=256, seed=1)
    trainer = _trainer(strategy, world, max_epochs=3)
    trainer.fit(module, ckpt_path=f"{tmp}/sdp4bit_w4.ckpt")
    return {
        "same_state": same,
        "weights_are_master": weights_are_master,
        "topology": (strategy.topology.intra_size, strategy.topology.inter_size),
        "global_step": trainer.global_step,
        "losses": module.losses,
        "identical": _identical_on_all_ranks(_flat_params(module.net)),
    }


def _single_process_reference(epochs: int) -> tuple[torch.Tensor, list[float]]:
    """Plain torch on the global batch: what 4 ranks x batch 4 with accumulation 2 and clipping must reproduce."""
    net = _net()
    opt, sched = _optim(net)
    x, y = _data().tensors
    global_batch = WORLD * BATCH
    micro_per_epoch = N_SAMPLES // global_batch
    losses = []
    for _ in range(epochs):
        for step in range(micro_per_epoch // ACCUM):
            for j in range(ACCUM):
                b = step * ACCUM + j
                # DistributedSampler without shuffling: rank r sees samples r, r + 4, ...; the global micro-batch
                # b is samples [16 b, 16 b + 16) whichever rank holds them
                sl = slice(b * global_batch, (b + 1) * global_batch)
                loss = nn.functional.mse_loss(net(x[sl]), y[sl])
                losses.append(float(loss.detach()))
                (loss / ACCUM).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            sched.step()
    return _flat_params(net), losses


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sdp4bit")


@pytest.fixture(scope="module")
def four(ckpt_dir):
    return run_distributed(_four_process_run, WORLD, str(ckpt_dir), timeout=400, init_group=False)


def test_none_none_matches_single_process_training(four):
    ref_params, ref_losses = _single_process_reference(epochs=3)
    for res in four:
        torch.testing.assert_close(torch.from_numpy(res["none_params"]), ref_params, rtol=1e-5, atol=1e-5)
    # the mean of the 4 ranks' micro-batch losses is the global micro-batch loss
    rank_losses = torch.tensor([r["none_losses"] for r in four])
    torch.testing.assert_close(rank_losses.mean(0), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)


def test_sdp4bit_trains_close_to_exact_and_keeps_ranks_identical(four):
    ref_params, ref_losses = _single_process_reference(epochs=4)
    for res in four:
        assert res["identical"]
        assert res["topology"] == (2, 2)
        # Adam at lr 0.05 on a 420-parameter net amplifies the 4-bit noise; it must still follow the exact run
        rel = float((torch.from_numpy(res["full_params"]) - ref_params).norm() / ref_params.norm())
        assert rel < 0.3, rel
    last_epoch = torch.tensor([r["full_losses"] for r in four]).mean(0)[-4:].mean()
    assert abs(float(last_epoch) / (sum(ref_losses[-4:]) / 4) - 1) < 0.1
    for res in four:
        # the state dict carries the exact master weights, the model the qWD copy: close, not equal
        assert 0 < res["state_dict_is_master"] < 1e-2


def test_logged_bits_and_bytes(four):
    m = four[0]["metrics"]
    assert m["sdp4bit/weight_bits_per_element"] == pytest.approx(4 + 32 / 256)
    assert m["sdp4bit/grad_bits_per_element_intra"] == pytest.approx(8.25)
    assert m["sdp4bit/grad_bits_per_element_inter"] == pytest.approx(4.25)
    assert m["sdp4bit/bytes_per_step"] > 0
    assert 0 < m["sdp4bit/weight_drift"] < 0.05


def test_checkpoint_resume_same_world_size(four):
    ref_params, _ = _single_process_reference(epochs=4)
    for res in four:
        assert res["resumed_step"] == 8
        # qWD refreshes the weight reference to the exact master weights on load: the resumed run differs from the
        # uninterrupted one by quantisation noise only, much less than the compressed run differs from exact fp32
        resumed, full = torch.from_numpy(res["resumed_params"]), torch.from_numpy(res["full_params"])
        rel = float((resumed - full).norm() / full.norm())
        assert rel < 0.5 * float((full - ref_params).norm() / full.norm()), rel
        # deterministic weight exchange + seeded stochastic gradient rounding: bit-exact resume
        assert res["exact_resume_diff"] == 0.0


def test_checkpoint_from_four_processes_resumes_on_two(four, ckpt_dir):
    results = run_distributed(_two_process_resume, 2, str(ckpt_dir), timeout=300, init_group=False)
    for res in results:
        assert res["same_state"]  # re-sharded for 2 ranks, consolidated again: identical to what 4 ranks saved
        assert res["weights_are_master"]  # weight reference refreshed to the exact master weights
        assert res["topology"] == (2, 1)
        assert res["global_step"] == 4 + 4  # saved after 4 steps; epoch 3 on 2 ranks: 32 samples / 4 / accumulation 2
        assert res["identical"]
        assert all(math.isfinite(v) for v in res["losses"])


def test_checkpoint_is_world_size_independent_and_loads_in_plain_process(four, ckpt_dir):
    ckpt = torch.load(ckpt_dir / "sdp4bit_w4.ckpt", weights_only=False)
    opt_state = ckpt["optimizer_states"][0]
    net = _net()
    shapes = [tuple(p.shape) for p in net.parameters()]
    # keyed like the unsharded AdamW: one entry per parameter, with the parameter's shape
    assert sorted(opt_state["state"]) == list(range(4))
    order = [0, 2, 1, 3]  # group 0 holds the weights, group 1 the biases
    for idx, shape in zip(order, shapes, strict=True):
        assert tuple(opt_state["state"][idx]["exp_avg"].shape) == shape
    assert [g["params"] for g in opt_state["param_groups"]] == [[0, 1], [2, 3]]
    # a plain (unsharded) AdamW accepts it
    opt, _ = _optim(net)
    opt.load_state_dict(opt_state)
    # the model weights in the checkpoint are the exact master weights
    for idx, (name, _) in zip(order, net.named_parameters(), strict=True):
        assert torch.equal(ckpt["state_dict"][f"net.{name}"], opt_state["sdp4bit"]["master"][idx])


def test_nonfinite_gradients(four):
    for res in four:
        assert res["skipped"] == 1
        assert res["skip_finite"] and res["skip_identical"]
        assert res["skip_global_step"] == 4
        assert res["partial_identical"]  # a rank with unused parameters took part with zero gradients
        assert "non-finite" in res["raised"] and "rank 1: net.0.weight" in res["raised"]


def test_gpt_bf16_true_and_load_in_plain_process(four, ckpt_dir):
    from lightning_sdp.models.gpt import GPT

    for res in four:
        assert res["gpt_dtypes"] == ("torch.bfloat16", "torch.float32")
        assert res["gpt_identical"] and res["gpt_tied"]
        assert math.isfinite(res["gpt_val"])
    ckpt = torch.load(ckpt_dir / "gpt.ckpt", weights_only=False)
    model = GPT.load_from_checkpoint(ckpt_dir / "gpt.ckpt", map_location="cpu")
    masters = ckpt["optimizer_states"][0]["sdp4bit"]["master"]
    # the state dict holds the exact fp32 master weights rounded once to the model dtype
    assert torch.equal(model.lm_head.weight.to(torch.bfloat16), masters[0].to(torch.bfloat16))
    assert model.lm_head.weight is model.transformer.wte.weight
    x = torch.randint(0, model.hparams.vocab_size, (2, 16))
    assert model(x).shape[:2] == (2, 16)
