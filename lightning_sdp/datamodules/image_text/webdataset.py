"""Local WebDataset tar shards (OpenCLIP's ``--wds`` convention) read by random access, and held-out subsets."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from torch import Tensor
from torch.utils.data import Dataset

_log = logging.getLogger(__name__)

WDS_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
"""Image members of a WebDataset sample (OpenCLIP's ``--wds`` convention: ``<key>.jpg`` + ``<key>.txt``)."""
WDS_CAPTION_EXTS = ("txt",)


def is_webdataset_path(path: str | Path | None) -> bool:
    """Whether ``path`` names WebDataset shards: a ``.tar`` file, a brace pattern or ``::``-joined patterns."""
    if path is None:
        return False
    text = str(path)
    return text.endswith(".tar") or ("{" in text and "}" in text) or "::" in text


def expand_shards(pattern: str | Path) -> list[Path]:
    """Expand OpenCLIP's shard notation into local file paths, in order.

    ``a-{000..009}.tar`` (numeric range, zero padding kept), ``{a,b}.tar`` (alternatives), several patterns joined
    by ``::``. Remote URLs (``s3://``, ``pipe:``, ``http``) are not read by this loader.

    Raises:
        ValueError: a remote URL, or a pattern with unbalanced braces.
        FileNotFoundError: a shard that does not exist (the first one is named).
    """
    out: list[Path] = []
    for part in str(pattern).split("::"):
        if "://" in part or part.startswith("pipe:"):
            raise ValueError(
                f"{part!r} is a remote URL; this loader reads local shards only. Download the shards (or mount them) "
                "and pass a local pattern such as /data/shards/{00000..00099}.tar."
            )
        out += [Path(x) for x in _brace_expand(part)]
    missing = [str(p) for p in out if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} of {len(out)} shard(s) not found, first: {missing[0]}.")
    return out


def _brace_expand(text: str) -> list[str]:
    start = text.find("{")
    if start < 0:
        if "}" in text:
            raise ValueError(f"Unbalanced braces in shard pattern {text!r}.")
        return [text]
    end = text.find("}", start)
    if end < 0:
        raise ValueError(f"Unbalanced braces in shard pattern {text!r}.")
    body, head, tail = text[start + 1 : end], text[:start], text[end + 1 :]
    if ".." in body:
        lo, hi = body.split("..", 1)
        width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
        options = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        options = body.split(",")
    return [head + o + rest for o in options for rest in _brace_expand(tail)]


class WebDatasetImageText(Dataset):
    """Image-caption pairs from local WebDataset tar shards, read by random access (OpenCLIP's shard convention).

    Every sample is the members ``<key>.<image ext>`` and ``<key>.txt`` of a shard (``key`` = the member path up to
    the first dot of its file name). At construction the shards' headers are scanned once (no image is decoded), so
    each sample gets a fixed **index**: its position in shard order, then member order. That index addresses
    FastCLIP's per-sample estimators, so ``data_size = len(dataset)``; samples are read by seeking to the member's
    offset in the uncompressed tar, so any sampler (shuffling, ``DistributedSampler``) works. Compressed shards
    (``.tar.gz``) cannot be read by offset and are refused.

    Args:
        shards: the shard paths (see :func:`expand_shards`).
        transform: image transform (PIL image -> tensor).
        tokenizer: ``tokenizer(list_of_str) -> LongTensor (n, context_length)``; captions are tokenised when read.
        on_error: ``raise`` (a sample without an image or a caption, or an empty caption, stops construction naming
            shard and key) or ``skip`` (dropped, counted in ``skipped`` and warned about). Default ``raise``.
    """

    def __init__(
        self,
        shards: Sequence[str | Path],
        transform: Callable[[Any], Tensor],
        tokenizer: Callable[[list[str]], Tensor],
        on_error: Literal["raise", "skip"] = "raise",
    ) -> None:
        import tarfile

        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}.")
        self.shards = [Path(p) for p in shards]
        if not self.shards:
            raise ValueError("No WebDataset shards given.")
        self.transform, self.tokenizer = transform, tokenizer
        self.skipped: list[str] = []
        # one row per sample: shard index, image offset, image size, caption offset, caption size
        rows: list[tuple[int, int, int, int, int]] = []
        self.keys: list[str] = []
        for si, shard in enumerate(self.shards):
            try:
                tar = tarfile.open(shard, mode="r:")
            except tarfile.TarError as err:
                raise OSError(
                    f"Cannot read {shard} as an uncompressed tar shard ({err}). Shards must be plain .tar files."
                ) from err
            members: dict[str, dict[str, tarfile.TarInfo]] = {}
            order: list[str] = []
            with tar:
                for m in tar:
                    if not m.isfile():
                        continue
                    folder, _, name = m.name.rpartition("/")
                    stem, dot, ext = name.partition(".")
                    if not dot:
                        continue
                    key = f"{folder}/{stem}" if folder else stem
                    if key not in members:
                        members[key] = {}
                        order.append(key)
                    members[key][ext.lower()] = m
            for key in order:
                found = members[key]
                img = next((found[e] for e in WDS_IMAGE_EXTS if e in found), None)
                cap = next((found[e] for e in WDS_CAPTION_EXTS if e in found), None)
                problem = None
                if img is None or cap is None:
                    problem = f"no {'image' if img is None else 'caption (.txt)'} member"
                elif cap.size == 0:
                    problem = "an empty caption"
                if problem is not None:
                    where = f"{shard} sample {key!r}: {problem}"
                    if on_error == "raise":
                        raise ValueError(
                            f"{where}. Every sample needs <key>.jpg/.png/.webp and a non-empty <key>.txt; fix the "
                            "shard or pass on_error='skip' to drop and count such samples."
                        )
                    self.skipped.append(where)
                    continue
                assert img is not None and cap is not None  # else `problem` was set above
                rows.append((si, img.offset_data, img.size, cap.offset_data, cap.size))
                self.keys.append(key)
        if self.skipped:
            msg = f"Skipped {len(self.skipped)} incomplete WebDataset sample(s), first: {self.skipped[0]}."
            warnings.warn(msg, stacklevel=2)
            _log.warning(msg)
        self._rows = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
        self.labels = None
        self.classnames = None
        self.templates = None
        self.caption_groups = None

    def __len__(self) -> int:
        return len(self._rows)

    def _read(self, shard: int, offset: int, size: int) -> bytes:
        with open(self.shards[shard], "rb") as f:
            f.seek(offset)
            return f.read(size)

    def caption(self, index: int) -> str:
        """The caption of sample ``index`` (UTF-8 text of its ``.txt`` member)."""
        si, _, _, co, cs = (int(x) for x in self._rows[index])
        text = self._read(si, co, cs).decode("utf-8").strip()
        if not text:
            raise ValueError(f"{self.shards[si]} sample {self.keys[index]!r}: empty caption.")
        return text

    def load_image(self, index: int) -> Any:
        import io

        from PIL import Image

        si, io_off, io_size, _, _ = (int(x) for x in self._rows[index])
        try:
            with Image.open(io.BytesIO(self._read(si, io_off, io_size))) as img:
                return img.convert("RGB")
        except (OSError, ValueError) as err:
            raise OSError(f"Cannot decode the image of {self.shards[si]} sample {self.keys[index]!r}: {err}") from err

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, int]:
        tokens = self.tokenizer([self.caption(index)])[0]
        return self.transform(self.load_image(index)), tokens, index


class WebDatasetSubset(Dataset):
    """A subset of a WebDataset set, with its own transform, whose indices are renumbered ``0 .. len - 1`` (the
    estimators address samples by that index)."""

    def __init__(self, base: WebDatasetImageText, keep: np.ndarray, transform: Callable[[Any], Tensor]) -> None:
        self.base, self.keep, self.transform = base, np.asarray(keep, dtype=np.int64), transform
        self.labels = self.classnames = self.templates = self.caption_groups = None
        self.skipped = base.skipped

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, int]:
        j = int(self.keep[index])
        tokens = self.base.tokenizer([self.base.caption(j)])[0]
        return self.transform(self.base.load_image(j)), tokens, index


__all__ = [
    "WDS_CAPTION_EXTS",
    "WDS_IMAGE_EXTS",
    "WebDatasetImageText",
    "WebDatasetSubset",
    "expand_shards",
    "is_webdataset_path",
]
