"""Image-caption data for CLIP training: OpenCLIP's CSV convention, an image folder with a captions file, and two
built-in offline sets (procedurally generated captioned shapes; scikit-learn's digits with prompt captions).

Every sample is ``(image, tokens, index)`` where ``index`` is the sample's position in its dataset: FastCLIP's
per-sample estimators are addressed by it, so ``data_size = len(train_set)``.
"""

from __future__ import annotations

import csv
import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

_log = logging.getLogger(__name__)

SHAPES = ("circle", "square", "triangle", "cross", "ring")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 90, 235),
    "yellow": (235, 215, 40),
    "purple": (150, 60, 200),
    "orange": (245, 140, 30),
    "white": (240, 240, 240),
    "cyan": (40, 210, 220),
}
SIZES = {"small": (0.11, 0.15), "large": (0.2, 0.26)}
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (0.28, 0.28),
    "top right": (0.28, 0.72),
    "bottom left": (0.72, 0.28),
    "bottom right": (0.72, 0.72),
    "centre": (0.5, 0.5),
}
SHAPE_TEMPLATES = ("a {}.", "a picture of a {}.", "a drawing of a {}.", "a {} shape.")
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
DIGIT_TEMPLATES = ("a photo of the number {}.", "a handwritten digit {}.", "the digit {}.", "a picture of a {}.")


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
        bad = [i for i, c in enumerate(self.captions) if not _has_text(c)]
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
        self, paths: Sequence[str | Path], captions: Sequence[str], on_error: Literal["raise", "skip"] = "raise", **kwargs: Any
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}.")
        paths = [Path(p) for p in paths]
        captions = list(captions)
        self.skipped: list[str] = []
        if on_error == "raise":
            missing = [str(p) for p in paths if not p.is_file()]
            if missing:
                raise FileNotFoundError(
                    f"{len(missing)} image file(s) not found, first: {missing[0]}. Fix the paths, or pass "
                    "on_error='skip' to drop and count them."
                )
            empty = [str(p) for p, c in zip(paths, captions, strict=True) if not _has_text(c)]
            if empty:
                raise ValueError(
                    f"{len(empty)} pair(s) have an empty caption, first: the caption of {empty[0]}. Fill the captions "
                    "in, or pass on_error='skip' to drop and count these pairs."
                )
            # a cheap header check of every file (no decoding), so a corrupt image stops setup, not training
            unreadable = [str(p) for p in paths if not _readable_header(p)]
            if unreadable:
                raise OSError(
                    f"{len(unreadable)} image file(s) cannot be read as images, first: {unreadable[0]}. Replace or "
                    "remove them, or pass on_error='skip' to drop and count them."
                )
        else:
            keep = []
            for i, p in enumerate(paths):
                if not _has_text(captions[i]):
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
            paths = [paths[i] for i in keep]
            captions = [captions[i] for i in keep]
        super().__init__(captions, **kwargs)
        self.paths = paths

    def load_image(self, index: int) -> Any:
        from PIL import Image

        path = self.paths[index]
        try:
            with Image.open(path) as img:
                return img.convert("RGB")
        except (OSError, ValueError) as err:
            raise OSError(f"Cannot read image {path}: {err}") from err


def _has_text(caption: Any) -> bool:
    return isinstance(caption, str) and bool(caption.strip())


