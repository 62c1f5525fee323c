"""Test set-up shared by the whole suite.

``TRITON_INTERPRET=1`` must be set before any kernel module (and so triton) is imported: this file is imported by
pytest before any test module, so setting it here runs every Triton kernel in the CPU interpreter.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# Two cores in CI and tiny tensors in tests: one thread per process avoids oversubscription (threads waiting on
# each other made tiny backward passes tens of times slower on a loaded 2-core machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# EngineProfiler caches measured engine ceilings per device; the suite must not write into the user's ~/.cache.
if "LIGHTNING_SDP_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["LIGHTNING_SDP_CACHE_DIR"] = tempfile.mkdtemp(prefix="lightning_sdp_test_cache_")
    atexit.register(shutil.rmtree, os.environ["LIGHTNING_SDP_CACHE_DIR"], ignore_errors=True)

# Imported only after the environment above is set (lightning_sdp may import triton and torch reads it).
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sdp._imports import (
    _NUMBA_AVAILABLE,
    _OPEN_CLIP_AVAILABLE,
    _SKLEARN_AVAILABLE,
    _TRITON_AVAILABLE,
)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

_MARKER_CHECKS = {
    "cuda": (lambda: torch.cuda.is_available(), "needs a CUDA device"),
    "gpu": (lambda: torch.cuda.is_available(), "needs a GPU"),
    "triton": (lambda: bool(_TRITON_AVAILABLE), "needs triton (pip install 'lightning-sdp[triton]')"),
    "open_clip": (lambda: bool(_OPEN_CLIP_AVAILABLE), "needs open_clip_torch (pip install 'lightning-sdp[clip]')"),
    "numba": (lambda: bool(_NUMBA_AVAILABLE), "needs numba (pip install 'lightning-sdp[cpu]')"),
    "sklearn": (lambda: bool(_SKLEARN_AVAILABLE), "needs scikit-learn (pip install 'lightning-sdp[clip]')"),
    "shared_data": (lambda: SHARED_DATA.is_dir(), f"needs the real data sets in {SHARED_DATA}"),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for name, (available, reason) in _MARKER_CHECKS.items():
            if item.get_closest_marker(name) is not None and not available():
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _seed_and_threads() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def _close_solar_loaders() -> Iterator[None]:
    """Close the SOLAR loaders a test module leaves open (after its last test, so module fixtures keep theirs).

    Each holds a read-ahead thread and its I/O threads; left open they pile up in the test worker, and forking a
    DataLoader worker from a process with dozens of idle threads once stalled the suite for ten minutes.
    """
    from lightning_sdp.datamodules.solar.loader import SolarLoader

    created: weakref.WeakSet[SolarLoader] = weakref.WeakSet()
    init = SolarLoader.__init__

    def tracked_init(self: SolarLoader, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        created.add(self)

    SolarLoader.__init__ = tracked_init  # type: ignore[method-assign]
    yield
    SolarLoader.__init__ = init  # type: ignore[method-assign]
    for loader in list(created):
        loader.close()
        loader.reader.close()  # its I/O thread pool


@pytest.fixture
def shared_data() -> Path:
    """Path of ``../shared/data``; tests using it must also carry ``@pytest.mark.shared_data``."""
    return SHARED_DATA
