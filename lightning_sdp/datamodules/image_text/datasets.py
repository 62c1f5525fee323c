"""In-memory and file-backed image-caption datasets; every sample is ``(image, tokens, index)``.

``index`` is the sample's position in its dataset: FastCLIP's per-sample estimators are addressed by it, so
``data_size = len(train_set)``.
"""

from __future__ import annotations

import logging
import struct
import warnings
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

_log = logging.getLogger(__name__)


class ImageTextDataset(Dataset):
    """Base class: images (in memory or files), captions tokenised once, optional class labels.

    Args:
        captions: one caption per sample.
        transform: image transform (PIL image -> tensor), e.g. open_clip's preprocess.
        tokenizer: ``tokenizer(list_of_str) -> LongTensor (n, context_length)``.
        labels: optional class label per sample (for zero-shot evaluation).
        classnames: class names that ``labels`` index.
        templates: prompt templates with one ``{}`` for zero-shot classification.
    """

    def __init__(
        self,
        captions: Sequence[str],
        transform: Callable[[Any], Tensor],
        tokenizer: Callable[[list[str]], Tensor],
        labels: Sequence[int] | None = None,
        classnames: Sequence[str] | None = None,
        templates: Sequence[str] | None = None,
    ) -> None:
        self.captions = list(captions)
        bad = [i for i, c in enumerate(self.captions) if not has_text(c)]
        if bad:
            raise ValueError(
                f"{len(bad)} caption(s) are empty or not text, first at index {bad[0]}: {self.captions[bad[0]]!r}. "
                "Every pair needs a caption."
            )
        self.transform = transform
        self.tokens = tokenizer(self.captions) if self.captions else torch.zeros(0, 1, dtype=torch.long)
        self.labels = torch.as_tensor(labels, dtype=torch.long) if labels is not None else None
        self.classnames = list(classnames) if classnames is not None else None
        self.templates = list(templates) if templates is not None else None
        _, groups = np.unique(np.asarray(self.captions, dtype=object).astype(str), return_inverse=True)
        self.caption_groups = torch.as_tensor(groups.reshape(-1), dtype=torch.long)
        """Samples with identical captions share a group id (a retrieval hit is any sample of the right group)."""

    def __len__(self) -> int:
        return len(self.captions)

    def load_image(self, index: int) -> Any:
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, int]:
        return self.transform(self.load_image(index)), self.tokens[index], index


class ArrayImageText(ImageTextDataset):
    """Images held as a ``(n, h, w, 3)`` uint8 array."""

    def __init__(self, images: np.ndarray, captions: Sequence[str], **kwargs: Any) -> None:
        if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
            raise ValueError(f"images must be a (n, h, w, 3) uint8 array, got {images.shape} {images.dtype}.")
        if len(images) != len(captions):
            raise ValueError(f"{len(images)} images but {len(captions)} captions.")
        super().__init__(captions, **kwargs)
        self.images = images

    def load_image(self, index: int) -> Any:
        from PIL import Image

        return Image.fromarray(self.images[index])


class FileImageText(ImageTextDataset):
    """Images read from files (OpenCLIP's CSV convention or a folder with a captions file).

    Args:
        paths: image file paths.
        captions: one caption per image.
        on_error: ``raise`` (a missing or unreadable image raises an error naming the file) or ``skip`` (every image
            is opened once at construction; bad ones are dropped, counted in ``skipped`` and warned about).
        **kwargs: see :class:`ImageTextDataset`.
    """

    def __init__(
        self,
        paths: Sequence[str | Path],
        captions: Sequence[str],
        on_error: Literal["raise", "skip"] = "raise",
        **kwargs: Any,
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}.")
        files = [Path(p) for p in paths]
        captions = list(captions)
        self.skipped: list[str] = []
        if on_error == "raise":
            missing = [str(p) for p in files if not p.is_file()]
            if missing:
                raise FileNotFoundError(
                    f"{len(missing)} image file(s) not found, first: {missing[0]}. Fix the paths, or pass "
                    "on_error='skip' to drop and count them."
                )
            empty = [str(p) for p, c in zip(files, captions, strict=True) if not has_text(c)]
            if empty:
                raise ValueError(
                    f"{len(empty)} pair(s) have an empty caption, first: the caption of {empty[0]}. Fill the captions "
                    "in, or pass on_error='skip' to drop and count these pairs."
                )
            # a cheap header check of every file (no decoding), so a corrupt image stops setup, not training
            unreadable = [str(p) for p in files if not _readable_header(p)]
            if unreadable:
                raise OSError(
                    f"{len(unreadable)} image file(s) cannot be read as images, first: {unreadable[0]}. Replace or "
                    "remove them, or pass on_error='skip' to drop and count them."
                )
        else:
            keep = []
            for i, p in enumerate(files):
                if not has_text(captions[i]):
                    self.skipped.append(f"{p} (empty caption)")
                elif _readable_image(p):
                    keep.append(i)
                else:
                    self.skipped.append(str(p))
            if self.skipped:
                msg = (
                    f"Skipped {len(self.skipped)} missing or unreadable image(s) or empty caption(s), first: "
                    f"{self.skipped[0]}."
                )
                warnings.warn(msg, stacklevel=2)
                _log.warning(msg)
            files = [files[i] for i in keep]
            captions = [captions[i] for i in keep]
        super().__init__(captions, **kwargs)
        self.paths = files

    def load_image(self, index: int) -> Any:
        from PIL import Image

        path = self.paths[index]
        try:
            with Image.open(path) as img:
                return img.convert("RGB")
        except image_errors() as err:
            raise OSError(f"Cannot read image {path}: {err}") from err


_IMAGE_ERRORS: tuple[type[BaseException], ...] = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error)
"""What PIL raises on a file it cannot decode (``UnidentifiedImageError``, "image file is truncated" and "broken data
stream" (a failed zlib check) are ``OSError``; ``verify()`` raises ``SyntaxError`` on a broken PNG chunk); see
:func:`image_errors` for the full tuple, with PIL's decompression-bomb error."""


def image_errors() -> tuple[type[BaseException], ...]:
    """Every error decoding an image may raise: :data:`_IMAGE_ERRORS` and ``PIL.Image.DecompressionBombError`` (an
    image with more than twice ``Image.MAX_IMAGE_PIXELS`` pixels)."""
    from PIL import Image

    return _IMAGE_ERRORS + (Image.DecompressionBombError,)


def has_text(caption: Any) -> bool:
    """Whether ``caption`` is a string with at least one non-blank character."""
    return isinstance(caption, str) and bool(caption.strip())


def _readable_header(path: Path) -> bool:
    """Whether PIL recognises the file's format and reads its size from the header (no pixel decoding)."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.size  # noqa: B018 - parsed from the header
        return True
    except image_errors():
        return False


def _readable_image(path: Path) -> bool:
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.verify()
        return True
    except image_errors():
        return False


__all__ = ["ArrayImageText", "FileImageText", "ImageTextDataset", "has_text", "image_errors"]
