"""Verified checkpoints for the package's LightningModules (one mixin, so every module behaves the same)."""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

from lightning_sdp.plugins.checkpoint_io import naming_load_errors, use_verified_checkpoints, verify_checkpoint


class VerifiedCheckpoints:
    """Mixin placed before ``LightningModule``: the module's checkpoints are written whole and checked before loading.

    At ``setup`` the Trainer's strategy gets a :class:`~lightning_sdp.plugins.checkpoint_io.VerifiedCheckpointIO`
    (unless the user chose a ``CheckpointIO``): a checkpoint written by ``Trainer.save_checkpoint`` or
    ``ModelCheckpoint`` is renamed into place whole, and ``fit(ckpt_path=...)`` checks it first. ``setup`` runs
    before Lightning restores ``ckpt_path``, so the check covers resumes. ``load_from_checkpoint`` checks a local file
    the same way; a truncated, damaged or bit-flipped file is refused with an error naming it.
    """

    _trainer: Any

    def setup(self, stage: str) -> None:
        if self._trainer is not None:
            use_verified_checkpoints(self._trainer)
        super().setup(stage)  # type: ignore[misc]

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | Path | IO, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``load_from_checkpoint``, after checking a local file (see
        :func:`~lightning_sdp.plugins.checkpoint_io.verify_checkpoint`)."""
        if not isinstance(checkpoint_path, (str, Path)) or "://" in str(checkpoint_path):
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
        verify_checkpoint(checkpoint_path)
        with naming_load_errors(Path(checkpoint_path)):
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
