"""Local WebDataset tar shards (OpenCLIP's ``--wds`` convention) read by random access, and held-out subsets."""

from __future__ import annotations

import io
import logging
import tarfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from tarfile import TarInfo
from typing import Any, Literal

import numpy as np
from torch import Tensor
from torch.utils.data import Dataset

from lightning_sdp.datamodules.image_text.datasets import image_errors

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


MAX_SHARDS = 100_000
"""The most shards one pattern may name: the loader scans every shard's header when it starts, so a pattern such as
``{0..3000000}`` (a typo, or a streaming-scale corpus) is refused at once instead of being expanded and checked."""


def expand_shards(pattern: str | Path) -> list[Path]:
    """Expand OpenCLIP's shard notation into local file paths, in order.

    ``a-{000..009}.tar`` (numeric range, zero padding kept), ``{a,b}.tar`` (alternatives), several patterns joined
    by ``::``. Remote URLs (``s3://``, ``pipe:``, ``http``) are not read by this loader.

    Raises:
        ValueError: a remote URL, a pattern with unbalanced braces or a bad range, or one that names more than
            :data:`MAX_SHARDS` shards (counted before anything is expanded).
        FileNotFoundError: a shard that does not exist (the first one is named).
    """
    parts = str(pattern).split("::")
    for part in parts:
        if "://" in part or part.startswith("pipe:"):
            raise ValueError(
                f"{part!r} is a remote URL; this loader reads local shards only. Download the shards (or mount them) "
                "and pass a local pattern such as /data/shards/{00000..00099}.tar."
            )
    total = sum(_brace_count(part) for part in parts)
    if total > MAX_SHARDS:
        raise ValueError(
            f"The shard pattern {str(pattern)!r} names {total:,} shards, more than this loader takes "
            f"({MAX_SHARDS:,}: it scans every shard when it starts). Check the brace range; for a corpus of that "
            "size use a streaming loader (webdataset, open_clip's --wds)."
        )
    out = [Path(x) for part in parts for x in _brace_expand(part)]
    missing = [str(p) for p in out if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} of {len(out)} shard(s) not found, first: {missing[0]}.")
    return out


def _first_brace(text: str) -> tuple[str, list[str] | range, str] | None:
    """``(head, options, tail)`` of the first ``{...}`` of ``text`` (a range stays a ``range``), or ``None``."""
    start = text.find("{")
    if start < 0:
        if "}" in text:
            raise ValueError(f"Unbalanced braces in shard pattern {text!r}.")
        return None
    end = text.find("}", start)
    if end < 0:
        raise ValueError(f"Unbalanced braces in shard pattern {text!r}.")
    body = text[start + 1 : end]
    if ".." not in body:
        return text[:start], body.split(","), text[end + 1 :]
    lo, hi = body.split("..", 1)
    if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
        raise ValueError(f"Bad range {{{body}}} in shard pattern {text!r}: write {{first..last}}, e.g. {{000..099}}.")
    return text[:start], range(int(lo), int(hi) + 1), text[end + 1 :]


def _brace_count(text: str) -> int:
    """How many names ``text`` expands to, without expanding it."""
    found = _first_brace(text)
    return 1 if found is None else len(found[1]) * _brace_count(found[2])


def _brace_expand(text: str) -> list[str]:
    found = _first_brace(text)
    if found is None:
        return [text]
    head, options, tail = found
    if isinstance(options, range):
        lo = text[len(head) + 1 :].split("..", 1)[0]
        width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
        options = [str(i).zfill(width) for i in options]
    return [head + o + rest for o in options for rest in _brace_expand(tail)]


def _decode_image(data: bytes) -> Any:
    """The RGB image of ``data`` (fully decoded)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def _image_problem(data: bytes) -> str | None:
    """Why ``data`` is not a decodable image (``Image.verify()``, then a decode at reduced size), or ``None``."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()  # structure and checksums, without decoding
        with Image.open(io.BytesIO(data)) as img:
            img.draft("RGB", (1, 1))  # JPEG: decode at 1/8 scale, still reading every byte
            img.load()
    except image_errors() as err:
        return f"an image that cannot be decoded ({type(err).__name__}: {err})"
    return None


