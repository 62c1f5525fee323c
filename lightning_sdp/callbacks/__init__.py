"""Callbacks. Imported lazily."""

from lightning_sdp._lazy import lazy_exports

_EXPORTS = {
    "EngineProfiler": "lightning_sdp.callbacks.engine_profiler",
    "GammaModule": "lightning_sdp.callbacks.fastclip",
    "GammaScheduler": "lightning_sdp.callbacks.fastclip",
    "SolarMetrics": "lightning_sdp.callbacks.solar",
    "TemperatureModule": "lightning_sdp.callbacks.fastclip",
    "TemperatureScheduler": "lightning_sdp.callbacks.fastclip",
    "ZeroShotEvaluation": "lightning_sdp.callbacks.fastclip",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
