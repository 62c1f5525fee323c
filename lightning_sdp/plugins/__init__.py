"""Strategies and accelerators. Imported lazily."""

from lightning_sdp._lazy import lazy_exports

_EXPORTS = {
    "SDP4BitStrategy": "lightning_sdp.plugins.sdp4bit",
    "HEATAccelerator": "lightning_sdp.plugins.heat",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
