"""The package's layers point one way, and benchmarks use only public names.

Both tests read the source statically (``ast``), so an import hidden inside a function counts as much as one at the
top of a module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_sdp"

# Lower layers (data, kernels, EngineProfiler's analysis, adapters to optional libraries) must not reach up into
# the Lightning parts.
LOWER = ("kernels", "profiling", "datamodules", "integrations")
UPPER = ("lightning_sdp.callbacks", "lightning_sdp.models", "lightning_sdp.plugins")
# Recipes drive Trainer runs of the modules (as open_clip_train drives open_clip): they may import any layer below
# (models, datamodules, metrics, kernels, plugins), and no layer imports them, only the entry points (CLI, demo).
# ``lightning_sdp.models`` names ``fit_simplex_within_budget`` as a lazy alias (a string, not an import).
RECIPES = "lightning_sdp.recipes"
ENTRY_POINTS = ("lightning_sdp.cli", "lightning_sdp.demo")


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


def _names(names: list[tuple[int, str]], prefixes: tuple[str, ...]) -> list[tuple[int, str]]:
    return [(line, name) for line, name in names if any(name == p or name.startswith(p + ".") for p in prefixes)]


def _modules_below_recipes() -> list[Path]:
    return sorted(
        p
        for p in PACKAGE.rglob("*.py")
        if not _names([(0, _module_name(p))], (RECIPES, *ENTRY_POINTS)) and p != PACKAGE / "__init__.py"
    )


@pytest.mark.parametrize("path", _modules_below_recipes(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_layer_imports_the_recipes(path: Path) -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {name}" for line, name in _names(_imported_modules(path), (RECIPES,))
    ]
    assert not bad, "the library must not depend on its recipes:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", sorted((PACKAGE / "recipes").rglob("*.py")), ids=lambda p: p.name)
def test_recipes_do_not_import_the_entry_points(path: Path) -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for line, name in _names(_imported_modules(path), ENTRY_POINTS)
    ]
    assert not bad, "recipes are imported by the CLI and the demo, not the other way round:\n" + "\n".join(bad)


def test_the_recipe_layer_rules_see_a_model_importing_a_recipe() -> None:
    source = "from lightning_sdp.recipes import fit_simplex_within_budget\n"
    names = _imported_modules(Path("probe.py"), source, "lightning_sdp.models.probe")
    assert _names(names, (RECIPES,)) and not _names(names, ENTRY_POINTS)
    assert PACKAGE / "models" / "simplex" / "module.py" in _modules_below_recipes()
    assert PACKAGE / "recipes" / "budget.py" not in _modules_below_recipes()


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


def _exported_names() -> list[tuple[Path, str]]:
    """Every name a package module lists in ``__all__``, with its module."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                items = getattr(node.value, "elts", [])
                found += [(path, e.value) for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return found


def _names_used(path: Path) -> set[str]:
    """Names a module reads (``name``, ``obj.name``), not the ones it only defines or lists in ``__all__``."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
    return used


def test_the_library_exports_nothing_only_a_benchmark_uses() -> None:
    # a public name the benchmarks use must also serve users: read by code of the package (outside the re-exports of
    # an __init__), or shown in the README, a guide or an example; otherwise it belongs in benchmarks/tools
    used_by_package = set().union(*(_names_used(p) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"))
    user_text = "\n".join(
        p.read_text(errors="ignore")
        for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").rglob("*")]
        if p.is_file()
    )
    bench_text = "\n".join(p.read_text() for p in (ROOT / "benchmarks").rglob("*.py"))
    only_for_benchmarks = [
        f"{path.relative_to(ROOT)}: {name}"
        for path, name in _exported_names()
        if re.search(rf"\b{re.escape(name)}\b", bench_text)
        and name not in used_by_package
        and not re.search(rf"\b{re.escape(name)}\b", user_text)
    ]
    assert not only_for_benchmarks, "exported by the library only for benchmarks:\n" + "\n".join(only_for_benchmarks)
