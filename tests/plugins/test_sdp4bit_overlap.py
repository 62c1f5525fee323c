"""SDP4Bit's overlap and pipelining: several buckets, exchanged during backward on worker threads.

One launch of 4 gloo processes (2 emulated nodes x 2, so both all-to-all levels are pipelined) trains a small net
with every feature that touches the exchange (gradient accumulation, clipping by the global norm, a NaN step
skipped, gradients edited in ``on_after_backward``, a checkpoint) with ``overlap=True`` and ``overlap=False``. Each
bucket draws its stochastic rounding from its own stream, so both must end bit-identical.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests._distributed import run_distributed

WORLD, BATCH, ACCUM, CLIP = 4, 4, 2, 0.05
BUCKET_MB = 0.002  # 524 values: the net below is cut into several buckets


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return TensorDataset(x, torch.sin(x @ torch.randn(8, 4, generator=g)))


def _module(nan_at: int | None = None, edit_at: int | None = None):
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if nan_at is not None and self.global_step == nan_at and self.global_rank == 1:
                loss = loss * float("nan")
            return loss

        def on_after_backward(self):
            if edit_at is not None and self.global_step == edit_at:
                self.net[4].weight.grad.mul_(3.0)  # edited after its bucket (the last layer's) left during backward

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)

        def train_dataloader(self):
            sampler = DistributedSampler(
                _data(), num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
            )
            return DataLoader(_data(), batch_size=BATCH, sampler=sampler)

    return Net()


def _fit(module, strategy, epochs: int = 2, ckpt_path: str | None = None):
    import lightning.pytorch as pl

    trainer = pl.Trainer(
        strategy=strategy, devices=WORLD, accelerator="cpu", max_epochs=epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP, use_distributed_sampler=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def _params(module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy()


def _run(rank: int, world: int, tmp: str) -> dict:
    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy

    def sdp(overlap: bool, **kwargs):
        kwargs.setdefault("bucket_size_mb", BUCKET_MB)
        return SDP4BitStrategy(
            "qwd", "tlq_hs", intra_node_size=2, weight_group_size=256, gradient_group_size=128, seed=5, overlap=overlap,
            nonfinite_gradients="skip", **kwargs,
        )  # fmt: skip

    out: dict = {}
    for overlap in (True, False):
        for name, module in (("plain", _module()), ("nan", _module(nan_at=1)), ("edit", _module(edit_at=2))):
            strategy = sdp(overlap)
            _fit(module, strategy)
            out[f"{name}/{overlap}"] = _params(module)
            out[f"{name}/{overlap}/skipped"] = strategy.skipped_steps
            out[f"{name}/{overlap}/bytes"] = strategy.comm_stats.as_dict()["total"]
            out[f"{name}/{overlap}/launched_in_backward"] = strategy.buckets_launched_in_backward
            out[f"{name}/{overlap}/buckets"] = len(strategy.master_shards(strategy.optimizers[0]))
    # fp32 exchange (none/none), several buckets, overlapped: plain sharded data parallelism as before
    for overlap in (True, False):
        module = _module()
        _fit(module, SDP4BitStrategy("none", "none", intra_node_size=2, bucket_size_mb=BUCKET_MB, overlap=overlap))
        out[f"exact/{overlap}"] = _params(module)
    module = _module()
    _fit(module, SDP4BitStrategy("none", "none", intra_node_size=2, bucket_size_mb=None))
    out["exact/one_bucket"] = _params(module)
    module = _module()  # buckets chosen from the measured link (loopback: fast, so few)
    strategy = SDP4BitStrategy("none", "none", intra_node_size=2, bucket_size_mb="auto")
    _fit(module, strategy)
    out["exact/auto"], out["auto_buckets"] = _params(module), len(strategy.master_shards(strategy.optimizers[0]))
    # checkpoint saved with many buckets, resumed with one bucket per group (and the reverse): same state
    module = _module()
    trainer = _fit(module, sdp(True), epochs=1)
    trainer.save_checkpoint(f"{tmp}/buckets.ckpt")
    saved = torch.load(f"{tmp}/buckets.ckpt", weights_only=False)["optimizer_states"][0]
    module = _module()
    strategy = sdp(True, bucket_size_mb=None)
    trainer = _fit(module, strategy, epochs=1, ckpt_path=f"{tmp}/buckets.ckpt")  # already reached: restore only
    again = strategy.optimizer_state(trainer.optimizers[0])
    out["ckpt_same"] = all(
        torch.equal(again["state"][i][k], saved["state"][i][k]) for i in saved["state"] for k in saved["state"][i]
    ) and all(torch.equal(again["sdp4bit"]["master"][i], m) for i, m in saved["sdp4bit"]["master"].items())
    out["ckpt_groups"] = [g["params"] for g in again["param_groups"]]
    out["threads_left"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("sdp4bit"))
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_distributed(_run, WORLD, str(tmp_path_factory.mktemp("overlap")), timeout=600, init_group=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "nan", "edit"])
def test_overlapped_exchange_is_bit_identical_to_the_sequential_one(four, name):
    for res in four:
        assert res[f"{name}/True/buckets"] >= 3
        assert np.array_equal(res[f"{name}/True"], res[f"{name}/False"])
        sent, seq = res[f"{name}/True/bytes"], res[f"{name}/False/bytes"]
        if name == "edit":  # the edited bucket crossed the network twice in that step, once too early
            assert all(sent[k] == seq[k] for k in ("weight_inter", "weight_intra"))
            assert [sent[k]["calls"] - seq[k]["calls"] for k in ("grad_intra", "grad_inter")] == [1, 1]
        else:
            assert sent == seq
        assert res[f"{name}/True/skipped"] == res[f"{name}/False/skipped"] == (1 if name == "nan" else 0)
        assert np.isfinite(res[f"{name}/True"]).all()
    # the ranks hold the same weights
    assert all(np.array_equal(r[f"{name}/True"], four[0][f"{name}/True"]) for r in four)


@pytest.mark.slow
def test_buckets_leave_during_backward_only_when_overlapping(four):
    for res in four:
        assert res["plain/True/launched_in_backward"] > 0
        assert res["plain/False/launched_in_backward"] == 0


@pytest.mark.slow
def test_edited_gradients_are_exchanged_again(four):
    for res in four:  # the edit changed the result (it was not lost in the bucket sent during backward)
        assert not np.array_equal(res["edit/True"], res["plain/True"])


@pytest.mark.slow
def test_fp32_exchange_is_unchanged_by_buckets_and_overlap(four):
    for res in four:
        assert np.array_equal(res["exact/True"], res["exact/False"])
        # other bucket boundaries change only the order of fp32 sums: equal up to rounding
        np.testing.assert_allclose(res["exact/True"], res["exact/one_bucket"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(res["exact/auto"], res["exact/one_bucket"], rtol=1e-5, atol=1e-6)
        assert 1 <= res["auto_buckets"] <= 64


@pytest.mark.slow
def test_checkpoint_does_not_depend_on_bucket_size(four):
    for res in four:
        assert res["ckpt_same"]
        assert res["ckpt_groups"] == [list(range(6))]
        assert res["threads_left"] == []  # worker threads stopped at teardown


# ------------------------------------------------------------------------------------------------ single process


def test_split_params_fills_buckets_from_the_end():
    from lightning_sdp.plugins.sdp4bit.sharding import split_params

    params = [torch.zeros(n) for n in (5, 3, 4, 10, 2)]
    runs = split_params(params, 6)
    assert [[p.numel() for p in r] for r in runs] == [[5], [3], [4], [10], [2]]
    runs = split_params(params, 7)
    assert [[p.numel() for p in r] for r in runs] == [[5], [3, 4], [10], [2]]
    assert [p for r in split_params(params, 100) for p in r] == params
    assert split_params(params, None) == [params]


def test_rounding_streams_do_not_depend_on_order():
    from lightning_sdp.plugins.sdp4bit.exchange import RoundingRNG

    rng = RoundingRNG(0, 1, torch.device("cpu"))
    rng.reset(3)
    a = torch.rand(4, generator=rng.child(0).generator)
    b = torch.rand(4, generator=rng.child(1).generator)
    rng.reset(3)
    b2 = torch.rand(4, generator=rng.child(1).generator)
    a2 = torch.rand(4, generator=rng.child(0).generator)
    assert torch.equal(a, a2) and torch.equal(b, b2) and not torch.equal(a, b)
    rng.reset(4)
    assert not torch.equal(torch.rand(4, generator=rng.child(0).generator), a)


def test_pipeline_keeps_order_and_reports_errors():
    from lightning_sdp.plugins.sdp4bit.overlap import Pipeline

    seen: list[str] = []
    pipe = Pipeline(threaded=True)
    jobs = [pipe.submit(lambda i=i: seen.append(f"a{i}"), lambda i=i: seen.append(f"b{i}") or i) for i in range(5)]
    assert [j.result() for j in jobs] == list(range(5))
    assert [s for s in seen if s[0] == "a"] == [f"a{i}" for i in range(5)]
    assert [s for s in seen if s[0] == "b"] == [f"b{i}" for i in range(5)]

    def boom():
        raise RuntimeError("stage one failed")

    with pytest.raises(RuntimeError, match="stage one failed"):
        pipe.submit(boom, lambda: 1).result()
    pipe.shutdown()
    assert Pipeline(threaded=False).submit(lambda: None, lambda: 7).result() == 7


@pytest.mark.parametrize(
    "value,error,match",
    [
        (0, ValueError, "bucket_size_mb must be a positive number"),
        (-1.0, ValueError, "bucket_size_mb must be a positive number"),
        (float("nan"), ValueError, "bucket_size_mb must be a positive number"),
        ("big", ValueError, "bucket_size_mb must be 'auto', a number or None, got 'big'"),
        (True, TypeError, "bucket_size_mb must be 'auto', a number or None, got True"),
    ],
)
def test_bad_bucket_size_is_refused(value, error, match):
    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy

    with pytest.raises(error, match=match):
        SDP4BitStrategy(bucket_size_mb=value)
    with pytest.raises(TypeError, match="overlap must be a bool"):
        SDP4BitStrategy(overlap="yes")


def _completion_order(module: nn.Module, groups: list[list[torch.Tensor]], bucket_numel: int, loss_fn) -> tuple:
    """The buckets' predicted launch order and the order a real backward completes them (the reference)."""
    from lightning_sdp.plugins.sdp4bit.overlap import launch_order
    from lightning_sdp.plugins.sdp4bit.sharding import split_params

    buckets = [run for group in groups for run in split_params(group, bucket_numel)]
    bucket_of = {id(p): i for i, run in enumerate(buckets) for p in run}
    waiting = [{id(p) for p in run} for run in buckets]
    completed: list[int] = []

    def done(param: torch.Tensor) -> None:
        i = bucket_of[id(param)]
        waiting[i].discard(id(param))
        if not waiting[i]:
            completed.append(i)

    handles = [p.register_post_accumulate_grad_hook(done) for p in module.parameters()]
    try:
        loss_fn().backward()
    finally:
        for handle in handles:
            handle.remove()
    first_use = {id(p): i for i, p in enumerate(module.parameters())}
    return launch_order(buckets, first_use), completed, len(buckets)


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_buckets_launch_in_the_order_backward_completes_them(model):
    """A weight-decay split puts every bias and norm in a group that spans the model: it completes last, so the
    layers' buckets must not queue behind it (the reverse of the optimizer's order would put it first)."""
    if model == "mlp":
        module: nn.Module = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.LayerNorm(16))])
        x = torch.randn(8, 16)

        def loss_fn():
            return module(x).square().mean()

        numel = 300
    else:
        from lightning_sdp.models.gpt import GPT

        module = GPT(vocab_size=11, n_layer=3, n_head=2, n_embd=16, block_size=8)  # tied embedding and head
        idx = torch.randint(0, 11, (2, 8))

        def loss_fn():
            return module(idx).square().mean()

        numel = 1500
    params = list(module.parameters())
    groups = [[p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]]
    predicted, actual, n = _completion_order(module, groups, numel, loss_fn)
    assert n >= 4 and sorted(predicted) == list(range(n))
    assert predicted == actual
    assert predicted[0] != n - 1, "the no-decay group's bucket (last in the optimizer) completes last, not first"
