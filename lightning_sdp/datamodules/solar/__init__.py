"""SOLAR: schedule-aware loading of large HDF5 data for distributed surrogate training (arXiv 2211.00224).

Public names are imported lazily, so the generator CLI (``python -m lightning_sdp.datamodules.solar.ptycho``) and
the schedule do not import Lightning.
"""

from lightning_sdp._lazy import lazy_exports

_EXPORTS = {
    "SolarDataModule": "lightning_sdp.datamodules.solar.datamodule",
    "per_sample_loss_scale": "lightning_sdp.datamodules.solar.datamodule",
    "SolarLoader": "lightning_sdp.datamodules.solar.loader",
    "BatchReader": "lightning_sdp.datamodules.solar.loader",
    "StepStats": "lightning_sdp.datamodules.solar.loader",
    "EpochStats": "lightning_sdp.datamodules.solar.loader",
    "no_collate": "lightning_sdp.datamodules.solar.loader",
    "PerSampleHDF5Dataset": "lightning_sdp.datamodules.solar.baseline",
    "SolarSchedule": "lightning_sdp.datamodules.solar.schedule",
    "SimulationReport": "lightning_sdp.datamodules.solar.schedule",
    "StepPlan": "lightning_sdp.datamodules.solar.schedule",
    "RankStep": "lightning_sdp.datamodules.solar.schedule",
    "order_epochs": "lightning_sdp.datamodules.solar.schedule",
    "Buffer": "lightning_sdp.datamodules.solar.buffer",
    "make_buffer": "lightning_sdp.datamodules.solar.buffer",
    "parse_size": "lightning_sdp.datamodules.solar.buffer",
    "EVICTION_POLICIES": "lightning_sdp.datamodules.solar.buffer",
    "HDF5Reader": "lightning_sdp.datamodules.solar.reader",
    "StorageThrottle": "lightning_sdp.datamodules.solar.reader",
    "ThrottledFile": "lightning_sdp.datamodules.solar.reader",
    "coalesce_runs": "lightning_sdp.datamodules.solar.reader",
    "read_coalesced": "lightning_sdp.datamodules.solar.reader",
    "read_per_sample": "lightning_sdp.datamodules.solar.reader",
    "drop_page_cache": "lightning_sdp.datamodules.solar.reader",
    "inspect_h5": "lightning_sdp.datamodules.solar.reader",
    "FileChangedError": "lightning_sdp.datamodules.solar.reader",
    "FileIdentity": "lightning_sdp.datamodules.solar.reader",
    "data_fingerprint": "lightning_sdp.datamodules.solar.reader",
    "make_ptycho_h5": "lightning_sdp.datamodules.solar.ptycho",
    "StorageProfile": "lightning_sdp.datamodules.solar.readplan",
    "ReadPlan": "lightning_sdp.datamodules.solar.readplan",
    "plan_reads": "lightning_sdp.datamodules.solar.readplan",
    "probe_storage": "lightning_sdp.datamodules.solar.readplan",
    "simulate_ptycho": "lightning_sdp.datamodules.solar.ptycho",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
