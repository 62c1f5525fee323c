"""The ``lightning-sdp`` console script and the shipped YAML configs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_sdp.cli import KeepEarlierConfig, cli_main, main

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "examples" / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert any(p.name == "gpt_char.yaml" for p in CONFIGS)


@pytest.mark.parametrize("config", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_parses(config, tmp_path):
    cli = cli_main(["--config", str(config), f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert cli.model is not None
    assert cli.trainer is not None


@pytest.mark.slow
def test_fit_from_yaml_runs_two_steps(tmp_path):
    config = next(p for p in CONFIGS if p.name == "gpt_char.yaml")
    main(
        [
            "fit",
            "--config",
            str(config),
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=1",
            "--trainer.val_check_interval=2",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--model.init_args.n_layer=1",
            "--model.init_args.n_embd=32",
            "--data.init_args.batch_size=2",
        ]
    )
    assert list(tmp_path.rglob("*.ckpt")), "fit should have written a checkpoint"


def test_config_data_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    """heat_gowalla.yaml names ../shared/data relative to itself: the same folder from any working folder; a path
    given on the command line stays relative to the working folder."""
    config = next(p for p in CONFIGS if p.name == "heat_gowalla.yaml")
    expected = str(config.parents[3] / "shared" / "data" / "gowalla")
    seen = []
    for cwd in (config.parents[2], tmp_path):
        monkeypatch.chdir(cwd)
        cli = cli_main(["--config", str(config), f"--trainer.default_root_dir={tmp_path}"], run=False)
        seen.append(cli.config["data"]["init_args"]["path"])
    assert seen == [expected, expected]
    given = cli_main(["--config", str(config), "--data.init_args.path=mine"], run=False)
    assert given.config["data"]["init_args"]["path"] == "mine"


@pytest.mark.slow
def test_a_cli_run_writes_under_runs_not_into_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = next(p for p in CONFIGS if p.name == "gpt_char.yaml")
    tiny = ["--trainer.max_steps=1", "--trainer.logger=false", "--trainer.limit_val_batches=0"]
    tiny += ["--trainer.enable_progress_bar=false", "--model.init_args.n_layer=1", "--model.init_args.n_embd=16"]
    main(["fit", "--config", str(config), *tiny, "--data.init_args.batch_size=2"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert (tmp_path / "runs" / "config.yaml").is_file()


def test_unknown_alias_in_config_says_what_to_do(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "trainer:\n  strategy: sdp4bitt\n  accelerator: cpu\n"
        "model:\n  class_path: lightning_sdp.models.GPT\n  init_args: {vocab_size: 10, n_layer: 1, n_embd: 16}\n"
        "data:\n  class_path: lightning_sdp.datamodules.CharTextDataModule\n"
    )
    with pytest.raises(ValueError, match=r"(?s)sdp4bitt.*lightning-sdp adds the aliases"):
        main(["fit", "--config", str(config)])


def test_tools_lists_demo(capsys):
    assert main(["tools"]) == 0
    assert "demo" in capsys.readouterr().out


@pytest.mark.slow
def test_demo_quick_writes_report(tmp_path, capsys):
    assert main(["demo", "--quick", "--only", "gpt", "--out", str(tmp_path)]) == 0
    index = tmp_path / "index.md"
    assert index.exists() and "val loss" in index.read_text()
    assert str(index.resolve()) in capsys.readouterr().out


@pytest.mark.slow
def test_console_script_fit_does_not_warn_about_lightningcli_args(tmp_path):
    import os
    import subprocess
    import sys

    config = next(p for p in CONFIGS if p.name == "gpt_char.yaml")
    argv = [
        "fit",
        "--config",
        str(config),
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        f"--trainer.default_root_dir={tmp_path}",
        "--model.init_args.n_layer=1",
        "--model.init_args.n_embd=16",
        "--data.init_args.batch_size=2",
    ]
    # `python -m lightning_sdp.cli` runs the same main() as the installed `lightning-sdp` script, with sys.argv
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    out = subprocess.run(
        [sys.executable, "-m", "lightning_sdp.cli", *argv], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "max_steps=1" in out.stdout + out.stderr  # it did train
    assert "args parameter is intended" not in out.stderr + out.stdout


def _tiny_fit(root: Path, *extra: str) -> list[str]:
    config = next(p for p in CONFIGS if p.name == "gpt_char.yaml")
    return [
        "fit",
        "--config",
        str(config),
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={root}",
        "--model.init_args.n_layer=1",
        "--model.init_args.n_embd=16",
        "--data.init_args.batch_size=2",
        *extra,
    ]


def _trainer_logging_to(log_dir: Path) -> SimpleNamespace:
    """What SaveConfigCallback.setup reads of a one-process Trainer."""
    return SimpleNamespace(log_dir=str(log_dir), is_global_zero=True, strategy=SimpleNamespace(broadcast=lambda x: x))


def test_keep_earlier_config_refuses_before_writing_and_saves_a_fresh_folder(tmp_path):
    from jsonargparse import Namespace
    from lightning.pytorch.cli import LightningArgumentParser

    parser = LightningArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "config.yaml").write_text("seed: 1\n")
    with pytest.raises(
        RuntimeError, match=r"(?s)earlier.config\.yaml.*--trainer\.default_root_dir=.*--overwrite_config=true"
    ):
        KeepEarlierConfig(parser, Namespace(seed=2)).setup(_trainer_logging_to(earlier), None, "fit")
    assert (earlier / "config.yaml").read_text() == "seed: 1\n"
    KeepEarlierConfig(parser, Namespace(seed=2), overwrite=True).setup(_trainer_logging_to(earlier), None, "fit")
    assert "seed: 2" in (earlier / "config.yaml").read_text()
    fresh = tmp_path / "fresh"
    KeepEarlierConfig(parser, Namespace(seed=3)).setup(_trainer_logging_to(fresh), None, "fit")
    assert "seed: 3" in (fresh / "config.yaml").read_text()


@pytest.mark.slow
def test_a_second_run_in_the_same_folder_keeps_the_first_config(tmp_path):
    config = tmp_path / "config.yaml"
    main(_tiny_fit(tmp_path, "--trainer.logger=false", "--seed_everything=1"))
    first = config.read_text()
    assert "seed_everything: 1" in first and "overwrite_config: false" in first
    with pytest.raises(
        RuntimeError,
        match=rf"(?s){config}.*earlier run.*--trainer.default_root_dir=.*version_N.*--overwrite_config=true",
    ):
        main(_tiny_fit(tmp_path, "--trainer.logger=false", "--seed_everything=2"))
    assert config.read_text() == first, "the refused run left the earlier config alone"
    # Asked for explicitly, the file is replaced; the saved config does not carry the request on.
    main(_tiny_fit(tmp_path, "--trainer.logger=false", "--seed_everything=2", "--overwrite_config=true"))
    second = config.read_text()
    assert "seed_everything: 2" in second and "overwrite_config: false" in second


@pytest.mark.slow
def test_runs_with_a_logger_each_keep_their_own_config(tmp_path):
    main(
        _tiny_fit(
            tmp_path, "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path}"
        )
    )
    main(
        _tiny_fit(
            tmp_path, "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path}"
        )
    )
    assert sorted(p.parent.name for p in tmp_path.rglob("config.yaml")) == ["version_0", "version_1"]
