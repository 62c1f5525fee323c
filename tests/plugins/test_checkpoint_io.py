"""VerifiedCheckpointIO: checkpoints written whole, checked before loading, and every read error names the file.

The fault scripts of a reliability review, as tests: a truncated checkpoint, random bytes, one flipped bit and a full
disk, each through ``Trainer.fit(ckpt_path=...)`` and ``FastCLIPModule.load_from_checkpoint``.
"""

from __future__ import annotations

import errno
import os
import zipfile
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_sdp.plugins.checkpoint_io import CheckpointError, VerifiedCheckpointIO, verify_checkpoint
from tests._full_disk import small_disk

pytestmark = pytest.mark.open_clip

MICRO = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 16, "layers": 1, "width": 16, "head_width": 8, "mlp_ratio": 1.0, "patch_size": 8},
    "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 8, "heads": 1, "layers": 1, "mlp_ratio": 1.0},
}


def _trainer(root: Path, **kw) -> pl.Trainer:
    args = dict(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
    )
    args.update(kw)
    return pl.Trainer(**args)


def _fastclip():
    from lightning_sdp.datamodules import ImageTextDataModule
    from lightning_sdp.models import FastCLIPModule

    dm = ImageTextDataModule(model=MICRO, num_train=16, num_val=4, batch_size=8, augment=False)
    return FastCLIPModule(model=MICRO, loss="fastclip_v1", warmup_steps=1), dm


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A FastCLIP checkpoint written by a Trainer (with the plugin FastCLIPModule installs)."""
    root = tmp_path_factory.mktemp("ckpt")
    module, dm = _fastclip()
    trainer = _trainer(root)
    trainer.fit(module, dm)
    assert type(trainer.strategy.checkpoint_io) is VerifiedCheckpointIO  # installed in place of the default
    path = root / "good.ckpt"
    trainer.save_checkpoint(path)
    return path


def _damaged(saved: Path, folder: Path, kind: str) -> Path:
    data = bytearray(saved.read_bytes())
    path = folder / f"{kind}.ckpt"
    if kind == "truncated":
        data = data[: len(data) // 2]
    elif kind == "random":
        data = bytearray(os.urandom(4096))
    elif kind == "bitflip":  # one bit in the middle of the largest tensor record
        with zipfile.ZipFile(saved) as archive:
            record = max(archive.infolist(), key=lambda r: r.file_size)
        with open(saved, "rb") as fh:
            fh.seek(record.header_offset + 26)
            name_len, extra_len = (int.from_bytes(fh.read(2), "little") for _ in range(2))
        data[record.header_offset + 30 + name_len + extra_len + record.file_size // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return path


CASES = {
    "truncated": r"is truncated \(\d+ bytes\).*directory.*missing",
    "random": r"is not a PyTorch checkpoint",
    "bitflip": r"is damaged: record '.*' does not match its CRC-32",
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_damaged_checkpoints_are_refused_naming_the_file(saved, tmp_path, kind):
    from lightning_sdp.models import FastCLIPModule

    path = _damaged(saved, tmp_path, kind)
    message = rf"{path} {CASES[kind]}"
    with pytest.raises(CheckpointError, match=message):
        FastCLIPModule.load_from_checkpoint(path)
    module, dm = _fastclip()
    with pytest.raises(CheckpointError, match=message):
        _trainer(tmp_path, max_steps=2).fit(module, dm, ckpt_path=str(path))
    with pytest.raises(CheckpointError, match=message):  # any module, with the plugin given
        _trainer(tmp_path, max_steps=2, plugins=[VerifiedCheckpointIO()]).fit(BoringModel(), ckpt_path=str(path))


def test_a_bit_flip_loads_silently_without_the_check(saved, tmp_path):
    """What the check is for: torch itself loads the flipped file (a changed number) without a word."""
    path = _damaged(saved, tmp_path, "bitflip")
    good = torch.load(saved, weights_only=False)["state_dict"]
    flipped = torch.load(path, weights_only=False)["state_dict"]
    assert any(not torch.equal(good[k], flipped[k]) for k in good)


def test_a_good_checkpoint_loads_and_resumes(saved, tmp_path):
    from lightning_sdp.models import FastCLIPModule

    verify_checkpoint(saved)
    loaded = FastCLIPModule.load_from_checkpoint(saved)
    assert torch.equal(loaded.gcl_loss.u1, torch.load(saved, weights_only=False)["state_dict"]["loss_fn.u1"])
    module, dm = _fastclip()
    trainer = _trainer(tmp_path, max_steps=2)
    trainer.fit(module, dm, ckpt_path=str(saved))
    assert trainer.global_step == 2


def test_a_users_checkpoint_io_is_kept(tmp_path):
    class Mine(TorchCheckpointIO):
        pass

    module, dm = _fastclip()
    trainer = _trainer(tmp_path, plugins=[Mine()])
    trainer.fit(module, dm)
    assert type(trainer.strategy.checkpoint_io) is Mine


def test_full_disk_leaves_no_partial_checkpoint_and_names_the_file(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, plugins=[VerifiedCheckpointIO()])
    model = BoringModel()
    model.register_buffer("wide", torch.zeros(1 << 16))  # 256 KiB: more than the disk holds
    trainer.fit(model)
    with small_disk(tmp_path, 64) as disk:
        folder = disk if disk is not None else tmp_path / "emulated"
        folder.mkdir(exist_ok=True)
        if disk is None:  # not root here: torch.save reports the full disk

            def full(obj, f, *args, **kwargs):
                Path(f).write_bytes(b"PK\x03\x04partial")
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(torch, "save", full)
        path = folder / "last.ckpt"
        with pytest.raises((OSError, RuntimeError), match=rf"cannot write the checkpoint {path} .* MiB free"):
            trainer.save_checkpoint(path)
        assert [p for p in os.listdir(folder)] == []


def _package_modules():
    from lightning_sdp.datamodules import CharTextDataModule, InteractionsDataModule
    from lightning_sdp.models import GPT, PtychoNN, SimpleXModule

    frames = torch.randn(8, 1, 8, 8)
    ptycho_data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(frames, torch.randn(8, 2, 8, 8)), batch_size=4
    )
    return {
        "gpt": (
            lambda: GPT(n_layer=1, n_head=1, n_embd=8, block_size=8),
            lambda: CharTextDataModule(block_size=8, batch_size=2),
        ),
        "simplex": (
            lambda: SimpleXModule(backend="reference", dim=4, num_negatives=2),
            lambda: InteractionsDataModule(num_users=20, num_items=10, batch_size=16),
        ),
        "ptychonn": (lambda: PtychoNN(image_size=8, base_channels=2, depth=1), lambda: ptycho_data),
    }


@pytest.mark.parametrize("name", ["gpt", "simplex", "ptychonn"])
def test_every_package_module_writes_and_checks_verified_checkpoints(tmp_path, name):
    make_module, make_data = _package_modules()[name]
    trainer = _trainer(tmp_path)
    data = make_data()
    fit_args = {"datamodule": data} if isinstance(data, pl.LightningDataModule) else {"train_dataloaders": data}
    trainer.fit(make_module(), **fit_args)
    assert type(trainer.strategy.checkpoint_io) is VerifiedCheckpointIO
    good = tmp_path / "good.ckpt"
    trainer.save_checkpoint(good)
    verify_checkpoint(good)
    flipped = _damaged(good, tmp_path, "bitflip")
    cls = type(trainer.lightning_module)
    with pytest.raises(CheckpointError, match=rf"{flipped} {CASES['bitflip']}"):
        cls.load_from_checkpoint(flipped)
    with pytest.raises(CheckpointError, match=rf"{flipped} {CASES['bitflip']}"):
        _trainer(tmp_path, max_steps=2).fit(make_module(), **fit_args, ckpt_path=str(flipped))
