"""The package's layers point one way, and benchmarks use only public names (issue 18).

Both tests read the source statically (``ast``), so an import hidden inside a function counts as much as one at the
top of a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_sdp"

# Lower layers (data, kernels, EngineProfiler's analysis, adapters to optional libraries) must not reach up into
# the Lightning parts.
LOWER = ("kernels", "profiling", "datamodules", "integrations")
UPPER = ("lightning_sdp.callbacks", "lightning_sdp.models", "lightning_sdp.plugins")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imported_modules(path: Path, source: str | None = None, module: str | None = None) -> list[tuple[int, str]]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names, relative imports resolved."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    package = (module or _module_name(path)).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _lower_modules() -> list[Path]:
    return sorted(p for layer in LOWER for p in (PACKAGE / layer).rglob("*.py"))


@pytest.mark.parametrize("path", _lower_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_lower_layers_do_not_import_callbacks_models_or_plugins(path: Path) -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for line, name in _imported_modules(path)
        if any(name == upper or name.startswith(upper + ".") for upper in UPPER)
    ]
    assert not bad, "imports that point up:\n" + "\n".join(bad)


def test_the_layering_check_sees_imports_inside_functions() -> None:
    source = "def f():\n    from lightning_sdp.models.gpt import GPT\n    from ..plugins import heat\n"
    names = [name for _, name in _imported_modules(Path("probe.py"), source, "lightning_sdp.datamodules.probe")]
    assert "lightning_sdp.models.gpt" in names
    assert "lightning_sdp.plugins" in names


def _benchmarks() -> list[Path]:
    return sorted((ROOT / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", _benchmarks(), ids=lambda p: p.name)
def test_benchmarks_use_only_public_package_names(path: Path) -> None:
    bad = []
    source = path.read_text()
    for line, name in _imported_modules(path):
        if name.startswith("lightning_sdp") and any(part.startswith("_") for part in name.split(".")):
            bad.append(f"{path.name}:{line} imports {name}")
    assert not bad, "benchmarks must import public names only:\n" + "\n".join(bad)
    assert "sys.path.insert" not in source, f"{path.name}: run benchmarks as `python -m benchmarks.<name>`"
    assert "noqa: E402" not in source, f"{path.name}: imports belong at the top (run as a module)"