def _readable_header(path: Path) -> bool:
    """Whether PIL recognises the file's format and reads its size from the header (no pixel decoding)."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.size  # noqa: B018 - parsed from the header
        return True
    except (OSError, ValueError, SyntaxError):
        return False


def _readable_image(path: Path) -> bool:
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.verify()
        return True
    except (OSError, ValueError, SyntaxError):
        return False


def read_csv_pairs(path: str | Path, img_key: str = "filepath", caption_key: str = "title", separator: str = "\t") -> tuple[list[Path], list[str]]:
    """Read OpenCLIP's CSV convention: one row per pair, an image-path column and a caption column.

    Relative image paths are resolved against the CSV file's folder.

    Args:
        path: CSV/TSV file.
        img_key: image path column. Default ``filepath``.
        caption_key: caption column. Default ``title``.
        separator: column separator. Default tab.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"CSV file not found: {path}")
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=separator)
        fields = reader.fieldnames or []
        for key in (img_key, caption_key):
            if key not in fields:
                raise KeyError(
                    f"Column {key!r} not in {path} (columns: {fields}). Set csv_img_key/csv_caption_key/csv_separator."
                )
        rows = list(reader)
    for line, r in enumerate(rows, 2):
        for key in (img_key, caption_key):
            if r.get(key) is None:
                raise ValueError(
                    f"{path}:{line}: the row has no {key!r} value (it has fewer columns than the header "
                    f"{fields}). Fix the row, or check csv_separator ({separator!r})."
                )
    return [_resolve(path.parent, r[img_key]) for r in rows], [r[caption_key] for r in rows]


