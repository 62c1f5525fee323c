"""``VerifiedCheckpointIO``: checkpoints written whole, checked before they are loaded, errors that name the file.

Lightning writes a checkpoint with ``torch.save`` straight to its final name (a crash or a full disk leaves a
truncated file there) and reads it back with ``torch.load``, whose errors on a damaged file do not name it
(``EOFError('')``, ``OSError: [Errno 22]``, advice to pass ``weights_only=False`` for random bytes) and which loads a
file with a flipped bit without noticing. This ``CheckpointIO`` plugin:

- writes through :func:`lightning_sdp._files.atomic_path` (a private temporary folder, then an atomic rename): the
  checkpoint file is whole or absent, and a full disk gives an ``OSError`` naming it;
- makes sure torch records a CRC-32 for every record of the checkpoint's zip archive (torch's
  ``compute_crc32`` setting, on by default), and before loading checks the archive's structure and every record
  against its CRC (:func:`verify_checkpoint`), so a truncated file, random bytes or a changed byte are refused with
  an error naming the file (and the damaged record);
- adds the file to the errors ``torch.load`` raises.

It works for any LightningModule: ``Trainer(plugins=[VerifiedCheckpointIO()])``. The package's own modules
(``GPT``, ``PtychoNN``, ``SimpleXModule``, ``FastCLIPModule``) install it themselves at ``setup`` when the Trainer
uses Lightning's default ``TorchCheckpointIO``, and check a file in ``load_from_checkpoint``
(:class:`lightning_sdp.models._checkpoints.VerifiedCheckpoints`). Remote (``fsspec``) paths are handed to
``TorchCheckpointIO`` unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import pickle
import shutil
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.cloud_io import _load as pl_load
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_sdp._files import atomic_path

__all__ = ["CheckpointError", "VerifiedCheckpointIO", "read_checkpoint", "verify_checkpoint"]

_PICKLE_START = b"\x80"  # torch's legacy (pre-zip) format is a pickle stream: protocol 2+ starts with PROTO


class CheckpointError(ValueError):
    """A checkpoint file is truncated, damaged or not a checkpoint (the message names the file and says what)."""


class VerifiedCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with atomic writes, verified reads and errors that name the file."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options; got {storage_options!r}.")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with _crc32_on(), atomic_path(target) as tmp:
            try:
                torch.save(checkpoint, tmp)
            except (RuntimeError, OSError) as err:  # torch's writer says "unexpected pos ..." on a full disk
                free = shutil.disk_usage(target.parent).free
                raise OSError(
                    getattr(err, "errno", None) or errno.EIO,
                    f"cannot write the checkpoint {target} ({type(err).__name__}: {err}; {free / 2**20:.1f} MiB "
                    "free there). Nothing was written under that name; free some space or save elsewhere",
                    str(target),
                ) from err

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not _is_local_file_protocol(path):
            return super().load_checkpoint(path, map_location, weights_only)
        return read_checkpoint(path, map_location, weights_only)


def read_checkpoint(path: _PATH, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
    """``torch.load`` of a local checkpoint after :func:`verify_checkpoint`, with the file in every error.

    Args:
        path: the checkpoint file.
        map_location: as for ``torch.load``.
        weights_only: as for ``torch.load`` (Lightning's default ``None``: torch's default).

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: the file is truncated, damaged or not a checkpoint, or torch cannot unpickle it.
    """
    path = Path(path)
    verify_checkpoint(path)
    with naming_load_errors(path):
        return pl_load(path, map_location=map_location, weights_only=weights_only)


def verify_checkpoint(path: _PATH) -> None:
    """Check a checkpoint file before loading it: a complete zip archive (``torch.save``'s format) whose records all
    match their CRC-32, or torch's legacy pickle format (not checkable, passed through).

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: naming the file: truncated (no zip directory at its end), not a checkpoint (neither a zip
            archive nor a pickle), or a record whose bytes do not match its CRC-32 (a changed byte).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(4)
    if not zipfile.is_zipfile(path):
        if head[:1] == _PICKLE_START:
            return  # torch's legacy format: no checksum to check
        if head[:4] == b"PK\x03\x04":
            raise CheckpointError(
                f"{path} is truncated ({size} bytes): it starts as a zip archive (torch.save's format) but its "
                "directory, at the end of the file, is missing. It was not written completely; use an earlier "
                "checkpoint or the run's last complete one."
            )
        raise CheckpointError(
            f"{path} is not a PyTorch checkpoint: it is neither a zip archive (torch.save's format) nor a pickle "
            f"(it starts with {head!r}, {size} bytes). Check the path."
        )
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
            if records and all(r.CRC == 0 for r in records if r.file_size):
                return  # saved with torch's compute_crc32 off: nothing to check against
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        raise CheckpointError(
            f"{path} is damaged: its zip archive cannot be read ({type(err).__name__}: {err}). Restore the file from "
            "a copy or use another checkpoint."
        ) from err
    if bad is not None:
        raise CheckpointError(
            f"{path} is damaged: record {bad!r} does not match its CRC-32 checksum (a changed byte, e.g. a bit flip "
            "on disk or in transfer). Restore the file from a copy or use another checkpoint."
        )


@contextlib.contextmanager
def naming_load_errors(path: Path) -> Iterator[None]:
    """``torch.load``'s errors on a file that passed :func:`verify_checkpoint` (an object ``weights_only`` refuses, a
    pickle that does not unpickle), raised again as :class:`CheckpointError` naming the file."""
    try:
        yield
    except (EOFError, pickle.UnpicklingError, RuntimeError, OSError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"{path}: torch cannot load this checkpoint ({type(err).__name__}: {err})") from err


@contextlib.contextmanager
def _crc32_on() -> Iterator[None]:
    """Make ``torch.save`` record a CRC-32 per record (torch's ``compute_crc32``, on by default) for the block."""
    config = _serialization_config()
    if config is None or config.compute_crc32:
        yield
        return
    config.compute_crc32 = True
    try:
        yield
    finally:
        config.compute_crc32 = False


def _serialization_config() -> Any:
    """``torch.utils.serialization.config.save`` where this torch has it, else ``None``."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return None
    return getattr(config, "save", None)


def use_verified_checkpoints(trainer: Any, factory: Callable[[], VerifiedCheckpointIO] = VerifiedCheckpointIO) -> None:
    """Give ``trainer``'s strategy a :class:`VerifiedCheckpointIO` when it uses Lightning's default
    ``TorchCheckpointIO`` (a ``CheckpointIO`` the user chose is kept)."""
    strategy = trainer.strategy
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = factory()
