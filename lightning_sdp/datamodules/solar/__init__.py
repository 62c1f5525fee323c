"""SOLAR: schedule-aware loading of large HDF5 data for distributed surrogate training (arXiv 2211.00224).

The names here are what a user calls; the loader, reader, buffer and read-plan modules stay importable by their full
path (``lightning_sdp.datamodules.solar.reader``, ...). Names are imported lazily, so the generator CLI
(``python -m lightning_sdp.datamodules.solar.ptycho``) and the schedule do not import Lightning.
"""

from lightning_sdp._lazy import lazy_exports

_EXPORTS = {
    "SolarDataModule": "lightning_sdp.datamodules.solar.datamodule",
    "SolarReadOptions": "lightning_sdp.datamodules.solar.options",
    "SolarSchedule": "lightning_sdp.datamodules.solar.schedule",
    "StorageProfile": "lightning_sdp.datamodules.solar.readplan",
    "make_ptycho_h5": "lightning_sdp.datamodules.solar.ptycho",
    "per_sample_loss_scale": "lightning_sdp.datamodules.solar.datamodule",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
