"""Package-level behaviour: fast lazy import, alias registration, optional-extra errors."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

import lightning_sdp
from lightning_sdp import _imports, _registry
from lightning_sdp._registry import _Alias


def _run_python(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_pulls_in_no_heavy_or_optional_module():
    heavy = ["torch", "lightning", "lightning.pytorch", "open_clip", "triton", "numba", "h5py", "sklearn"]
    stdout = _run_python(
        f"""
        import sys, lightning_sdp
        print([m for m in {heavy!r} if m in sys.modules])
        """
    )
    assert stdout.strip() == "[]"


@pytest.mark.slow  # a fresh interpreter: the import order is what is tested
def test_aliases_registered_when_lightning_is_imported_after_the_package():
    stdout = _run_python(
        """
        import importlib.util, lightning_sdp
        from lightning_sdp._registry import ACCELERATOR_ALIASES, STRATEGY_ALIASES
        from lightning.pytorch.accelerators import AcceleratorRegistry
        from lightning.pytorch.strategies import StrategyRegistry
        for a in STRATEGY_ALIASES:
            exists = importlib.util.find_spec(a.module) is not None
            assert (a.name in StrategyRegistry) == exists, a.name
        for a in ACCELERATOR_ALIASES:
            exists = importlib.util.find_spec(a.module) is not None
            assert (a.name in AcceleratorRegistry) == exists, a.name
        importlib.reload(lightning_sdp)  # idempotent: no "already registered" error
        lightning_sdp._registry.register_all()
        print("ok")
        """
    )
    assert stdout.strip() == "ok"


@pytest.fixture
def test_alias(monkeypatch):
    # imported before the aliases are patched: a first import of lightning.pytorch runs register_all (the import
    # hook), which would register the test alias before the test does
    from lightning.pytorch.strategies import StrategyRegistry

    alias = _Alias(
        "lsdp_test_ddp", "lightning.pytorch.strategies", "DDPStrategy", "test alias", {"start_method": "spawn"}
    )
    monkeypatch.setattr(_registry, "STRATEGY_ALIASES", (alias,))
    monkeypatch.setattr(_registry, "ACCELERATOR_ALIASES", ())
    yield alias, StrategyRegistry
    StrategyRegistry.pop(alias.name, None)


def test_register_all_is_idempotent_and_builds_strategies(test_alias):
    alias, registry = test_alias
    assert _registry.register_all() == {alias.name: True}
    assert _registry.register_all() == {alias.name: True}
    from lightning.pytorch.strategies import DDPStrategy

    strategy = registry.get(alias.name)
    assert isinstance(strategy, DDPStrategy)
    assert strategy._start_method == "spawn"


def test_register_all_never_overrides_a_user_registration(test_alias, caplog):
    alias, registry = test_alias
    from lightning.pytorch.strategies import SingleDeviceStrategy

    registry.register(alias.name, SingleDeviceStrategy, description="the user's own")
    with caplog.at_level("WARNING"):
        assert _registry.register_all() == {alias.name: False}
    assert registry[alias.name]["strategy"] is SingleDeviceStrategy
    assert "already registered" in caplog.text


def test_register_only_what_exists(monkeypatch):
    missing = _Alias("lsdp_missing", "lightning_sdp.plugins.does_not_exist", "Nope", "missing")
    monkeypatch.setattr(_registry, "STRATEGY_ALIASES", (missing,))
    monkeypatch.setattr(_registry, "ACCELERATOR_ALIASES", ())
    from lightning.pytorch.strategies import StrategyRegistry

    assert _registry.register_all() == {}
    assert "lsdp_missing" not in StrategyRegistry


def test_unknown_public_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        lightning_sdp.Nope  # noqa: B018
    assert "GPT" in dir(lightning_sdp)


def test_public_names_resolve_to_their_modules():
    import importlib.util

    for name, module in lightning_sdp._EXPORTS.items():
        if importlib.util.find_spec(module) is None:
            continue  # plugin not in this installation
        assert getattr(lightning_sdp, name).__name__ == name


def test_missing_extra_names_the_extra(monkeypatch):
    monkeypatch.setitem(_imports._CACHE_OF, "numba", _imports.RequirementCache("surely-not-installed-pkg-xyz"))
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-sdp\[cpu\]'"):
        _imports.require("numba", "the HEAT kernels")
    _imports.require("h5py")  # installed with the core: no error
    importlib.reload(_imports)


def test_a_plugin_that_fails_to_import_is_reported_not_fatal(monkeypatch, caplog):
    broken = _Alias("lsdp_broken", "tests._broken_plugin", "Broken", "broken")
    monkeypatch.setattr(_registry, "STRATEGY_ALIASES", (broken,))
    monkeypatch.setattr(_registry, "ACCELERATOR_ALIASES", ())
    with caplog.at_level("WARNING"):
        assert _registry.register_all() == {}
    assert "failed to import" in caplog.text and "lsdp_broken" in caplog.text


@pytest.mark.slow  # a fresh interpreter: the import order is what is tested
def test_aliases_registered_when_a_plugin_module_imports_lightning_first():
    stdout = _run_python(
        """
        import importlib.util, subprocess, sys
        from lightning_sdp._registry import ACCELERATOR_ALIASES, STRATEGY_ALIASES
        by_module = {}
        for a in STRATEGY_ALIASES + ACCELERATOR_ALIASES:
            if importlib.util.find_spec(a.module) is not None:
                by_module.setdefault(a.module, []).append(a)
        # a fresh interpreter per plugin module (the module is what imports lightning.pytorch), all at once
        procs = []
        for module, aliases in by_module.items():
            code = (
                f"import {module} as m;"
                "from lightning.pytorch.accelerators import AcceleratorRegistry;"
                "from lightning.pytorch.strategies import StrategyRegistry;"
                + "".join(
                    f"getattr(m, {a.cls!r});"
                    f"assert {a.name!r} in StrategyRegistry or {a.name!r} in AcceleratorRegistry, {a.name!r};"
                    for a in aliases
                )
            )
            procs.append(subprocess.Popen([sys.executable, "-c", code]))
        codes = [p.wait(timeout=120) for p in procs]
        assert len(procs) >= 2 and codes == [0] * len(procs), codes
        print("ok")
        """
    )
    assert stdout.strip() == "ok"
