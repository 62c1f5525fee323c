"""Running a throttled-storage benchmark's ``--quick`` mode, or checking why it refused (no root / no blkio)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR
from benchmarks.tools.device import check_root
from tests._warm_python import run_python

REPO = Path(__file__).resolve().parents[2]


def _storage_unavailable() -> str | None:
    try:
        check_root()
    except PermissionError as err:
        return str(err)
    return None


def run_quick(
    name: str, timeout: int, extra: tuple[str, ...] = (), results: str | None = None
) -> dict[str, Any] | None:
    """``python -m benchmarks.<name> --quick [extra]``: its quick results (``<results or name>_quick.json``), or
    ``None`` after checking that it refused clearly.

    Where the device cannot be built the benchmark must exit with code 2 and say why on stderr. The results are
    read from ``RESULTS_DIR`` (a temporary folder under pytest: ``tests/benchmarks/conftest.py``).
    """
    res = run_python(["-m", f"benchmarks.{name}", "--quick", *extra], cwd=REPO, timeout=timeout)
    reason = _storage_unavailable()
    if reason is not None:
        assert res.returncode == 2 and reason in res.stderr
        return None
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((RESULTS_DIR / f"{results or name}_quick.json").read_text())
