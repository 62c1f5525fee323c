"""The single place where lightning-sdp adds string aliases to Lightning's registries.

Aliases are registered on ``import lightning_sdp``. Registration is idempotent, never overrides a name that
somebody else registered, and only registers plugins whose module exists in this installation.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Alias:
    name: str
    module: str
    cls: str
    description: str
    init_params: dict[str, Any] = field(default_factory=dict)


STRATEGY_ALIASES: tuple[_Alias, ...] = (
    _Alias(
        "sdp4bit",
        "lightning_sdp.plugins.sdp4bit",
        "SDP4BitStrategy",
        "Sharded data parallelism with 4-bit weight-difference and two-level gradient quantisation (SDP4Bit).",
    ),
    _Alias(
        "sdp4bit_spawn",
        "lightning_sdp.plugins.sdp4bit",
        "SDP4BitStrategy",
        "SDP4Bit launched with torch.multiprocessing spawn (notebooks, tests).",
        {"start_method": "spawn"},
    ),
)

ACCELERATOR_ALIASES: tuple[_Alias, ...] = (
    _Alias(
        "heat",
        "lightning_sdp.plugins.heat",
        "HEATAccelerator",
        "Multi-core CPU accelerator with fused, lock-free collaborative-filtering kernels (HEAT).",
    ),
)


def _resolve(alias: _Alias) -> type | None:
    if importlib.util.find_spec(alias.module) is None:
        return None
    try:
        module = importlib.import_module(alias.module)
    except Exception as err:  # a broken plugin must not break `import lightning.pytorch`
        _log.warning(
            "lightning-sdp: alias %r is not registered because %s failed to import: %s: %s",
            alias.name,
            alias.module,
            type(err).__name__,
            err,
        )
        return None
    return getattr(module, alias.cls, None)


def _register(registry: Any, alias: _Alias, cls: type, kind: str) -> bool:
    """Register ``cls`` under ``alias.name`` unless the name is taken. Returns whether the name is ours."""
    if alias.name in registry:
        existing = registry[alias.name]
        registered_cls = existing.get(kind) if isinstance(existing, dict) else None
        if (
            registered_cls is not None
            and getattr(registered_cls, "__qualname__", None) == cls.__qualname__
            and (getattr(registered_cls, "__module__", None) == cls.__module__)
        ):
            return True  # ours from an earlier import or a reload
        _log.warning(
            "lightning-sdp: %s alias %r is already registered to %r; leaving it as it is. Use the class %s.%s "
            "directly to get the lightning-sdp plugin.",
            kind,
            alias.name,
            registered_cls,
            alias.module,
            alias.cls,
        )
        return False
    registry.register(alias.name, cls, description=alias.description, **alias.init_params)
    return True


def register_class_aliases(cls: type) -> None:
    """Register the aliases of a plugin class; called at the bottom of the plugin's own module.

    Needed because a plugin module can be what first imports ``lightning.pytorch``: the import hook then runs
    :func:`register_all` while the plugin module is half executed and its class does not exist yet.
    """
    if "lightning.pytorch" not in sys.modules:
        return
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    for aliases, registry, kind in (
        (STRATEGY_ALIASES, StrategyRegistry, "strategy"),
        (ACCELERATOR_ALIASES, AcceleratorRegistry, "accelerator"),
    ):
        for alias in aliases:
            if alias.cls == cls.__name__ and cls.__module__.startswith(alias.module):
                _register(registry, alias, cls, kind)


def register_all() -> dict[str, bool]:
    """Register every alias whose plugin exists. Safe to call any number of times.

    Returns:
        A map from alias to whether it now resolves to the lightning-sdp plugin.
    """
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    status: dict[str, bool] = {}
    for alias in STRATEGY_ALIASES:
        cls = _resolve(alias)
        if cls is not None:
            status[alias.name] = _register(StrategyRegistry, alias, cls, "strategy")
    for alias in ACCELERATOR_ALIASES:
        cls = _resolve(alias)
        if cls is not None:
            status[alias.name] = _register(AcceleratorRegistry, alias, cls, "accelerator")
    return status


_HOOK_MARK = "_lightning_sdp_registration_hook"


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """Runs :func:`register_all` right after ``lightning.pytorch`` finishes importing.

    Importing ``lightning.pytorch`` takes 3-4 s; deferring registration to the moment the user imports it keeps
    ``import lightning_sdp`` fast, and the aliases are in place before any ``Trainer`` can be built.
    """

    _lightning_sdp_registration_hook = True

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "lightning.pytorch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            original_exec(module)
            _remove_hooks()
            register_all()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _remove_hooks() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, _HOOK_MARK, False)]


def register_on_import() -> None:
    """Register now if ``lightning.pytorch`` is loaded, otherwise as soon as it is. Idempotent."""
    if "lightning.pytorch" in sys.modules:
        _remove_hooks()
        register_all()
    elif not any(getattr(f, _HOOK_MARK, False) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenLightningLoads())
