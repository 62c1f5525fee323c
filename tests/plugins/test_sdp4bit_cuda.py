"""SDP4Bit on one CUDA device with NCCL (``benchmarks/gpu_checks.py`` runs these on a GPU machine).

One process cannot exercise the quantised exchange (a world of one sends nothing, and NCCL refuses two ranks on one
GPU; with one process the strategy steps like plain training and shards nothing), so these check the CUDA side of
the single-process path: NCCL set-up, the model on the device, the user's optimizer left as it is, and that training
equals DDP's (the strategy SDP4Bit replaces; it feeds the same distributed sampler).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sdp import SDP4BitStrategy

pytestmark = pytest.mark.cuda


class _Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 64, generator=g)
        return DataLoader(TensorDataset(x, x.roll(1, dims=1)), batch_size=32)


class _Seen(Callback):
    """What the strategy runs on, read during the fit (teardown destroys the process groups)."""

    def on_train_batch_end(self, trainer, *args) -> None:
        self.backend = dist.get_backend() if dist.is_initialized() else None
        self.sharded = bool(getattr(trainer.strategy, "buckets", []))
        self.param_device = next(trainer.lightning_module.parameters()).device.type


def _fit(strategy) -> tuple[_Seen, dict[str, torch.Tensor]]:
    seed_everything(0)
    module = _Net()
    seen = _Seen()
    trainer = Trainer(
        accelerator="cuda", devices=1, strategy=strategy, max_steps=16, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[seen],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    return seen, {k: v.detach().float().cpu() for k, v in module.state_dict().items()}


def test_single_gpu_nccl_training_equals_ddp(monkeypatch):
    from tests._distributed import find_free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    try:
        seen, sdp = _fit(SDP4BitStrategy(process_group_backend="nccl"))
        assert (seen.backend, seen.sharded, seen.param_device) == ("nccl", False, "cuda")  # one process: plain
        _, ddp = _fit(DDPStrategy(process_group_backend="nccl"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    seed_everything(0)
    start = _Net().state_dict()
    for name, value in ddp.items():
        assert not torch.equal(value, start[name].float()), f"{name} did not train"
        torch.testing.assert_close(sdp[name], value, rtol=1e-4, atol=1e-5, msg=f"{name} differs")


@pytest.mark.triton
def test_auto_backend_picks_the_fused_kernels_on_cuda():
    # with several processes the codec runs on the device (one process never quantises, see above)
    from lightning_sdp.plugins.sdp4bit.exchange import TritonOps

    assert isinstance(SDP4BitStrategy(parallel_devices=[torch.device("cuda", 0)])._select_ops(), TritonOps)
