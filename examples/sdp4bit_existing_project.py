"""Add SDP4Bit to an existing Lightning project: change one argument of the Trainer.

The LightningModule below is a plain user model (an MLP regressor with AdamW and a step LR schedule) that knows
nothing about lightning-sdp. ``strategy=SDP4BitStrategy(...)`` (or simply ``strategy="sdp4bit"``) shards the
optimizer state over the processes and sends weights and gradients as ~4-bit codes. The script starts 4 CPU
processes that emulate 2 nodes x 2 ranks and prints the bits per element each collective sent. Run from the
repository root:

    .venv/bin/python examples/sdp4bit_existing_project.py --devices 4 --intra-node-size 2

Compare with ``--weights none --grads none`` (plain sharded data parallelism, same as DDP).
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sdp import SDP4BitStrategy


class Regressor(LightningModule):
    """The 'existing project': an MLP fitting a smooth function."""

    def __init__(self, width: int = 256, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 16, generator=g)
        y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * x[:, :1] ** 2
        return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--intra-node-size", type=int, default=2)
    parser.add_argument("--weights", default="qwd", choices=["auto", "qwd", "qw", "none"])
    parser.add_argument("--grads", default="tlq_hs", choices=["auto", "tlq_hs", "tlq", "ulq", "none"])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    strategy = SDP4BitStrategy(
        weight_compression=args.weights,
        gradient_compression=args.grads,
        intra_node_size=args.intra_node_size,
        weight_group_size=512,  # a small model: smaller groups keep the padding small
        start_method="forkserver",  # the ranks fork from a server that imported torch and Lightning once
    )
    trainer = Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_model_summary=False, gradient_clip_val=1.0,
    )  # fmt: skip
    model = Regressor()
    trainer.fit(model)
    if trainer.is_global_zero:
        print(f"final train/loss {float(trainer.callback_metrics['train/loss']):.4f}")
        for name, value in sorted(trainer.callback_metrics.items()):
            if name.startswith("sdp4bit/"):
                print(f"{name:40s} {float(value):.4g}")


if __name__ == "__main__":
    main()
