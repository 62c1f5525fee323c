"""SDP4BitStrategy where runs usually go wrong: a hung peer, odd world sizes and layouts, a quantised step that
overflows.

- ``timeout=`` reaches the strategy's own process groups: a rank hung before the link probe makes the others fail
  within the given seconds, not torch's 30-minute default.
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests._distributed import run_distributed


def _data(n: int = 48, features: int = 5) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, torch.sin(x[:, :3] * 2))


def _tiny():
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            sampler = DistributedSampler(_data(), self.trainer.world_size, self.trainer.global_rank, shuffle=False)
            return DataLoader(_data(), batch_size=4, sampler=sampler)

    return Tiny()


# ---------------------------------------------------------------------------------------------- time-outs

TIMEOUT_S = 3


def _hung_peer_in_the_probe(rank: int, world: int, tmp: str) -> tuple[str, float]:
    import lightning.pytorch as pl

    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy, auto

    failed = Path(tmp) / "rank0_failed"
    if rank == 1:
        real = auto.probe_links

        def hang(*args, **kwargs):  # this rank never joins the probe's collectives (until rank 0 gave up)
            deadline = time.monotonic() + 20 * TIMEOUT_S
            while not failed.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            raise RuntimeError("the hung peer gave up")

        auto.probe_links = hang
    strategy = SDP4BitStrategy(intra_node_size=2, timeout=timedelta(seconds=TIMEOUT_S))
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    start = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(_tiny())
    except Exception as err:  # the outcome is what the test checks
        if rank == 0:
            failed.touch()
        return f"{type(err).__name__}: {err}", time.monotonic() - start
    finally:
        if rank == 1:
            auto.probe_links = real
    return "finished", time.monotonic() - start


def test_a_hung_peer_in_the_link_probe_fails_the_others_within_the_timeout(tmp_path):
    results = run_distributed(_hung_peer_in_the_probe, 2, str(tmp_path), init_group=False, timeout=180)
    waiting, seconds = results[0]
    # the probe's all-to-all on the strategy's own intra-node group gave up after the strategy's timeout (torch's
    # default for a new group is 30 minutes); the set-up before it takes a few seconds on a loaded machine
    assert "timed out" in waiting.lower() or "timeout" in waiting.lower(), waiting
    assert seconds < 10 * TIMEOUT_S
    assert results[1][0] == "RuntimeError: the hung peer gave up"
