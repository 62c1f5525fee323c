"""open_clip adapter: the bundled small CLIP configs, model building, tokenizers, image transforms and sizes.

Both :class:`~lightning_sdp.datamodules.ImageTextDataModule` (tokenizer, transforms, image size) and
:class:`~lightning_sdp.models.FastCLIPModule` (the model) use it, so it lives below both. ``open_clip`` is the
optional ``clip`` extra and is imported inside the functions.

Bundled configs (:data:`CLIP_CONFIGS`), usable as ``model="tiny"`` / ``model="nano"`` or as the dicts themselves:

- ``tiny`` (:data:`TINY_CONFIG`, registered as ``fastclip-tiny``): ~1.7M parameters, 2 layers per tower; the
  default model of the examples and of ``FastCLIPModule``.
- ``nano`` (:data:`NANO_CONFIG`, registered as ``fastclip-nano``): ~0.8M parameters, 1 layer per tower, small enough
  for many runs on 2 CPU cores; the model of the FastCLIP benchmarks and of the demo.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path
from typing import Any

from torch import nn

from lightning_sdp._files import write_text_atomic
from lightning_sdp._imports import require

TINY_NAME = "fastclip-tiny"
"""open_clip model name under which :data:`TINY_CONFIG` is registered (``model="tiny"`` is an alias)."""

TINY_CONFIG: dict[str, Any] = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "mlp_ratio": 2.0, "patch_size": 8},
    "text_cfg": {"context_length": 24, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2, "mlp_ratio": 2.0},
}
"""A ~1.7M-parameter CLIP (ViT on 32x32 images, 2 layers per tower; most weights are the BPE token embedding)."""

NANO_NAME = "fastclip-nano"
"""open_clip model name under which :data:`NANO_CONFIG` is registered (``model="nano"`` is an alias)."""

NANO_CONFIG: dict[str, Any] = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 48, "head_width": 24, "mlp_ratio": 2.0, "patch_size": 8},
    "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 16, "heads": 1, "layers": 1, "mlp_ratio": 2.0},
}
"""A ~0.8M-parameter CLIP for many runs on 2 CPU cores: ViT with 8 px patches on 32 px images, 1-layer towers
(the model of the FastCLIP benchmarks and of the demo)."""

CLIP_CONFIGS: dict[str, dict[str, Any]] = {"tiny": TINY_CONFIG, "nano": NANO_CONFIG}
"""The bundled configs by alias; alias ``a`` is registered with open_clip as ``fastclip-a``."""


def _open_clip() -> Any:
    require("open_clip", feature="FastCLIP models")
    import open_clip

    return open_clip


def registered_name(alias: str) -> str:
    """The open_clip model name of a bundled config's alias (``"tiny"`` -> ``"fastclip-tiny"``)."""
    if alias not in CLIP_CONFIGS:
        raise ValueError(
            f"No bundled CLIP config {alias!r}; the bundled ones are {', '.join(map(repr, CLIP_CONFIGS))}."
        )
    return f"fastclip-{alias}"


def register_config(alias: str) -> str:
    """Register the bundled config ``alias`` with ``open_clip.add_model_config`` (idempotent); returns its name.

    open_clip reads configs from files, so the config is written as JSON into a private per-user folder of the
    temporary directory (``<tmp>/lightning_sdp_open_clip_<uid>``, created with mode 0700). A folder there that is
    a symlink, belongs to another user or is writable by group/others is refused (it could hold a planted file or
    symlink); the file is written with mode 0600 through :func:`lightning_sdp._files.write_text_atomic` (a fresh
    private folder, then :func:`os.replace`, which never follows a symlink at either name).

    Args:
        alias: a key of :data:`CLIP_CONFIGS` (``"tiny"`` or ``"nano"``).
    """
    name = registered_name(alias)
    open_clip = _open_clip()
    if name in open_clip.list_models():
        return name
    uid = os.getuid() if hasattr(os, "getuid") else 0
    folder = _private_dir(Path(tempfile.gettempdir()) / f"lightning_sdp_open_clip_{uid}")
    path = folder / f"{name}.json"
    text = json.dumps(CLIP_CONFIGS[alias], indent=1)
    if path.is_symlink() or not path.is_file() or path.read_text() != text:
        write_text_atomic(path, text, private=True)
    open_clip.add_model_config(path)
    return name


