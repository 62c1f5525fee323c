"""The ``lightning-sdp`` console script.

``lightning-sdp fit|validate|test|predict --config cfg.yaml`` is a LightningCLI in subclass mode: configs name any
LightningModule / LightningDataModule by class path, and, because this module imports ``lightning_sdp``, the
string aliases (``strategy: sdp4bit``, ``accelerator: heat``) work in YAML. ``lightning-sdp demo`` runs the main job
on built-in data and prints where its results went. Tools of individual plugins are sub-commands too
(``lightning-sdp tools`` lists them).

Relative data paths written in a config file (``data.init_args.path``, ``val_path``, ``test_path``, ``train_data``,
``val_data``) are read relative to the config file's folder, so a config runs from any working folder; on the command
line they stay relative to the working folder. Without ``--trainer.default_root_dir`` runs write under ``runs/`` in
the working folder (logs, checkpoints, ``config.yaml``), never loose files into it.

Each run saves its full config as ``config.yaml`` in the Trainer's log folder. A run never overwrites the
``config.yaml`` of an earlier run: with a logger every run gets a fresh ``version_N`` folder; where the folder is
reused (``--trainer.logger=false``, a fixed logger ``version``), the run stops before training with a message that
says how to start in a fresh folder, and ``--overwrite_config=true`` replaces the file on purpose.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from typing_extensions import override

import lightning_sdp  # noqa: F401  (registers the string aliases)

DATA_PATH_KEYS = ("path", "val_path", "test_path", "train_data", "val_data")
"""``data.init_args`` keys that name files or folders: relative values in a config file are relative to it."""
DEFAULT_ROOT_DIR = "runs"
"""Where runs write (relative to the working folder) when the config and command line set no ``default_root_dir``."""

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


class KeepEarlierConfig(SaveConfigCallback):
    """Lightning's ``SaveConfigCallback`` that refuses to overwrite an earlier run's ``config.yaml``.

    The check runs at ``setup``, before the first batch, with a message naming the file and the ways out: a fresh
    folder (``--trainer.default_root_dir``, or a logger that gives each run its own ``version_N`` folder) or
    ``--overwrite_config=true``.
    """

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not self.already_saved and self.save_to_log_dir and not self.overwrite:
            log_dir = trainer.log_dir
            assert log_dir is not None
            config_path = os.path.join(log_dir, self.config_filename)
            exists = os.path.isfile(config_path) if trainer.is_global_zero else False
            if trainer.strategy.broadcast(exists):
                raise RuntimeError(
                    f"lightning-sdp: {config_path} holds the config of an earlier run in the same folder; not "
                    "overwriting it (its checkpoints and logs would no longer match). Start in a fresh folder with "
                    "`--trainer.default_root_dir=<new folder>`, or keep a logger so that each run gets its own "
                    "`version_N` folder (a fixed logger `version` or `--trainer.logger=false` reuse the folder); "
                    "or pass `--overwrite_config=true` to replace it."
                )
        super().setup(trainer, pl_module, stage)


class LightningSdpCLI(LightningCLI):
    """LightningCLI with ``--overwrite_config`` (default false): replace an earlier run's ``config.yaml``."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--overwrite_config",
            type=bool,
            default=False,
            help="Replace the config.yaml of an earlier run in the same log folder (default: refuse and stop).",
        )
        parser.set_defaults({"trainer.default_root_dir": DEFAULT_ROOT_DIR})

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        self.save_config_kwargs = {**self.save_config_kwargs, "overwrite": bool(config.get("overwrite_config"))}
        _resolve_config_relative_paths(config)
        # The saved config records `false`: rerunning it in the same folder asks again rather than overwriting.
        config["overwrite_config"] = False


def _resolve_config_relative_paths(config: Any) -> None:
    """Make the relative data paths that a ``--config`` file wrote relative to that file's folder.

    A value the command line changed afterwards (it differs from the file's) stays as given.
    """
    import yaml

    init_args = config.get("data") and config["data"].get("init_args")
    if not init_args:
        return
    for config_file in config.get("config") or []:
        folder = Path(os.fspath(config_file)).parent
        written = ((yaml.safe_load(Path(os.fspath(config_file)).read_text()) or {}).get("data") or {}).get("init_args")
        for key in DATA_PATH_KEYS:
            value = (written or {}).get(key)
            relative = isinstance(value, str) and value and "://" not in value and not os.path.isabs(value)
            if relative and init_args.get(key) == value:
                init_args[key] = os.path.normpath(folder / value)


def cli_main(args: Sequence[str] | None = None, run: bool = True) -> LightningCLI:
    """Build the LightningCLI (subclass mode for model and data). ``run=False`` only parses and instantiates."""
    return LightningSdpCLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=list(args) if args is not None else None,
        run=run,
        save_config_callback=KeepEarlierConfig,
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
