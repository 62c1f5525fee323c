"""``SolarMetrics``: logs the SOLAR loader's counters (Sun et al., arXiv 2211.00224) through the Trainer's loggers."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_sdp.datamodules.solar.loader import SolarLoader


def _solar_loader(trainer: Trainer) -> SolarLoader | None:
    loader = getattr(trainer.datamodule, "train_loader", None)  # type: ignore[attr-defined]
    return loader if isinstance(loader, SolarLoader) else None


class SolarMetrics(Callback):
    """Logs the SOLAR loader's counters through ``pl_module.log`` (so every Trainer logger shows them).

    Add it to the Trainer next to a :class:`~lightning_sdp.datamodules.solar.SolarDataModule`:
    ``Trainer(callbacks=[SolarMetrics()])``. With any other DataModule it logs nothing.

    Per training step, this rank's values (no collective in the step): ``solar/hit_rate`` (buffer hits / local
    batch), ``solar/storage_bytes`` (bytes read from storage), ``solar/samples_per_s`` (local samples per second
    of wall time between batches) and ``solar/load_time_s`` (time the loop waited for the batch).

    Per epoch, over all ranks (one all-reduce each at the end of the epoch): ``solar/epoch_hit_rate`` (mean over
    ranks), ``solar/epoch_storage_bytes`` (sum), ``solar/epoch_samples_per_s`` (sum: global throughput) and
    ``solar/epoch_load_time_s`` (mean waiting time per step).
    """

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loader = _solar_loader(trainer)
        if loader is None or loader.last_stats is None:
            return
        s = loader.last_stats
        n = max(s.samples, 1)
        for name, value in (
            ("hit_rate", s.hit_rate),
            ("storage_bytes", float(s.storage_bytes)),
            ("samples_per_s", s.samples_per_s),
            ("load_time_s", s.wait_s),
        ):
            pl_module.log(f"solar/{name}", float(value), on_step=True, on_epoch=False, batch_size=n)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loader = _solar_loader(trainer)
        if loader is None or not loader.epoch_stats.steps:
            return
        e = loader.epoch_stats
        log: dict[str, Any] = dict(on_step=False, on_epoch=True, sync_dist=True, batch_size=1)
        pl_module.log("solar/epoch_hit_rate", e.hit_rate, **log)
        pl_module.log("solar/epoch_storage_bytes", float(e.storage_bytes), reduce_fx="sum", **log)
        pl_module.log("solar/epoch_samples_per_s", e.samples_per_s, reduce_fx="sum", **log)
        pl_module.log("solar/epoch_load_time_s", e.wait_s / e.steps, **log)
