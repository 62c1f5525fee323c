"""Add EngineProfiler to an existing Lightning project: one line in the Trainer.

The LightningModule below is a plain user model (a small ``torch.nn.TransformerEncoder`` classifier on random
tokens) that knows nothing about lightning-sdp. Adding ``EngineProfiler()`` to ``callbacks`` profiles three steps
and prints where the time goes: matrix engine (matmuls) vs vector engines (softmax, norms, activations,
optimizer), per module group, with FLOPs and findings. Run from the repository root:

    .venv/bin/python examples/engine_profiler_transformer.py --seq-len 256

Outputs land in ``runs/engine_profiler_example/`` (JSON report, gzip Chrome trace for chrome://tracing or Perfetto,
PNG). On a GPU pass ``--accelerator cuda --precision bf16-mixed`` to see tensor-core use.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sdp.callbacks import EngineProfiler


class TokenClassifier(LightningModule):
    """A small Transformer encoder that classifies token sequences (the 'existing project')."""

    def __init__(self, vocab: int = 100, d_model: int = 128, n_heads: int = 4, n_layers: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(dim=1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--precision", default="32-true")
    args = p.parse_args()
    x = torch.randint(0, 100, (16 * args.batch_size, args.seq_len))
    y = (x[:, 0] % 2).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size)
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        # The only line lightning-sdp adds to the project:
        callbacks=[EngineProfiler(wait=2, warmup=1, active=3, dirpath="runs/engine_profiler_example")],
    )
    trainer.fit(TokenClassifier(), loader)


if __name__ == "__main__":
    main()
