"""Strategies, accelerators and checkpoint IO. Imported lazily."""

from lightning_sdp._lazy import lazy_exports

_EXPORTS = {
    "SDP4BitStrategy": "lightning_sdp.plugins.sdp4bit",
    "HEATAccelerator": "lightning_sdp.plugins.heat",
    "VerifiedCheckpointIO": "lightning_sdp.plugins.checkpoint_io",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
