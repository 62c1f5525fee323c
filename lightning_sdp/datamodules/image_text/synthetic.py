"""Procedurally generated captioned images of coloured shapes, offline and deterministic in a seed.

Two generators share one drawing routine: :func:`make_captioned_shapes` (400 distinct captions) and
:func:`make_captioned_scenes` (more attributes, 12,960 distinct captions). Both label a sample with its
``colour shape`` class (the 40 classes of :func:`shape_classnames`), for zero-shot evaluation.
"""

from __future__ import annotations

from collections.abc import Sized

import numpy as np

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


def make_captioned_shapes(
    num_samples: int, seed: int = 0, image_size: int = 32
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Generate captioned images of coloured shapes, deterministic in ``seed``.

    Each image shows one shape (5 shapes) of one colour (8), size (2) and position (5) on a noisy dark background;
    the caption composes them ("a large red circle in the top left"). The label is ``colour shape`` (40 classes,
    index ``colour * 5 + shape``).

    Returns:
        ``(images (n, s, s, 3) uint8, captions, labels)``.
    """
    rng = np.random.default_rng(seed)
    shape_id, colour_id, size_id, pos_id = _draw_ids(rng, num_samples, SHAPES, COLOURS, SIZES, POSITIONS)
    canvas = _Canvas(image_size)
    sizes, positions = list(SIZES.values()), list(POSITIONS.values())
    size_names, pos_names = list(SIZES), list(POSITIONS)
    images = np.empty((num_samples, image_size, image_size, 3), dtype=np.uint8)
    captions = []
    for i in range(num_samples):
        background = rng.uniform(10, 70, 3).astype(np.float32)
        img = canvas.noisy(rng, background, noise_std=8)
        images[i] = canvas.paint(
            rng, img, SHAPES[shape_id[i]], positions[pos_id[i]], 0.05, sizes[size_id[i]], _COLOUR_RGB[colour_id[i]]
        )
        pos = pos_names[pos_id[i]]
        where = "in the centre" if pos == "centre" else f"in the {pos}"
        captions.append(f"a {size_names[size_id[i]]} {_COLOUR_NAMES[colour_id[i]]} {SHAPES[shape_id[i]]} {where}")
    return images, captions, _labels(colour_id, shape_id)


def make_captioned_scenes(
    num_samples: int, seed: int = 0, image_size: int = 32
) -> tuple[np.ndarray, list[str], np.ndarray]:
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
    shape_id, colour_id, size_id, pos_id, bg_id, outlined = _draw_ids(
        rng, num_samples, SHAPES, COLOURS, SCENE_SIZES, SCENE_POSITIONS, SCENE_BACKGROUNDS, ("filled", "outlined")
    )
    canvas = _Canvas(image_size)
    backgrounds = np.array(list(SCENE_BACKGROUNDS.values()), dtype=np.float32)
    sizes, positions = list(SCENE_SIZES.values()), list(SCENE_POSITIONS.values())
    size_names, pos_names, bg_names = list(SCENE_SIZES), list(SCENE_POSITIONS), list(SCENE_BACKGROUNDS)
    images = np.empty((num_samples, image_size, image_size, 3), dtype=np.uint8)
    captions = []
    for i in range(num_samples):
        img = canvas.noisy(rng, backgrounds[bg_id[i]], noise_std=6)
        images[i] = canvas.paint(
            rng,
            img,
            SHAPES[shape_id[i]],
            positions[pos_id[i]],
            0.03,
            sizes[size_id[i]],
            _COLOUR_RGB[colour_id[i]],
            outlined=bool(outlined[i]),
        )
        pos = pos_names[pos_id[i]]
        where = "in the centre" if pos == "centre" else f"at the {pos}"
        style = "outlined" if outlined[i] else "filled"
        captions.append(
            f"a {size_names[size_id[i]]} {style} {_COLOUR_NAMES[colour_id[i]]} {SHAPES[shape_id[i]]} {where} on a "
            f"{bg_names[bg_id[i]]} background"
        )
    return images, captions, _labels(colour_id, shape_id)


def shape_classnames() -> list[str]:
    """The 40 ``colour shape`` class names of :func:`make_captioned_shapes`, in label order."""
    return [f"{c} {s}" for c in COLOURS for s in SHAPES]


# ------------------------------------------------------------------------------------ drawing shared by both sets
_COLOUR_NAMES = list(COLOURS)
_COLOUR_RGB = np.array(list(COLOURS.values()), dtype=np.float32)
_OUTLINE_INNER = 0.55
"""An outlined shape is the shape minus the same shape scaled by this factor."""


def _draw_ids(rng: np.random.Generator, n: int, *choices: Sized) -> tuple[np.ndarray, ...]:
    """One uniform index array per attribute, drawn in argument order (the order fixes the data of a seed)."""
    return tuple(rng.integers(0, len(options), n) for options in choices)


def _labels(colour_id: np.ndarray, shape_id: np.ndarray) -> np.ndarray:
    """The ``colour shape`` label of :func:`shape_classnames`."""
    return colour_id * len(SHAPES) + shape_id


class _Canvas:
    """Pixel-centre coordinates in ``[0, 1]`` of an ``image_size`` square image, and the two drawing steps."""

    def __init__(self, image_size: int) -> None:
        self.size = image_size
        centres = (np.arange(image_size) + 0.5) / image_size
        self.yy, self.xx = np.meshgrid(centres, centres, indexing="ij")

    def noisy(self, rng: np.random.Generator, rgb: np.ndarray, noise_std: float) -> np.ndarray:
        """A float32 image of colour ``rgb`` plus Gaussian pixel noise."""
        return rgb + rng.normal(0, noise_std, (self.size, self.size, 3)).astype(np.float32)

    def paint(
        self,
        rng: np.random.Generator,
        img: np.ndarray,
        shape: str,
        centre: tuple[float, float],
        jitter: float,
        radius_range: tuple[float, float],
        rgb: np.ndarray,
        outlined: bool = False,
    ) -> np.ndarray:
        """Paint ``shape`` around ``centre`` (moved by up to ``jitter``) in a noisy ``rgb``; returns uint8 pixels."""
        cy, cx = np.asarray(centre) + rng.uniform(-jitter, jitter, 2)
        rad = rng.uniform(*radius_range)
        dy, dx = self.yy - cy, self.xx - cx
        mask = _shape_mask(shape, dy, dx, rad)
        if outlined:
            mask &= ~_shape_mask(shape, dy, dx, rad * _OUTLINE_INNER)
        img[mask] = np.clip(rgb + rng.normal(0, 12, 3), 0, 255)
        return np.clip(img, 0, 255).astype(np.uint8)


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


__all__ = [
    "COLOURS",
    "POSITIONS",
    "SCENE_BACKGROUNDS",
    "SCENE_POSITIONS",
    "SCENE_SIZES",
    "SHAPES",
    "SHAPE_TEMPLATES",
    "SIZES",
    "make_captioned_scenes",
    "make_captioned_shapes",
    "shape_classnames",
]
