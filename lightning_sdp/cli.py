"""The ``lightning-sdp`` console script.

``lightning-sdp fit|validate|test|predict --config cfg.yaml`` is a LightningCLI in subclass mode: configs name any
LightningModule / LightningDataModule by class path, and, because this module imports ``lightning_sdp``, the
string aliases (``strategy: sdp4bit``, ``accelerator: heat``) work in YAML. ``lightning-sdp demo`` runs the main job
on built-in data and prints where its results went. Tools of individual plugins are sub-commands too
(``lightning-sdp tools`` lists them).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence

import lightning_sdp  # noqa: F401  (registers the string aliases)

# name -> ("module:function", help). Each function takes argv (list[str]) and returns an exit code or None.
_TOOLS: dict[str, tuple[str, str]] = {
    "demo": ("lightning_sdp.demo:main", "run the main job on built-in data and print where its results went"),
}


def _optional_tools() -> dict[str, tuple[str, str]]:
    """Sub-commands contributed by plugins; only those whose module exists in this installation."""
    candidates = {
        "ptycho-generate": (
            "lightning_sdp.datamodules.solar.ptycho:main",
            "write a PtychoNN-like HDF5 data set for SOLAR",
        ),
        "sequence-sweep": (
            "lightning_sdp.callbacks.engine_profiler.sweep:main",
            "EngineProfiler's sequence-length study of a GPT",
        ),
        "engine-bench": (
            "lightning_sdp.profiling.engine_bench:main",
            "measure this device's matrix/vector engine ceilings (device profile JSON + roofline PNG)",
        ),
    }
    found = {}
    for name, (target, help_) in candidates.items():
        module = target.split(":")[0]
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is not None:
            found[name] = (target, help_)
    return found


def _load(target: str) -> Callable[[list[str]], int | None]:
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def _print_tools(tools: dict[str, tuple[str, str]]) -> None:
    print("lightning-sdp sub-commands besides fit/validate/test/predict:")
    for name, (_, help_) in sorted(tools.items()):
        print(f"  {name:<16} {help_}")


def cli_main(args: Sequence[str] | None = None, run: bool = True) -> object:
    """Build the LightningCLI (subclass mode for model and data). ``run=False`` only parses and instantiates."""
    from lightning.pytorch.cli import LightningCLI

    return LightningCLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=list(args) if args is not None else None,
        run=run,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lightning-sdp`` console script.

    Args:
        argv: the arguments; ``None`` (the console script) reads ``sys.argv[1:]``, which LightningCLI is then left to
            read itself, so it does not warn that ``args`` is meant for calls from Python.
    """
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    tools = {**_TOOLS, **_optional_tools()}
    if argv and argv[0] == "tools":
        _print_tools(tools)
        return 0
    if argv and argv[0] in tools:
        code = _load(tools[argv[0]][0])(argv[1:])
        return int(code or 0)
    try:
        cli_main(None if from_command_line else argv)
    except ValueError as err:
        # Lightning's message for an unknown strategy/accelerator alias; add what lightning-sdp offers.
        if "invalid" in str(err) and ("strategy" in str(err) or "accelerator" in str(err)):
            raise ValueError(
                f"{err}\nlightning-sdp adds the aliases 'sdp4bit', 'sdp4bit_spawn' (strategy) and 'heat' "
                f"(accelerator); check the spelling in your config."
            ) from err
        raise
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
