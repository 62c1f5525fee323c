"""DDP's exchange as a candidate of ``"auto"``: a replicated optimizer, the switch both ways, and checkpoints.

One launch of 4 gloo processes (2 emulated nodes x 2) runs:

- the mechanism with fixed uncompressed formats, switched between sharded and replicated steps by a callback (the
  strategy's private ``_set_replicated``, which ``"auto"`` calls): the weights must equal plain single-process
  training (AdamW with two param groups, an LR schedule and global-norm clipping), across a checkpoint written
  sharded and resumed replicated; replicated steps run through torch's DDP reducer, also with layers frozen and
  unfrozen between steps (a new reducer each time), a hook that edits a gradient, and a NaN on one rank;
- ``"auto"`` on a fake clock on which DDP's exchange is the fastest: it is chosen, the same on every rank, and the
  decision says what memory it gave up; with no free memory it is not tried; ``optimizer_state="shard"`` removes it.

A second launch of 2 processes resumes the checkpoints of the first with the other choice (sharded from one written
replicated, replicated from one written sharded) and must still equal single-process training.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests._distributed import run_distributed

pytestmark = pytest.mark.slow

N_SAMPLES, GLOBAL_BATCH, CLIP, LR = 64, 16, 0.05, 0.05


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, 8, generator=g)
    return TensorDataset(x, torch.sin(x @ torch.randn(8, 4, generator=g)))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def _optim(net: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    decay = [p for p in net.parameters() if p.dim() == 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))


def _module(
    edit_grad: bool = False,
    nan_at: tuple[int, int] | None = None,
    unused_at: int | None = None,
    edit_after_backward: bool = False,
):
    """The tiny regression; ``edit_grad``: ``on_before_optimizer_step`` zeroes the last bias' gradient; ``nan_at``:
    ``(rank, step)`` whose loss is NaN; ``unused_at``: an output shift, a parameter that step does not use;
    ``edit_after_backward``: rank 0 zeroes its own last bias gradient in ``on_after_backward``."""
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()
            if unused_at is not None:
                self.shift = nn.Parameter(torch.zeros(4))

        def training_step(self, batch, batch_idx):
            out = self.net(batch[0])
            if unused_at is not None and self.global_step != unused_at:
                out = out + self.shift
            loss = nn.functional.mse_loss(out, batch[1])
            if nan_at == (self.global_rank, self.global_step):
                loss = loss * float("nan")
            return loss

        def configure_optimizers(self):
            opt, sched = _optim(self)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            world, rank = self.trainer.world_size, self.trainer.global_rank
            sampler = DistributedSampler(_data(), num_replicas=world, rank=rank, shuffle=False)
            return DataLoader(_data(), batch_size=GLOBAL_BATCH // world, sampler=sampler)

    class EditsGradients(Tiny):
        def on_before_optimizer_step(self, optimizer):
            self.net[2].bias.grad.zero_()

    class EditsAfterBackward(Tiny):
        def on_after_backward(self):
            if self.global_rank == 0:
                self.net[2].bias.grad.zero_()

    return EditsGradients() if edit_grad else EditsAfterBackward() if edit_after_backward else Tiny()


def _reference(epochs: int, edit_grad: bool = False) -> np.ndarray:
    """Plain torch on the global batch (rank r of W holds samples r, r + W, ...: together the same 16);
    ``edit_grad``: as :func:`_module`."""
    net = _net()
    opt, sched = _optim(net)
    x, y = _data().tensors
    for _ in range(epochs):
        for b in range(N_SAMPLES // GLOBAL_BATCH):
            sl = slice(b * GLOBAL_BATCH, (b + 1) * GLOBAL_BATCH)
            nn.functional.mse_loss(net(x[sl]), y[sl]).backward()
            if edit_grad:
                net[2].bias.grad.zero_()
            torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            sched.step()
    return _flat(net)


def _flat(module: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy().copy()


def _identical(values: np.ndarray) -> bool:
    t = torch.from_numpy(values)
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return all(torch.equal(everyone[0], e) for e in everyone)


def _switcher(at: dict[int, bool], frozen: tuple[int, ...] = ()):
    """A callback that makes the strategy replicate (``True``) or shard (``False``) before the given steps, freezes
    the first layer at the ``frozen`` steps, and records per step whether DDP's reducer ran it and on which
    parameters (``reducer``)."""
    import lightning.pytorch as pl

    class Switch(pl.Callback):
        def __init__(self) -> None:
            self.reducer: list = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            flag = at.get(trainer.global_step)
            if flag is not None and trainer.strategy._formats.replicated != flag:
                trainer.strategy._set_replicated(flag)
            pl_module.net[0].requires_grad_(trainer.global_step not in frozen)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            wrapped = isinstance(trainer.strategy.model, DistributedDataParallel)
            self.reducer.append(trainer.strategy._reducer_signature if wrapped else None)

    return Switch()


def _fit(strategy, world: int, epochs: int, callbacks=(), ckpt: str | None = None, module=None, accumulate: int = 1):
    import lightning.pytorch as pl

    trainer = pl.Trainer(
        strategy=strategy,
        devices=world,
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=CLIP,
        use_distributed_sampler=False,
        callbacks=list(callbacks),
        log_every_n_steps=1,
        accumulate_grad_batches=accumulate,
    )
    module = module or _module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, ckpt_path=ckpt)
    return trainer, module


def _state_bytes(optimizer: torch.optim.Optimizer, buckets) -> int:
    """Bytes of the fp32 masters that are not the model's buffer and of their optimizer state."""
    total = 0
    for b in buckets:
        if b.master is not b.model_flat:
            total += b.master.numel() * 4
        total += sum(v.numel() * v.element_size() for v in optimizer.state[b.master].values() if v.dim() == 1)
    return total


