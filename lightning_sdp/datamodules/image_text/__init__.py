"""Image-caption data for CLIP training: OpenCLIP's CSV convention, an image folder with a captions file, local
WebDataset shards, and three built-in offline sets (procedurally generated captioned shapes and scenes;
scikit-learn's digits with prompt captions).

Every sample is ``(image, tokens, index)`` where ``index`` is the sample's position in its dataset: FastCLIP's
per-sample estimators are addressed by it, so ``data_size = len(train_set)``.

One module per concept: :mod:`.datasets` (in-memory and file-backed datasets), :mod:`.readers` (CSV and folder
readers), :mod:`.synthetic` (the generated shapes and scenes), :mod:`.digits`, :mod:`.webdataset` (tar shards) and
:mod:`.datamodule` (``ImageTextDataModule``); the public names of all of them are importable from here. The training
sampler is :class:`lightning_sdp.datamodules.sampling.EpochSeededSampler`.
"""

from lightning_sdp.datamodules.image_text.datamodule import ImageTextDataModule
from lightning_sdp.datamodules.image_text.datasets import ArrayImageText, FileImageText, ImageTextDataset
from lightning_sdp.datamodules.image_text.digits import DIGIT_NAMES, DIGIT_TEMPLATES, make_digits
from lightning_sdp.datamodules.image_text.readers import read_csv_pairs, read_folder_pairs
from lightning_sdp.datamodules.image_text.synthetic import (
    COLOURS,
    POSITIONS,
    SCENE_BACKGROUNDS,
    SCENE_POSITIONS,
    SCENE_SIZES,
    SHAPE_TEMPLATES,
    SHAPES,
    SIZES,
    make_captioned_scenes,
    make_captioned_shapes,
    shape_classnames,
)
from lightning_sdp.datamodules.image_text.webdataset import (
    WDS_CAPTION_EXTS,
    WDS_IMAGE_EXTS,
    WebDatasetImageText,
    WebDatasetSubset,
    expand_shards,
    is_webdataset_path,
)

__all__ = [
    "COLOURS",
    "DIGIT_NAMES",
    "DIGIT_TEMPLATES",
    "POSITIONS",
    "SCENE_BACKGROUNDS",
    "SCENE_POSITIONS",
    "SCENE_SIZES",
    "SHAPES",
    "SHAPE_TEMPLATES",
    "SIZES",
    "WDS_CAPTION_EXTS",
    "WDS_IMAGE_EXTS",
    "ArrayImageText",
    "FileImageText",
    "ImageTextDataModule",
    "ImageTextDataset",
    "WebDatasetImageText",
    "WebDatasetSubset",
    "expand_shards",
    "is_webdataset_path",
    "make_captioned_scenes",
    "make_captioned_shapes",
    "make_digits",
    "read_csv_pairs",
    "read_folder_pairs",
    "shape_classnames",
]
