"""The open_clip adapter's bundled configs: registered from a privately written file, never through a planted
symlink; ``tiny`` and ``nano`` aliases."""

from __future__ import annotations

import json
import os
import stat

import pytest

from lightning_sdp.integrations import open_clip as adapter
from lightning_sdp.integrations.open_clip import TINY_CONFIG, TINY_NAME, register_config

pytestmark = pytest.mark.open_clip


@pytest.fixture
def fresh_registry(tmp_path, monkeypatch):
    """open_clip without the tiny config and a temporary directory of our own; both restored afterwards."""
    import open_clip.factory as factory

    monkeypatch.setattr(factory, "_MODEL_CONFIG_PATHS", list(factory._MODEL_CONFIG_PATHS))
    monkeypatch.setattr(factory, "_MODEL_CONFIGS", dict(factory._MODEL_CONFIGS))
    for name in (TINY_NAME, adapter.NANO_NAME):
        factory._MODEL_CONFIGS.pop(name, None)
    monkeypatch.setattr(adapter.tempfile, "tempdir", str(tmp_path))
    return tmp_path / f"lightning_sdp_open_clip_{os.getuid()}"


def test_planted_symlinks_are_not_followed(fresh_registry, tmp_path):
    folder = fresh_registry
    folder.mkdir(mode=0o700)
    victim, other = tmp_path / "victim.txt", tmp_path / "other.txt"
    victim.write_text("precious")
    other.write_text("also precious")
    # the old predictable temporary name, and the config's own name, both pointing at the user's files
    (folder / f"{TINY_NAME}.{os.getpid()}.tmp").symlink_to(victim)
    (folder / f"{TINY_NAME}.json").symlink_to(other)
    assert register_config("tiny") == TINY_NAME
    assert victim.read_text() == "precious" and other.read_text() == "also precious"
    config = folder / f"{TINY_NAME}.json"
    assert not config.is_symlink() and json.loads(config.read_text()) == TINY_CONFIG
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    import open_clip

    assert open_clip.get_model_config(TINY_NAME) == TINY_CONFIG


def test_new_folder_is_private(fresh_registry):
    register_config("tiny")
    assert stat.S_IMODE(os.lstat(fresh_registry).st_mode) == 0o700
    assert [p.name for p in fresh_registry.iterdir()] == [f"{TINY_NAME}.json"]  # no temporary file left


def test_unsafe_folders_are_refused(fresh_registry, tmp_path, monkeypatch):
    folder = fresh_registry
    folder.mkdir(mode=0o700)
    os.chmod(folder, 0o777)
    with pytest.raises(PermissionError, match=r"(?s)mode 777.*refusing.*TMPDIR"):
        register_config("tiny")
    assert list(folder.iterdir()) == []
    # a folder of ours that others may only read (as earlier versions made it) is tightened and used
    os.chmod(folder, 0o755)
    assert register_config("tiny") == TINY_NAME
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    # a symlink in place of the folder
    import open_clip.factory as factory

    factory._MODEL_CONFIGS.pop(TINY_NAME)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    monkeypatch.setattr(os, "getuid", lambda: 4242)
    (tmp_path / "lightning_sdp_open_clip_4242").symlink_to(elsewhere)
    with pytest.raises(PermissionError, match="not a plain directory"):
        register_config("tiny")
    assert list(elsewhere.iterdir()) == []


def test_a_folder_of_another_user_is_refused(fresh_registry, tmp_path, monkeypatch):
    real = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real + 4242)  # we are now someone else; the folder is not ours
    folder = tmp_path / f"lightning_sdp_open_clip_{real + 4242}"
    folder.mkdir(mode=0o700)
    with pytest.raises(PermissionError, match=rf"belongs to user id {real}, not to you"):
        register_config("tiny")
    assert list(folder.iterdir()) == []


def test_nano_alias_registers_the_benchmark_config_and_builds_the_same_model(fresh_registry):
    import open_clip

    from lightning_sdp.integrations.open_clip import CLIP_CONFIGS, NANO_CONFIG, NANO_NAME, build_clip, tokenizer_for

    assert CLIP_CONFIGS == {"tiny": TINY_CONFIG, "nano": NANO_CONFIG}
    assert adapter.resolve_model_name("nano") == NANO_NAME == adapter.registered_name("nano")
    assert open_clip.get_model_config(NANO_NAME) == NANO_CONFIG
    by_alias = sum(p.numel() for p in build_clip("nano").parameters())
    assert by_alias == sum(p.numel() for p in build_clip(NANO_CONFIG).parameters()) < 1_000_000
    assert tokenizer_for("nano")(["a red circle"]).shape == (1, NANO_CONFIG["text_cfg"]["context_length"])
    with pytest.raises(ValueError, match="'tiny', 'nano'"):
        adapter.register_config("huge")
