"""Add SOLAR loading to an existing Lightning surrogate project (PtychoNN on a synthetic diffraction set).

    .venv/bin/python examples/solar_ptycho.py                 # generate data if needed, size the buffer, train
    .venv/bin/python examples/solar_ptycho.py --epochs 1 --samples 512

The lines that change in an existing project are marked with ``# SOLAR``: the DataModule and the ``SolarMetrics``
callback that logs the ``solar/*`` metrics. A module that unpacks ``x, y = batch`` takes the default batches as they
are; this one asks for dict batches (``batch_format="dict"``), whose ``loss_scale`` PtychoNN uses to compute its loss
as ``batch["loss_scale"] * per_sample_losses.sum()``, which keeps DDP's gradient the global mean when SOLAR hands
ranks local batches of different sizes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl

from lightning_sdp.callbacks import SolarMetrics
from lightning_sdp.datamodules.solar import SolarDataModule, SolarSchedule, make_ptycho_h5
from lightning_sdp.models import PtychoNN


def size_the_buffer(num_samples: int, ranks: int, batch_size: int, sample_nbytes: int) -> None:
    """``SolarSchedule.simulate`` answers "how much does a buffer of this size save?" without touching data."""
    print(f"Planning for {ranks} ranks x batch {batch_size}, {num_samples} samples of {sample_nbytes} bytes:")
    for fraction in (0.1, 0.25, 0.5):
        buffer = int(fraction * num_samples)
        for eviction in ("lru", "belady"):
            report = SolarSchedule(num_samples, 3, ranks, batch_size, buffer_size=buffer, eviction=eviction).simulate(
                sample_nbytes=sample_nbytes
            )
            mib = [b / 2**20 for b in report.storage_bytes]
            print(
                f"  buffer {buffer:6d} ({fraction:.0%}) {eviction:6s}: hit rate per epoch "
                f"{[round(h, 3) for h in report.hit_rate]}, storage MiB per epoch {[round(m) for m in mib]}"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="runs/data/solar_ptycho_example.h5")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--buffer", default="12MiB", help="samples (int) or bytes ('12MiB')")
    args = parser.parse_args(argv)

    if not Path(args.data).exists():
        make_ptycho_h5(args.data, num_samples=args.samples, size=64, seed=0)
    size_the_buffer(args.samples, ranks=4, batch_size=args.batch_size, sample_nbytes=3 * 64 * 64 * 4)

    pl.seed_everything(0)
    datamodule = SolarDataModule(  # SOLAR
        args.data,
        input_key="diffraction",
        target_key=["amplitude", "phase"],
        batch_format="dict",  # ids and loss_scale (PtychoNN's DDP-exact loss); the default "pair" gives (x, y)
        batch_size=args.batch_size,
        buffer_size=int(args.buffer) if args.buffer.isdigit() else args.buffer,
        num_workers=1,
        val_split=0.1,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=args.epochs,
        callbacks=[SolarMetrics()],  # SOLAR
        log_every_n_steps=10,
        default_root_dir="runs/solar_example",
    )
    trainer.fit(PtychoNN(image_size=64, base_channels=8), datamodule)
    m = trainer.callback_metrics
    print(
        f"last epoch: buffer hit rate {float(m['solar/epoch_hit_rate']):.3f} (bound "
        f"{datamodule.schedule.bound:.3f}), storage {float(m['solar/epoch_storage_bytes']) / 2**20:.1f} MiB, "
        f"{float(m['solar/epoch_samples_per_s']):.0f} samples/s, val/loss {float(m['val/loss']):.4f}"
    )


if __name__ == "__main__":
    main()
