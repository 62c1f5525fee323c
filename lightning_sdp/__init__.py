"""lightning-sdp: PyTorch Lightning plugins that make training cheaper on limited hardware.

Public classes are imported lazily, so ``import lightning_sdp`` imports no optional extra (open_clip, triton,
numba) nor Lightning itself. The string aliases (``strategy="sdp4bit"``, ``accelerator="heat"``) are registered on
import, or, when ``lightning.pytorch`` is not loaded yet, the moment it is (see ``_registry.register_on_import``).
"""

from __future__ import annotations

from lightning_sdp._lazy import lazy_exports
from lightning_sdp._registry import register_on_import

__version__ = "0.1.0"

_EXPORTS = {
    # plugins
    "SDP4BitStrategy": "lightning_sdp.plugins.sdp4bit",
    "SDP4BitConfig": "lightning_sdp.plugins.sdp4bit",
    "HEATAccelerator": "lightning_sdp.plugins.heat",
    "VerifiedCheckpointIO": "lightning_sdp.plugins.checkpoint_io",
    # models
    "GPT": "lightning_sdp.models.gpt",
    "FastCLIPModule": "lightning_sdp.models.fastclip",
    "SimpleXModule": "lightning_sdp.models.simplex",
    # callbacks
    "EngineProfiler": "lightning_sdp.callbacks.engine_profiler",
    "GammaScheduler": "lightning_sdp.callbacks.fastclip",
    "TemperatureScheduler": "lightning_sdp.callbacks.fastclip",
    "ZeroShotEvaluation": "lightning_sdp.callbacks.fastclip",
    # data
    "CharTextDataModule": "lightning_sdp.datamodules.text",
    "SolarDataModule": "lightning_sdp.datamodules.solar",
    "ImageTextDataModule": "lightning_sdp.datamodules.image_text",
    "InteractionsDataModule": "lightning_sdp.datamodules.interactions",
    # metrics
    "RecallAtK": "lightning_sdp.metrics",
    "NDCGAtK": "lightning_sdp.metrics",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

register_on_import()