def _private_dir(folder: Path) -> Path:
    """Create ``folder`` with mode 0700 if needed, and check that only the current user can use it.

    A folder of ours that others may only read (``0755``, as earlier versions created it) is tightened to 0700.

    Raises:
        PermissionError: ``folder`` is a symlink, not a directory, owned by another user, or writable by group or
            others.
    """
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(folder)
    fix = f"Remove it (if it is yours: `rm -r {folder}`) or point TMPDIR to a private directory."
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(
            f"{folder} is not a plain directory (a symlink or a file); refusing to write into it. {fix}"
        )
    if os.name == "posix":
        if st.st_uid != os.getuid():
            raise PermissionError(
                f"{folder} belongs to user id {st.st_uid}, not to you ({os.getuid()}); refusing to write into it. {fix}"
            )
        if st.st_mode & 0o022:
            raise PermissionError(
                f"{folder} has mode {stat.S_IMODE(st.st_mode):o}: group or others may write into it, so its files "
                f"cannot be trusted; refusing to use it. {fix}"
            )
        if st.st_mode & 0o077:
            # ours and writable only by us (earlier versions created it 0755): nobody else can have planted anything
            os.chmod(folder, 0o700)
    return folder


def resolve_model_name(name: str) -> str:
    """Map a bundled alias (``"tiny"``, ``"nano"``) to its registered name and check that an open_clip name is known."""
    open_clip = _open_clip()
    for alias in CLIP_CONFIGS:
        if name in (alias, registered_name(alias)):
            return register_config(alias)
    if name.startswith(("hf-hub:", "local-dir:")):
        return name
    if name.replace("/", "-") not in open_clip.list_models():
        known = ", ".join(open_clip.list_models()[:12])
        raise ValueError(
            f"Unknown open_clip model {name!r}. Use 'tiny' or 'nano' (bundled CPU configs), an open_clip name such as "
            f"{known}, ..., a config dict or an nn.Module with encode_image/encode_text."
        )
    return name


def tokenizer_for(model: str | dict[str, Any] | nn.Module) -> Callable[..., Any]:
    """The open_clip tokenizer of a model name, config dict or module (BPE vocabulary shipped in the wheel)."""
    open_clip = _open_clip()
    if isinstance(model, str):
        return open_clip.get_tokenizer(resolve_model_name(model))
    if isinstance(model, dict):
        context_length = int(model.get("text_cfg", {}).get("context_length", 77))
    else:
        context_length = int(getattr(model, "context_length", 77))
    return open_clip.tokenizer.SimpleTokenizer(context_length=context_length)


def image_size_of(model: str | dict[str, Any] | nn.Module) -> int:
    """Input image size of a model name, config dict or open_clip module (224 when unknown)."""
    if isinstance(model, str):
        open_clip = _open_clip()
        cfg = open_clip.get_model_config(resolve_model_name(model)) or {}
    elif isinstance(model, dict):
        cfg = model
    else:
        size = getattr(getattr(model, "visual", None), "image_size", 224)
        return int(size[0] if isinstance(size, (tuple, list)) else size)
    size = cfg.get("vision_cfg", {}).get("image_size", 224)
    return int(size[0] if isinstance(size, (tuple, list)) else size)


def preprocess_for(model: str | dict[str, Any] | nn.Module, is_train: bool) -> Callable[..., Any]:
    """open_clip's preprocess transform (PIL image -> normalised tensor) for the model's image size."""
    open_clip = _open_clip()
    return open_clip.image_transform(image_size_of(model), is_train=is_train)


def build_clip(model: str | dict[str, Any] | nn.Module, pretrained: str | None = None) -> nn.Module:
    """Build the CLIP module.

    Args:
        model: ``"tiny"`` / ``"nano"`` (bundled configs), an open_clip model name (random init unless
            ``pretrained``), an open_clip config dict (``embed_dim``, ``vision_cfg``, ``text_cfg``) or a module with
            ``encode_image`` and ``encode_text``.
        pretrained: path of a local open_clip checkpoint (weights cannot be downloaded here), or ``None``.
    """
    if isinstance(model, nn.Module):
        for attr in ("encode_image", "encode_text"):
            if not callable(getattr(model, attr, None)):
                raise TypeError(f"A custom model must define {attr}(); {type(model).__name__} does not.")
        if pretrained is not None:
            raise ValueError(
                "pretrained is only used with an open_clip model name; load your module's weights yourself."
            )
        return model
    open_clip = _open_clip()
    if isinstance(model, dict):
        missing = {"embed_dim", "vision_cfg", "text_cfg"} - set(model)
        if missing:
            raise ValueError(
                f"An open_clip config dict needs the keys embed_dim, vision_cfg, text_cfg; missing {sorted(missing)}."
            )
        if pretrained is not None:
            raise ValueError("pretrained is only used with an open_clip model name.")
        return open_clip.CLIP(**deepcopy(model))
    name = resolve_model_name(model)
    if pretrained is not None and not os.path.isfile(pretrained):
        raise FileNotFoundError(
            f"pretrained={pretrained!r} is not a file. Pass the path of a local open_clip checkpoint "
            "(pretrained tags need a download, which this setup does not do), or pretrained=None."
        )
    clip, _, _ = open_clip.create_model_and_transforms(name, pretrained=pretrained)
    return clip


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
    "registered_name",
    "resolve_model_name",
    "tokenizer_for",
]
