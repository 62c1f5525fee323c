"""Adding HEAT to an existing Lightning recommender project.

A project that already trains SimpleX / MF-CCL with plain PyTorch (``backend="reference"``) switches to HEAT's fused
multi-core CPU kernel by changing two arguments: the Trainer's accelerator and the model's backend. Data, metrics and
checkpoints stay the same.

    .venv/bin/python examples/heat_existing_project.py                      # synthetic data, a few seconds
    .venv/bin/python examples/heat_existing_project.py --data ../shared/data/gowalla --epochs 4
"""

from __future__ import annotations

import argparse
import time

from lightning.pytorch import Trainer

import lightning_sdp  # noqa: F401  (registers accelerator="heat")
from lightning_sdp import InteractionsDataModule, SimpleXModule


def train(backend: str, data: str | None, epochs: int) -> dict[str, float]:
    dm = InteractionsDataModule(data, batch_size=16384 if backend == "fused" else 512)
    model = SimpleXModule(
        dim=64,
        g=1.0,
        loss="ccl",  # SimpleX's cosine contrastive loss; the default "auto" chooses it or HEAT's softmax from the data
        margin=0.9,
        negative_weight=150.0,
        num_negatives=64,
        backend=backend,  # <- "reference" (plain PyTorch) or "fused" (HEAT)
        lr=0.5 if backend == "fused" else 1e-3,
    )
    trainer = Trainer(
        accelerator="heat" if backend == "fused" else "cpu",  # <- the HEAT accelerator owns the CPU threads
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=epochs,
    )
    start = time.perf_counter()
    trainer.fit(model, dm)
    m = trainer.callback_metrics
    return {
        "seconds": time.perf_counter() - start,
        "recall@20": float(m["val/recall@20"]),
        "ndcg@20": float(m["val/ndcg@20"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=None, help="LightGCN folder or CSV; default: built-in synthetic data")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    for backend in ("reference", "fused"):
        print(backend, train(backend, args.data, args.epochs))


if __name__ == "__main__":
    main()