def _mechanism(rank: int, world: int, tmp: str) -> dict:
    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy
    from lightning_sdp.plugins.sdp4bit.replication import extra_bytes, replicate, shard
    from lightning_sdp.utilities import unwrap_optimizer

    out: dict = {}
    # two epochs (8 steps): replicated from the first step, sharded again from the fifth
    strategy = SDP4BitStrategy("none", "none", intra_node_size=2)
    switch = _switcher({0: True, 4: False})
    trainer, module = _fit(strategy, world, 2, [switch])
    out["reducer"] = [signature is not None for signature in switch.reducer]
    raw = unwrap_optimizer(trainer.optimizers[0])
    buckets = strategy._buckets[id(raw)]
    before, predicted = _state_bytes(raw, buckets), extra_bytes(raw, buckets)
    replicate(raw, buckets)
    out["extra_bytes"] = (predicted, _state_bytes(raw, buckets) - before)
    shard(raw, buckets)
    out["allreduce_steps"] = strategy.comm_stats.total["grad_allreduce"].calls
    trainer.save_checkpoint(f"{tmp}/sharded.ckpt")
    # resumed on the same world size, replicated from its first step on
    strategy = SDP4BitStrategy("none", "none", intra_node_size=2)
    trainer, module = _fit(strategy, world, 3, [_switcher({8: True})], ckpt=f"{tmp}/sharded.ckpt")
    out["replicated_at_end"] = strategy._formats.replicated
    out["last_step_bytes"] = sorted(strategy.comm_stats.last)
    out["params"] = _flat(module)
    out["identical"] = _identical(out["params"])
    trainer.save_checkpoint(f"{tmp}/replicated.ckpt")
    # replicated throughout, the first layer frozen at steps 2 and 3, a hook edits a gradient; then gradients
    # accumulated over two batches: through the reducer, and through the strategy's own all-reduce
    for name in ("reducer", "own"):
        for case, frozen, accumulate in (("frozen", (2, 3), 1), ("accumulated", (), 2)):
            switch = _switcher({0: True}, frozen=frozen)
            strategy = SDP4BitStrategy("none", "none", intra_node_size=2)
            if name == "own":
                strategy._use_reducer = lambda replicated: None
            module = _module(edit_grad=True)
            _, module = _fit(strategy, world, 2, [switch], module=module, accumulate=accumulate)
            out[f"{case}/{name}"] = (_flat(module), switch.reducer)
    # a NaN loss on rank 1 at step 2 only: the averaged gradient is NaN on every rank, so every rank skips the step
    strategy = SDP4BitStrategy("none", "none", intra_node_size=2, nonfinite_gradients="skip")
    _, module = _fit(strategy, world, 1, [_switcher({0: True})], module=_module(nan_at=(1, 2)))
    out["nan_skipped"], out["nan_params"] = strategy.skipped_steps, _flat(module)
    out["nan_identical"] = _identical(out["nan_params"])
    # rank 0 edits its own gradient after backward: the reducer would apply that to the average on rank 0 alone
    switch = _switcher({0: True})
    strategy = SDP4BitStrategy("none", "none", intra_node_size=2)
    _, module = _fit(strategy, world, 1, [switch], module=_module(edit_after_backward=True))
    out["after_backward"] = (switch.reducer, _identical(_flat(module)))
    return out