def _caption_problem(data: bytes) -> str | None:
    """Why ``data`` is not a caption (not UTF-8, or empty), or ``None``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"a caption that is not UTF-8 text ({err})"
    return None if text.strip() else "an empty caption"


def _scan_shard(shard: Path) -> tuple[list[str], dict[str, dict[str, TarInfo]], str | None]:
    """The sample keys of a shard in member order, their members by extension, and what is wrong with the tar
    itself (truncated, or unreadable from some point on), or ``None``."""
    try:
        tar = tarfile.open(shard, mode="r:")
    except tarfile.TarError as err:
        raise OSError(
            f"Cannot read {shard} as an uncompressed tar shard ({err}). Shards must be plain .tar files."
        ) from err
    members: dict[str, dict[str, TarInfo]] = {}
    order: list[str] = []
    damage = None
    with tar:
        try:
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
        except tarfile.TarError as err:  # e.g. "unexpected end of data": the last member runs past the end
            damage = f"the tar is truncated or corrupt ({err})"
        end = tar.offset
    size = shard.stat().st_size
    if damage is None and not _only_padding(shard, end, size):
        # tarfile stops quietly at a bad header: say what is wrong with it (e.g. its checksum)
        damage = f"the tar has unreadable data from byte {end} on{_header_problem(shard, end)}"
    return order, members, damage


def _header_problem(shard: Path, offset: int) -> str:
    """Why the 512-byte block at ``offset`` of ``shard`` is not a tar header (`` (bad checksum)``...), or ``""``."""
    with open(shard, "rb") as f:
        f.seek(offset)
        block = f.read(tarfile.BLOCKSIZE)
    try:
        tarfile.TarInfo.frombuf(block, tarfile.ENCODING, "surrogateescape")
    except tarfile.HeaderError as err:
        return f" (a damaged member header: {err})"
    return ""


def _only_padding(shard: Path, start: int, size: int) -> bool:
    """Whether bytes ``start:size`` of ``shard`` are all zero (a tar's end-of-archive blocks and record padding)."""
    with open(shard, "rb") as f:
        f.seek(start)
        while chunk := f.read(1 << 20):
            if chunk.count(0) != len(chunk):
                return False
    return True


class WebDatasetImageText(Dataset):
    """Image-caption pairs from local WebDataset tar shards, read by random access (OpenCLIP's shard convention).

    Every sample is the members ``<key>.<image ext>`` and ``<key>.txt`` of a shard (``key`` = the member path up to
    the first dot of its file name). At construction the shards are scanned once, so each sample gets a fixed
    **index**: its position in shard order, then member order. That index addresses FastCLIP's per-sample
    estimators, so ``data_size = len(dataset)``; samples are read by seeking to the member's offset in the
    uncompressed tar, so any sampler (shuffling, ``DistributedSampler``) works. Compressed shards (``.tar.gz``)
    cannot be read by offset and are refused.

    What is checked when: a sample without an image or a caption, a truncated tar, or data that cannot be read as
    tar from some point on are found by the scan in both modes. With ``on_error="skip"`` the scan also reads every
    sample: its image must pass ``PIL.Image.verify()`` and decode, its caption must be non-empty UTF-8 text; so a
    skip-mode run never meets a bad sample during training. With ``on_error="raise"`` contents are checked when a
    sample is read, and a bad one raises an error naming the shard and the key.

    Args:
        shards: the shard paths (see :func:`expand_shards`).
        transform: image transform (PIL image -> tensor).
        tokenizer: ``tokenizer(list_of_str) -> LongTensor (n, context_length)``; captions are tokenised when read.
        on_error: ``raise`` (a bad sample or shard raises an error naming shard and key) or ``skip`` (bad samples,
            and the unreadable rest of a damaged shard, are dropped, listed in ``skipped`` and warned about).
            Default ``raise``.
    """

    def __init__(
        self,
        shards: Sequence[str | Path],
        transform: Callable[[Any], Tensor],
        tokenizer: Callable[[list[str]], Tensor],
        on_error: Literal["raise", "skip"] = "raise",
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}.")
        self.shards = [Path(p) for p in shards]
        if not self.shards:
            raise ValueError("No WebDataset shards given.")
        self.transform, self.tokenizer = transform, tokenizer
        self.on_error = on_error
        self.skipped: list[str] = []
        # one row per sample: shard index, image offset, image size, caption offset, caption size
        rows: list[tuple[int, int, int, int, int]] = []
        self.keys: list[str] = []
        for si, shard in enumerate(self.shards):
            for key, row in self._scan(si, shard):
                rows.append(row)
                self.keys.append(key)
        if self.skipped:
            msg = f"Skipped {len(self.skipped)} bad WebDataset sample(s) or shard part(s), first: {self.skipped[0]}."
            warnings.warn(msg, stacklevel=2)
            _log.warning(msg)
        self._rows = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
        self.labels = None
        self.classnames = None
        self.templates = None
        self.caption_groups = None

    def _reject(self, where: str, fix: str) -> None:
        """Raise (``on_error="raise"``) or record ``where`` in :attr:`skipped`."""
        if self.on_error == "raise":
            raise ValueError(f"{where}. {fix}, or pass on_error='skip' to drop and count such samples.")
        self.skipped.append(where)

    def _scan(self, si: int, shard: Path) -> list[tuple[str, tuple[int, int, int, int, int]]]:
        """The good samples of one shard as ``(key, row)``; bad ones are rejected (raised or skipped)."""
        order, members, damage = _scan_shard(shard)
        size = shard.stat().st_size
        out = []
        with open(shard, "rb") as f:
            for key in order:
                found = members[key]
                img = next((found[e] for e in WDS_IMAGE_EXTS if e in found), None)
                cap = next((found[e] for e in WDS_CAPTION_EXTS if e in found), None)
                problem = None
                if (img is None or cap is None) and damage is not None and key == order[-1]:
                    problem = "incomplete, the tar ends inside it (truncated)"
                elif img is None or cap is None:
                    problem = f"no {'image' if img is None else 'caption (.txt)'} member"
                elif max(img.offset_data + img.size, cap.offset_data + cap.size) > size:
                    problem = "data past the end of the file (the tar is truncated)"
                elif cap.size == 0:
                    problem = "an empty caption"
                elif self.on_error == "skip":
                    problem = _caption_problem(_read_at(f, cap.offset_data, cap.size))
                    problem = problem or _image_problem(_read_at(f, img.offset_data, img.size))
                if problem is not None:
                    fix = "Every sample needs <key>.jpg/.png/.webp and a non-empty UTF-8 <key>.txt; fix the shard"
                    self._reject(f"{shard} sample {key!r}: {problem}", fix)
                    continue
                assert img is not None and cap is not None  # else `problem` was set above
                out.append((key, (si, img.offset_data, img.size, cap.offset_data, cap.size)))
        if damage is not None:
            last = f"after sample {order[-1]!r}" if order else "before its first sample"
            self._reject(f"{shard}: {damage}, {last}", "Re-create or re-download the shard")
        return out

    def __len__(self) -> int:
        return len(self._rows)

    def _read(self, index: int, offset: int, size: int) -> bytes:
        shard = self.shards[int(self._rows[index, 0])]
        with open(shard, "rb") as f:
            data = _read_at(f, offset, size)
        if len(data) != size:
            raise OSError(
                f"{shard} sample {self.keys[index]!r}: read {len(data)} of {size} bytes; the shard changed or was "
                "truncated after it was scanned. Re-create the datamodule."
            )
        return data

    def caption(self, index: int) -> str:
        """The caption of sample ``index`` (UTF-8 text of its ``.txt`` member)."""
        _, _, _, co, cs = (int(x) for x in self._rows[index])
        where = f"{self.shards[int(self._rows[index, 0])]} sample {self.keys[index]!r}"
        problem = _caption_problem(data := self._read(index, co, cs))
        if problem is not None:
            raise ValueError(f"{where}: {problem}. Fix the shard, or pass on_error='skip' to drop such samples.")
        return data.decode("utf-8").strip()

    def load_image(self, index: int) -> Any:
        """The RGB image of sample ``index``."""
        _, io_off, io_size, _, _ = (int(x) for x in self._rows[index])
        data = self._read(index, io_off, io_size)
        try:
            return _decode_image(data)
        except image_errors() as err:
            where = f"{self.shards[int(self._rows[index, 0])]} sample {self.keys[index]!r}"
            raise OSError(
                f"Cannot decode the image of {where}: {err}. Fix the shard, or pass on_error='skip' to drop such "
                "samples when the shards are scanned."
            ) from err

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, int]:
        tokens = self.tokenizer([self.caption(index)])[0]
        return self.transform(self.load_image(index)), tokens, index


def _read_at(f: Any, offset: int, size: int) -> bytes:
    f.seek(offset)
    return bytes(f.read(size))


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
    "MAX_SHARDS",
    "WDS_CAPTION_EXTS",
    "WDS_IMAGE_EXTS",
    "WebDatasetImageText",
    "WebDatasetSubset",
    "expand_shards",
    "is_webdataset_path",
]