def read_folder_pairs(folder: str | Path, captions_file: str = "captions.tsv") -> tuple[list[Path], list[str]]:
    """Read an image folder with a captions file of ``file_name<TAB>caption`` lines.

    Args:
        folder: the image folder.
        captions_file: captions file inside ``folder``. Default ``captions.tsv``.
    """
    folder = Path(folder)
    cap = folder / captions_file
    if not cap.is_file():
        raise FileNotFoundError(f"Captions file not found: {cap} (expected lines 'file_name<TAB>caption').")
    paths, captions = [], []
    for n, line in enumerate(cap.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if "\t" not in line:
            raise ValueError(f"{cap}:{n}: expected 'file_name<TAB>caption', got {line!r}.")
        name, caption = line.split("\t", 1)
        paths.append(_resolve(folder, name))
        captions.append(caption.strip())
    return paths, captions


def _resolve(base: Path, name: str) -> Path:
    p = Path(name)
    return p if p.is_absolute() else base / p


def make_captioned_shapes(num_samples: int, seed: int = 0, image_size: int = 32) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Generate captioned images of coloured shapes, deterministic in ``seed``.

    Each image shows one shape (5 shapes) of one colour (8), size (2) and position (5) on a noisy dark background;
    the caption composes them ("a large red circle in the top left"). The label is ``colour shape`` (40 classes,
    index ``colour * 5 + shape``).

    Returns:
        ``(images (n, s, s, 3) uint8, captions, labels)``.
    """
    rng = np.random.default_rng(seed)
    s = image_size
    shape_id = rng.integers(0, len(SHAPES), num_samples)
    colour_id = rng.integers(0, len(COLOURS), num_samples)
    size_id = rng.integers(0, len(SIZES), num_samples)
    pos_id = rng.integers(0, len(POSITIONS), num_samples)
    yy, xx = np.meshgrid((np.arange(s) + 0.5) / s, (np.arange(s) + 0.5) / s, indexing="ij")
    colours = np.array(list(COLOURS.values()), dtype=np.float32)
    sizes = list(SIZES.values())
    positions = list(POSITIONS.values())
    images = np.empty((num_samples, s, s, 3), dtype=np.uint8)
    captions = []
    for i in range(num_samples):
        bg = rng.uniform(10, 70, 3).astype(np.float32)
        img = bg + rng.normal(0, 8, (s, s, 3)).astype(np.float32)
        cy, cx = np.asarray(positions[pos_id[i]]) + rng.uniform(-0.05, 0.05, 2)
        rad = rng.uniform(*sizes[size_id[i]])
        dy, dx = yy - cy, xx - cx
        mask = _shape_mask(SHAPES[shape_id[i]], dy, dx, rad)
        colour = np.clip(colours[colour_id[i]] + rng.normal(0, 12, 3), 0, 255)
        img[mask] = colour
        images[i] = np.clip(img, 0, 255).astype(np.uint8)
        pos = list(POSITIONS)[pos_id[i]]
        where = "in the centre" if pos == "centre" else f"in the {pos}"
        captions.append(f"a {list(SIZES)[size_id[i]]} {list(COLOURS)[colour_id[i]]} {SHAPES[shape_id[i]]} {where}")
    labels = colour_id * len(SHAPES) + shape_id
    return images, captions, labels


SCENE_BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (12, 12, 12),
    "grey": (85, 85, 85),
    "navy": (20, 25, 95),
    "brown": (95, 55, 25),
    "olive": (75, 80, 20),
    "maroon": (95, 20, 40),
}
SCENE_SIZES = {"small": (0.1, 0.13), "medium": (0.15, 0.18), "large": (0.21, 0.25)}
SCENE_POSITIONS: dict[str, tuple[float, float]] = {
    f"{v}{' ' if v and h else ''}{h}" or "centre": (cy, cx)
    for v, cy in (("top", 0.27), ("", 0.5), ("bottom", 0.73))
    for h, cx in (("left", 0.27), ("", 0.5), ("right", 0.73))
}


def make_captioned_scenes(num_samples: int, seed: int = 0, image_size: int = 32) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Captioned shapes with more attributes, so that few captions repeat (deterministic in ``seed``).

    One shape (5) of one colour (8), size (3), style (filled or outlined), position (9) on a named background (6):
    12,960 distinct captions such as "a large outlined red circle at the top left on a navy background". In
    :func:`make_captioned_shapes` only 400 captions exist, so in a set of 10,000 pairs every caption has ~25 exact
    copies, which the global contrastive loss must treat as negatives; here a caption has ~1 copy per 13,000 pairs.
    The label is ``colour shape`` (the 40 classes of :func:`shape_classnames`).

    Returns:
        ``(images (n, s, s, 3) uint8, captions, labels)``.
    """
    rng = np.random.default_rng(seed)
    s = image_size
    shape_id = rng.integers(0, len(SHAPES), num_samples)
    colour_id = rng.integers(0, len(COLOURS), num_samples)
    size_id = rng.integers(0, len(SCENE_SIZES), num_samples)
    pos_id = rng.integers(0, len(SCENE_POSITIONS), num_samples)
    bg_id = rng.integers(0, len(SCENE_BACKGROUNDS), num_samples)
    outlined = rng.integers(0, 2, num_samples).astype(bool)
    yy, xx = np.meshgrid((np.arange(s) + 0.5) / s, (np.arange(s) + 0.5) / s, indexing="ij")
    colours = np.array(list(COLOURS.values()), dtype=np.float32)
    backgrounds = np.array(list(SCENE_BACKGROUNDS.values()), dtype=np.float32)
    sizes, positions = list(SCENE_SIZES.values()), list(SCENE_POSITIONS.values())
    size_names, pos_names, bg_names = list(SCENE_SIZES), list(SCENE_POSITIONS), list(SCENE_BACKGROUNDS)
    images = np.empty((num_samples, s, s, 3), dtype=np.uint8)
    captions = []
    for i in range(num_samples):
        img = backgrounds[bg_id[i]] + rng.normal(0, 6, (s, s, 3)).astype(np.float32)
        cy, cx = np.asarray(positions[pos_id[i]]) + rng.uniform(-0.03, 0.03, 2)
        rad = rng.uniform(*sizes[size_id[i]])
        dy, dx = yy - cy, xx - cx
        mask = _shape_mask(SHAPES[shape_id[i]], dy, dx, rad)
        if outlined[i]:
            mask &= ~_shape_mask(SHAPES[shape_id[i]], dy, dx, rad * 0.55)
        img[mask] = np.clip(colours[colour_id[i]] + rng.normal(0, 12, 3), 0, 255)
        images[i] = np.clip(img, 0, 255).astype(np.uint8)
        pos = pos_names[pos_id[i]]
        where = "in the centre" if pos == "centre" else f"at the {pos}"
        style = "outlined" if outlined[i] else "filled"
        captions.append(
            f"a {size_names[size_id[i]]} {style} {list(COLOURS)[colour_id[i]]} {SHAPES[shape_id[i]]} {where} on a "
            f"{bg_names[bg_id[i]]} background"
        )
    labels = colour_id * len(SHAPES) + shape_id
    return images, captions, labels


def shape_classnames() -> list[str]:
    """The 40 ``colour shape`` class names of :func:`make_captioned_shapes`, in label order."""
    return [f"{c} {s}" for c in COLOURS for s in SHAPES]


def _shape_mask(shape: str, dy: np.ndarray, dx: np.ndarray, rad: float) -> np.ndarray:
    r = np.sqrt(dy * dy + dx * dx)
    if shape == "circle":
        return r < rad
    if shape == "square":
        return np.maximum(np.abs(dy), np.abs(dx)) < rad * 0.85
    if shape == "triangle":
        return (dy < rad * 0.8) & (np.abs(dx) < (dy + rad) * 0.6) & (dy > -rad)
    if shape == "cross":
        arm = rad / 3
        return ((np.abs(dx) < arm) & (np.abs(dy) < rad)) | ((np.abs(dy) < arm) & (np.abs(dx) < rad))
    if shape == "ring":
        return (r < rad) & (r > rad * 0.55)
    raise ValueError(f"unknown shape {shape!r}")


def make_digits(image_size: int = 32, seed: int = 0) -> tuple[np.ndarray, list[str], np.ndarray]:
    """scikit-learn's 1,797 8x8 digits, upscaled to RGB ``image_size`` images, with prompt captions.

    Returns:
        ``(images (n, s, s, 3) uint8, captions, labels)``.
    """
    from lightning_sdp._imports import require

    require("sklearn", feature="the digits image-caption set")
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    raw = (digits.images * (255.0 / 16.0)).astype(np.uint8)
    images = np.stack(
        [np.asarray(Image.fromarray(im).resize((image_size, image_size), Image.BILINEAR).convert("RGB")) for im in raw]
    )
    labels = digits.target.astype(np.int64)
    templates = rng.integers(0, len(DIGIT_TEMPLATES), len(labels))
    captions = [DIGIT_TEMPLATES[t].format(DIGIT_NAMES[y]).rstrip(".") for t, y in zip(templates, labels, strict=True)]
    return images, captions, labels


# ---------------------------------------------------------------------------------------------------- WebDataset
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


class _Subset(Dataset):
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


class ImageTextDataModule(LightningDataModule):
    """Image-caption pairs for CLIP training; samples are ``(image, tokens, index)``.

    Args:
        dataset: ``shapes`` (built-in procedural captioned shapes, 400 distinct captions), ``scenes`` (the same
            with more attributes, 12,960 distinct captions; see :func:`make_captioned_scenes`), ``digits``
            (scikit-learn digits with prompt captions), ``csv`` (OpenCLIP's CSV convention), ``folder`` (images +
            captions file), ``webdataset`` (local tar shards, OpenCLIP's convention; see
            :class:`WebDatasetImageText`) or ``auto``: from ``train_data`` (a ``.tar`` file, a brace pattern such as
            ``shards/{000..009}.tar`` or ``::``-joined patterns: ``webdataset``; another file: ``csv``; a folder:
            ``folder``; none: ``shapes``). A shard pattern as ``train_data`` is read as WebDataset also with
            ``csv`` or ``folder``. Default ``auto``.
        train_data: CSV file (``csv``), image folder (``folder``) or shard pattern (``webdataset``) of the training
            pairs.
        val_data: same for validation; ``None`` holds out ``val_fraction`` of the training pairs.
        model: model whose tokenizer and image size to use (``"tiny"``, an open_clip name or config dict). Default
            ``"tiny"``.
        batch_size: per-device training batch size (FastCLIP's global batch = this times the devices). Default 64.
        val_batch_size: validation batch size (default ``batch_size``).
        num_workers: DataLoader workers. Default 0.
        num_train: number of generated training samples (``shapes``, ``scenes``). Default 2000.
        num_val: number of generated validation samples (``shapes``, ``scenes``). Default 500.
        val_fraction: held-out fraction when ``val_data`` is ``None`` (``digits``, ``csv``, ``folder``). Default 0.1.
        seed: generation and split seed. Default 0.
        csv_img_key: image-path column of the CSV. Default ``filepath``.
        csv_caption_key: caption column of the CSV. Default ``title``.
        csv_separator: CSV separator. Default tab.
        captions_file: captions file inside an image folder. Default ``captions.tsv``.
        on_error: ``raise`` on a missing/unreadable image (naming the file) or ``skip`` (drop and count). Default
            ``raise``.
        augment: use open_clip's training transform (random resized crop) for training; else the eval transform.
            Default True.
        drop_last: drop the last incomplete training batch of every epoch. Default True: FastCLIP's losses need at
            least 2 pairs per global batch and equal local batches on every rank, so a short last batch (one pair
            when ``len(train_set) % batch_size == 1``) would stop training at the epoch's end. With ``False`` the
            last batch is kept (several devices still get equal shards, without padding duplicates).
    """

    def __init__(
        self,
        dataset: Literal["auto", "shapes", "scenes", "digits", "csv", "folder", "webdataset"] = "auto",
        train_data: str | None = None,
        val_data: str | None = None,
        model: str | dict[str, Any] = "tiny",
        batch_size: int = 64,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        num_train: int = 2000,
        num_val: int = 500,
        val_fraction: float = 0.1,
        seed: int = 0,
        csv_img_key: str = "filepath",
        csv_caption_key: str = "title",
        csv_separator: str = "\t",
        captions_file: str = "captions.tsv",
        on_error: Literal["raise", "skip"] = "raise",
        augment: bool = True,
        drop_last: bool = True,
    ) -> None:
        super().__init__()
        kinds = ("auto", "shapes", "scenes", "digits", "csv", "folder", "webdataset")
        if dataset not in kinds:
            raise ValueError(f"dataset must be one of {', '.join(repr(k) for k in kinds)}, got {dataset!r}.")
        if dataset in ("csv", "folder", "webdataset") and train_data is None:
            raise ValueError(f"dataset={dataset!r} needs train_data (a CSV file, an image folder or a shard pattern).")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
        self.save_hyperparameters()
        self.train_set: ImageTextDataset | None = None
        self.val_set: ImageTextDataset | None = None

    @property
    def kind(self) -> str:
        """The data source in use: ``dataset``, or what ``auto`` (or a shard pattern) resolves to."""
        hp = self.hparams
        if is_webdataset_path(hp.train_data) and hp.dataset in ("auto", "csv", "folder", "webdataset"):
            return "webdataset"
        if hp.dataset != "auto":
            return hp.dataset
        if hp.train_data is None:
            return "shapes"
        return "folder" if Path(hp.train_data).is_dir() else "csv"

    @property
    def data_size(self) -> int:
        """Number of training samples (``FastCLIPModule``'s ``data_size``); builds the sets if needed."""
        if self.train_set is None:
            self.setup("fit")
        return len(self.train_set)

    @property
    def classnames(self) -> list[str] | None:
        """Class names for zero-shot evaluation (``None`` for CSV/folder data)."""
        return self.val_set.classnames if self.val_set is not None else None

    @property
    def templates(self) -> list[str] | None:
        """Prompt templates for zero-shot evaluation."""
        return self.val_set.templates if self.val_set is not None else None

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        from lightning_sdp.models.fastclip.tiny import image_size_of, preprocess_for, tokenizer_for

        tok = tokenizer_for(hp.model)
        train_tf = preprocess_for(hp.model, is_train=hp.augment)
        val_tf = preprocess_for(hp.model, is_train=False)
        size = image_size_of(hp.model)
        kind = self.kind
        if kind == "webdataset":
            self._setup_webdataset(train_tf, val_tf, tok)
        elif kind in ("shapes", "scenes"):
            make = make_captioned_shapes if kind == "shapes" else make_captioned_scenes
            imgs, caps, labels = make(hp.num_train, seed=hp.seed, image_size=size)
            vimgs, vcaps, vlabels = make(hp.num_val, seed=hp.seed + 1_000_003, image_size=size)
            meta = {"classnames": shape_classnames(), "templates": SHAPE_TEMPLATES}
            self.train_set = ArrayImageText(imgs, caps, transform=train_tf, tokenizer=tok, labels=labels, **meta)
            self.val_set = ArrayImageText(vimgs, vcaps, transform=val_tf, tokenizer=tok, labels=vlabels, **meta)
        elif kind == "digits":
            imgs, caps, labels = make_digits(size, seed=hp.seed)
            tr, va = _split(len(caps), hp.val_fraction, hp.seed)
            meta = {"classnames": list(DIGIT_NAMES), "templates": DIGIT_TEMPLATES}
            self.train_set = ArrayImageText(
                imgs[tr], [caps[i] for i in tr], transform=train_tf, tokenizer=tok, labels=labels[tr], **meta
            )
            self.val_set = ArrayImageText(
                imgs[va], [caps[i] for i in va], transform=val_tf, tokenizer=tok, labels=labels[va], **meta
            )
        else:
            read = (
                (lambda p: read_csv_pairs(p, hp.csv_img_key, hp.csv_caption_key, hp.csv_separator))
                if kind == "csv"
                else (lambda p: read_folder_pairs(p, hp.captions_file))
            )
            paths, caps = read(hp.train_data)
            if hp.val_data is not None:
                vpaths, vcaps = read(hp.val_data)
            else:
                tr, va = _split(len(caps), hp.val_fraction, hp.seed)
                vpaths, vcaps = [paths[i] for i in va], [caps[i] for i in va]
                paths, caps = [paths[i] for i in tr], [caps[i] for i in tr]
            self.train_set = FileImageText(paths, caps, on_error=hp.on_error, transform=train_tf, tokenizer=tok)
            self.val_set = FileImageText(vpaths, vcaps, on_error=hp.on_error, transform=val_tf, tokenizer=tok)
        if len(self.train_set) < 2:
            raise ValueError(f"The training set has {len(self.train_set)} pairs; CLIP training needs at least 2.")

    def _setup_webdataset(self, train_tf: Any, val_tf: Any, tok: Any) -> None:
        hp = self.hparams
        train = WebDatasetImageText(expand_shards(hp.train_data), train_tf, tok, on_error=hp.on_error)
        if hp.val_data is not None:
            self.train_set = train
            self.val_set = WebDatasetImageText(expand_shards(hp.val_data), val_tf, tok, on_error=hp.on_error)
        else:
            tr, va = _split(len(train), hp.val_fraction, hp.seed)
            self.train_set, self.val_set = _Subset(train, tr, train_tf), _Subset(train, va, val_tf)

    def _world(self) -> tuple[int, int]:
        trainer = self._trainer if hasattr(self, "_trainer") else None
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        return 0, 1

    @override
    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        rank, world = self._world()
        hp = self.hparams
        if world > 1:
            # drop_last: no padding duplicates (the estimators need distinct samples) and equal shards
            sampler: Any = DistributedSampler(self.train_set, world, rank, shuffle=True, seed=hp.seed, drop_last=True)
        else:
            sampler = EpochSeededSampler(len(self.train_set), seed=hp.seed)
        drop_last = bool(hp.drop_last)
        if drop_last and len(self.train_set) // world < hp.batch_size:
            raise ValueError(
                f"batch_size={hp.batch_size} is larger than the {len(self.train_set) // world} training pairs per "
                "device; with drop_last=True no batch would remain. Lower batch_size or pass drop_last=False."
            )
        return DataLoader(
            self.train_set,
            batch_size=hp.batch_size,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=hp.num_workers,
            persistent_workers=hp.num_workers > 0,
        )

    @override
    def val_dataloader(self) -> DataLoader:
        self.setup("fit")
        hp = self.hparams
        return DataLoader(
            self.val_set,
            batch_size=hp.val_batch_size or hp.batch_size,
            shuffle=False,
            num_workers=hp.num_workers,
            persistent_workers=hp.num_workers > 0,
        )


class EpochSeededSampler(torch.utils.data.Sampler[int]):
    """A random permutation per epoch drawn from ``seed + epoch``, so a resumed run sees the same order.

    Lightning calls :meth:`set_epoch` at the start of every epoch (as for ``DistributedSampler``).

    Args:
        n: dataset length.
        seed: base seed.
    """

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = int(n), int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):  # noqa: ANN204
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


def _split(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    perm = np.random.default_rng(seed).permutation(n)
    n_val = max(1, int(round(n * val_fraction)))
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])