def _auto_fit(world: int, clock_cost, **kwargs):
    """``"auto"`` on a fake clock: each step takes ``clock_cost(formats)`` seconds."""
    import lightning.pytorch as pl

    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy

    now = [0.0]

    class FakeClock(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.strategy._auto.clock = lambda: now[0]

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            now[0] += clock_cost(trainer.strategy._formats)  # the step that ended ran these formats

    strategy = SDP4BitStrategy(intra_node_size=2, weight_group_size=256, auto_trial_steps=2, **kwargs)
    trainer, module = _fit(strategy, world, 8, [FakeClock()])
    decision = strategy.auto_decisions[0]
    return {
        "chosen": decision.chosen.describe(),
        "words": decision.describe(),
        "tried": sorted(decision.measured),
        "skipped": decision.skipped,
        "replicated_at_end": strategy._formats.replicated,
        "identical": _identical(_flat(module)),
        "metric": float(trainer.callback_metrics["sdp4bit/replicated"]),
    }


def _ddp_is_fastest(formats) -> float:
    if formats.replicated:
        return 1.0
    lossy = formats.weight.quantized or formats.gradient.quantized
    return 1.3 if lossy else 1.2


def _four(rank: int, world: int, tmp: str) -> dict:
    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy, replication

    out = _mechanism(rank, world, tmp)
    out["auto"] = _auto_fit(world, _ddp_is_fastest)
    free = replication.free_bytes
    replication.free_bytes = lambda device: 0
    try:
        out["auto_no_memory"] = _auto_fit(world, _ddp_is_fastest)
    finally:
        replication.free_bytes = free
    out["auto_shard"] = _auto_fit(world, _ddp_is_fastest, optimizer_state="shard")
    # every parameter had a gradient in the two steps before the reducer took over (so it does not search for unused
    # ones); at step 4 one has none: refused before that step changes anything (the run ends; so it goes last)
    strategy = SDP4BitStrategy("none", "none", intra_node_size=2)
    try:
        _fit(strategy, world, 2, [_switcher({2: True})], module=_module(unused_at=4))
    except RuntimeError as error:
        out["unused_error"] = (str(error), strategy._step)
    return out


def _two(rank: int, world: int, tmp: str) -> dict:
    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy

    # written replicated on 4 processes, resumed sharded on 2
    strategy = SDP4BitStrategy("none", "none", optimizer_state="shard")
    _, sharded = _fit(strategy, world, 4, ckpt=f"{tmp}/replicated.ckpt")
    # written sharded on 4 processes, resumed replicated on 2 (two epochs: steps 8 to 15)
    strategy = SDP4BitStrategy("none", "none")
    _, replicated = _fit(strategy, world, 4, [_switcher({8: True})], ckpt=f"{tmp}/sharded.ckpt")
    return {"sharded": _flat(sharded), "replicated": _flat(replicated), "was_replicated": strategy._formats.replicated}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("replication"))
    four = run_distributed(_four, 4, tmp, init_group=False, timeout=600)
    two = run_distributed(_two, 2, tmp, init_group=False, timeout=300)
    return four, two


