"""LightningDataModules and their datasets. Imported lazily."""

from lightning_sdp._lazy import lazy_exports

_EXPORTS = {
    "CharTextDataModule": "lightning_sdp.datamodules.text",
    "SolarDataModule": "lightning_sdp.datamodules.solar",
    "ImageTextDataModule": "lightning_sdp.datamodules.image_text",
    "InteractionsDataModule": "lightning_sdp.datamodules.interactions",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
