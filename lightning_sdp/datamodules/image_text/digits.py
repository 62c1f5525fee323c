"""scikit-learn's handwritten digits as an offline image-caption set with prompt captions."""

from __future__ import annotations

import numpy as np

from lightning_sdp._imports import require

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
DIGIT_TEMPLATES = ("a photo of the number {}.", "a handwritten digit {}.", "the digit {}.", "a picture of a {}.")


def make_digits(image_size: int = 32, seed: int = 0) -> tuple[np.ndarray, list[str], np.ndarray]:
    """scikit-learn's 1,797 8x8 digits, upscaled to RGB ``image_size`` images, with prompt captions.

    Returns:
        ``(images (n, s, s, 3) uint8, captions, labels)``.
    """
    require("sklearn", feature="the digits image-caption set")
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    raw = (digits.images * (255.0 / 16.0)).astype(np.uint8)
    images = np.stack(
        [
            np.asarray(Image.fromarray(im).resize((image_size, image_size), Image.Resampling.BILINEAR).convert("RGB"))
            for im in raw
        ]
    )
    labels = digits.target.astype(np.int64)
    templates = rng.integers(0, len(DIGIT_TEMPLATES), len(labels))
    captions = [DIGIT_TEMPLATES[t].format(DIGIT_NAMES[y]).rstrip(".") for t, y in zip(templates, labels, strict=True)]
    return images, captions, labels


__all__ = ["DIGIT_NAMES", "DIGIT_TEMPLATES", "make_digits"]