def test_replicated_steps_equal_plain_training_across_switches_and_a_resume(launched):
    four, _ = launched
    reference = _reference(epochs=3)
    for r in four:
        assert r["reducer"] == [True] * 4 + [False] * 4  # torch's reducer ran exactly the replicated steps
        assert r["allreduce_steps"] > 0 and r["replicated_at_end"]
        assert r["last_step_bytes"] == ["grad_allreduce"]  # no weight all-gather while replicated
        assert r["identical"]
        np.testing.assert_allclose(r["params"], reference, rtol=1e-5, atol=1e-6)


def test_the_reducer_follows_frozen_layers_accumulation_and_gradient_edits_and_skips_a_nan_everywhere(launched):
    """Also: not used when a hook edits the gradients after backward (before the average, as each rank made it)."""
    four, _ = launched
    never_frozen = _reference(epochs=2, edit_grad=True)
    everything, frozen = (True,) * 4, (False, False, True, True)
    for r in four:
        params, reducer = r["frozen/reducer"]
        own, not_reducer = r["frozen/own"]
        # a new reducer when the first layer is frozen, and again when it is trainable once more
        assert reducer == [everything] * 2 + [frozen] * 2 + [everything] * 4 and not_reducer == [None] * 8
        # the same steps as the strategy's own all-reduce (a frozen parameter keeps its group's Adam step count,
        # unlike plain torch), and the freezing did change them
        np.testing.assert_allclose(params, own, rtol=1e-5, atol=1e-6)
        assert not np.allclose(params, never_frozen, rtol=1e-3, atol=1e-4)
        (params, reducer), (own, _) = r["accumulated/reducer"], r["accumulated/own"]
        assert reducer == [everything] * 4  # 8 batches, 4 optimizer steps
        np.testing.assert_allclose(params, own, rtol=1e-5, atol=1e-6)
        assert r["nan_skipped"] == 1 and np.isfinite(r["nan_params"]).all() and r["nan_identical"]
        # an on_after_backward hook keeps the strategy's own all-reduce, which sends the edited bucket
        reducer, identical = r["after_backward"]
        assert reducer == [None] * 4 and identical


def test_a_parameter_unused_after_the_reducer_took_over_stops_the_run_before_its_step(launched):
    four, _ = launched
    for r in four:
        message, steps_taken = r["unused_error"]
        assert "step 4" in message and "['shift']" in message and "optimizer_state='shard'" in message
        assert steps_taken == 4


def test_extra_bytes_is_what_replicating_allocates(launched):
    four, _ = launched
    for r in four:
        predicted, measured = r["extra_bytes"]
        assert predicted == measured > 0


def test_checkpoints_resume_on_another_world_size_with_the_other_choice(launched):
    _, two = launched
    reference = _reference(epochs=4)
    for r in two:
        assert r["was_replicated"]
        np.testing.assert_allclose(r["sharded"], reference, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["replicated"], reference, rtol=1e-5, atol=1e-6)


def test_auto_chooses_ddps_exchange_when_fastest_and_says_what_it_gave_up(launched):
    four, _ = launched
    first = four[0]["auto"]
    assert first["chosen"].startswith("DDP's exchange") and first["replicated_at_end"]
    assert "MiB more per rank" in first["words"] and "optimizer_state='shard'" in first["words"]
    assert all(r["auto"]["words"] == first["words"] for r in four)  # the same decision on every rank
    assert all(r["auto"]["identical"] and r["auto"]["metric"] == 1.0 for r in four)


def test_auto_does_not_replicate_what_does_not_fit_or_when_told_to_shard(launched):
    four, _ = launched
    for r in four:
        no_memory = r["auto_no_memory"]
        assert not no_memory["replicated_at_end"] and not no_memory["chosen"].startswith("DDP")
        assert any("would not fit" in s for s in no_memory["skipped"])
        assert no_memory["chosen"] == "weights uncompressed, gradients fp32"  # the fastest sharded one
        shard = r["auto_shard"]
        assert not any("DDP" in s for s in [*shard["tried"], *shard["skipped"]])
        assert not shard["replicated_at_end"] and shard["metric"] == 0.0
