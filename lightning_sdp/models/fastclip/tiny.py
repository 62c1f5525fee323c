"""Moved to :mod:`lightning_sdp.integrations.open_clip` (the open_clip adapter, which the image-text datamodule
uses too); this module re-exports its public names so that ``lightning_sdp.models.fastclip.tiny`` keeps working."""

from lightning_sdp.integrations.open_clip import (
    CLIP_CONFIGS,
    NANO_CONFIG,
    NANO_NAME,
    TINY_CONFIG,
    TINY_NAME,
    build_clip,
    image_size_of,
    preprocess_for,
    register_config,
    register_tiny_config,
    registered_name,
    resolve_model_name,
    tokenizer_for,
)

__all__ = [
    "CLIP_CONFIGS",
    "NANO_CONFIG",
    "NANO_NAME",
    "TINY_CONFIG",
    "TINY_NAME",
    "build_clip",
    "image_size_of",
    "preprocess_for",
    "register_config",
    "register_tiny_config",
    "registered_name",
    "resolve_model_name",
    "tokenizer_for",
]
