"""EngineProfiler's analysis (lightning_sdp.profiling) imports nothing from callbacks, models or plugins."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_sdp.profiling

UPWARD = ("lightning_sdp.callbacks", "lightning_sdp.models", "lightning_sdp.plugins")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):  # every level, including imports inside functions
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_profiling_imports_point_down_only():
    root = Path(lightning_sdp.profiling.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 5
    upward = {f"{p.relative_to(root)}: {name}" for p in files for name in _imports(p) if name.startswith(UPWARD)}
    assert upward == set()
