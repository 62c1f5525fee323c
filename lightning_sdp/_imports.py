"""Lazy checks for optional extras.

Nothing here imports an optional package: ``RequirementCache`` only looks the distribution up, so
``import lightning_sdp`` stays fast and works with only the core installed.
"""

from __future__ import annotations

from lightning_utilities.core.imports import RequirementCache

_OPEN_CLIP_AVAILABLE = RequirementCache("open_clip_torch", "open_clip")
_TRITON_AVAILABLE = RequirementCache("triton")
_NUMBA_AVAILABLE = RequirementCache("numba")
_H5PY_AVAILABLE = RequirementCache("h5py")
_SKLEARN_AVAILABLE = RequirementCache("scikit-learn", "sklearn")

_EXTRA_OF = {
    "open_clip": "clip",
    "triton": "triton",
    "numba": "cpu",
    "h5py": "core",
    "sklearn": "clip",
}
_CACHE_OF = {
    "open_clip": _OPEN_CLIP_AVAILABLE,
    "triton": _TRITON_AVAILABLE,
    "numba": _NUMBA_AVAILABLE,
    "h5py": _H5PY_AVAILABLE,
    "sklearn": _SKLEARN_AVAILABLE,
}


def require(module: str, feature: str = "") -> None:
    """Raise a ``ModuleNotFoundError`` that names the extra to install when ``module`` is missing.

    Args:
        module: importable module name, one of ``open_clip``, ``triton``, ``numba``, ``h5py``, ``sklearn``.
        feature: what the caller wanted to do, quoted in the message.
    """
    cache = _CACHE_OF[module]
    if cache:
        return
    extra = _EXTRA_OF[module]
    what = f" for {feature}" if feature else ""
    if extra == "core":
        hint = "pip install 'lightning-sdp'"
    else:
        hint = f"pip install 'lightning-sdp[{extra}]'"
    raise ModuleNotFoundError(f"`{module}` is needed{what} but is not installed. Install it with: {hint}")
