"""The ``lightning-sdp`` console script and the shipped YAML configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_sdp.cli import cli_main, main

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "examples" / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert any(p.name == "gpt_char.yaml" for p in CONFIGS)


@pytest.mark.parametrize("config", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_parses(config, tmp_path):
    cli = cli_main(["--config", str(config), f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert cli.model is not None
    assert cli.trainer is not None


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


def test_demo_quick_writes_report(tmp_path, capsys):
    assert main(["demo", "--quick", "--only", "gpt", "--out", str(tmp_path)]) == 0
    index = tmp_path / "index.md"
    assert index.exists() and "val loss" in index.read_text()
    assert str(index.resolve()) in capsys.readouterr().out


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
