"""LightningModules. Imported lazily: naming a model imports only its own module.

``fit_simplex_within_budget`` is a recipe that drives Trainer runs, not a module: it lives in
:mod:`lightning_sdp.recipes` and is named here too so that ``from lightning_sdp.models import
fit_simplex_within_budget`` keeps working.
"""

from lightning_sdp._lazy import lazy_exports

_EXPORTS = {
    "GPT": "lightning_sdp.models.gpt",
    "FastCLIPModule": "lightning_sdp.models.fastclip",
    "SimpleXModule": "lightning_sdp.models.simplex",
    "PtychoNN": "lightning_sdp.models.ptychonn",
    "fit_simplex_within_budget": "lightning_sdp.recipes",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
