"""``ImageTextDataModule``: image-caption pairs for CLIP training from a built-in set, a CSV file, an image folder
or WebDataset shards; samples are ``(image, tokens, index)``."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_sdp.datamodules.image_text.datasets import ArrayImageText, FileImageText, ImageTextDataset
from lightning_sdp.datamodules.image_text.digits import DIGIT_NAMES, DIGIT_TEMPLATES, make_digits
from lightning_sdp.datamodules.image_text.readers import read_csv_pairs, read_folder_pairs
from lightning_sdp.datamodules.image_text.synthetic import (
    SHAPE_TEMPLATES,
    make_captioned_scenes,
    make_captioned_shapes,
    shape_classnames,
)
from lightning_sdp.datamodules.image_text.webdataset import (
    WebDatasetImageText,
    WebDatasetSubset,
    expand_shards,
    is_webdataset_path,
)
from lightning_sdp.datamodules.sampling import EpochSeededSampler, epoch_permutation
from lightning_sdp.integrations.open_clip import image_size_of, preprocess_for, tokenizer_for

_ImageTextSet = ImageTextDataset | WebDatasetImageText | WebDatasetSubset
"""A training or validation set: samples ``(image, tokens, index)``, with ``classnames`` and ``templates``."""


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
        batch_size: per-device training batch size (FastCLIP's global batch = this times the devices). The global
            batches do not depend on the number of devices: ``batch_size=b`` on ``K`` devices trains on the same
            batches, in the same order, as ``batch_size=K * b`` on one (so a run can resume on another number of
            processes). Default 64.
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
        on_error: ``raise`` on a bad sample (a missing or unreadable image, naming the file; for WebDataset shards
            also a missing, empty or non-UTF-8 caption or a damaged tar, naming shard and key) or ``skip`` (drop and
            count; WebDataset shards are then checked sample by sample when scanned). Default ``raise``.
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
        self.train_set: _ImageTextSet | None = None
        self.val_set: _ImageTextSet | None = None

    @property
    def _hp(self) -> AttributeDict:
        """``self.hparams`` typed for attribute access (Lightning annotates it as a plain ``MutableMapping``)."""
        return cast(AttributeDict, self.hparams)

    def _sets(self) -> tuple[_ImageTextSet, _ImageTextSet]:
        """The training and validation sets, built on first use."""
        self.setup("fit")
        assert self.train_set is not None and self.val_set is not None  # setup builds both or raises
        return self.train_set, self.val_set

    @property
    def kind(self) -> str:
        """The data source in use: ``dataset``, or what ``auto`` (or a shard pattern) resolves to."""
        hp = self._hp
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
        return len(self._sets()[0])

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
        hp = self._hp
        tok = tokenizer_for(hp.model)
        train_tf = preprocess_for(hp.model, is_train=hp.augment)
        val_tf = preprocess_for(hp.model, is_train=False)
        size = image_size_of(hp.model)
        kind = self.kind
        train_set: _ImageTextSet
        val_set: _ImageTextSet
        if kind == "webdataset":
            train_set, val_set = self._webdataset_sets(train_tf, val_tf, tok)
        elif kind in ("shapes", "scenes"):
            make = make_captioned_shapes if kind == "shapes" else make_captioned_scenes
            imgs, caps, labels = make(hp.num_train, seed=hp.seed, image_size=size)
            vimgs, vcaps, vlabels = make(hp.num_val, seed=hp.seed + 1_000_003, image_size=size)
            meta = {"classnames": shape_classnames(), "templates": SHAPE_TEMPLATES}
            train_set = ArrayImageText(imgs, caps, transform=train_tf, tokenizer=tok, labels=labels, **meta)
            val_set = ArrayImageText(vimgs, vcaps, transform=val_tf, tokenizer=tok, labels=vlabels, **meta)
        elif kind == "digits":
            imgs, caps, labels = make_digits(size, seed=hp.seed)
            tr, va = _holdout_split(len(caps), hp.val_fraction, hp.seed)
            meta = {"classnames": list(DIGIT_NAMES), "templates": DIGIT_TEMPLATES}
            train_set = ArrayImageText(
                imgs[tr], [caps[i] for i in tr], transform=train_tf, tokenizer=tok, labels=labels[tr], **meta
            )
            val_set = ArrayImageText(
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
                tr, va = _holdout_split(len(caps), hp.val_fraction, hp.seed)
                vpaths, vcaps = [paths[i] for i in va], [caps[i] for i in va]
                paths, caps = [paths[i] for i in tr], [caps[i] for i in tr]
            train_set = FileImageText(paths, caps, on_error=hp.on_error, transform=train_tf, tokenizer=tok)
            val_set = FileImageText(vpaths, vcaps, on_error=hp.on_error, transform=val_tf, tokenizer=tok)
        self.train_set, self.val_set = train_set, val_set
        if len(train_set) < 2:
            raise ValueError(f"The training set has {len(train_set)} pairs; CLIP training needs at least 2.")

    def _webdataset_sets(self, train_tf: Any, val_tf: Any, tok: Any) -> tuple[_ImageTextSet, _ImageTextSet]:
        hp = self._hp
        train = WebDatasetImageText(expand_shards(hp.train_data), train_tf, tok, on_error=hp.on_error)
        if hp.val_data is not None:
            return train, WebDatasetImageText(expand_shards(hp.val_data), val_tf, tok, on_error=hp.on_error)
        tr, va = _holdout_split(len(train), hp.val_fraction, hp.seed)
        return WebDatasetSubset(train, tr, train_tf), WebDatasetSubset(train, va, val_tf)

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        return 0, 1

    @override
    def train_dataloader(self) -> DataLoader:
        train_set, _ = self._sets()
        rank, world = self._world()
        hp = self._hp
        if world > 1:
            sampler: Any = _GlobalBatchShard(train_set, world, rank, hp.batch_size, hp.seed, bool(hp.drop_last))
        else:
            sampler = EpochSeededSampler(len(train_set), seed=hp.seed)
        drop_last = bool(hp.drop_last)
        if drop_last and len(train_set) // world < hp.batch_size:
            raise ValueError(
                f"batch_size={hp.batch_size} is larger than the {len(train_set) // world} training pairs per "
                "device; with drop_last=True no batch would remain. Lower batch_size or pass drop_last=False."
            )
        return DataLoader(
            train_set,
            batch_size=hp.batch_size,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=hp.num_workers,
            persistent_workers=hp.num_workers > 0,
        )

    @override
    def val_dataloader(self) -> DataLoader:
        _, val_set = self._sets()
        hp = self._hp
        return DataLoader(
            val_set,
            batch_size=hp.val_batch_size or hp.batch_size,
            shuffle=False,
            num_workers=hp.num_workers,
            persistent_workers=hp.num_workers > 0,
        )


def _holdout_split(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted training and held-out indices of ``range(n)``; ``val_fraction`` of them (at least one) held out."""
    perm = np.random.default_rng(seed).permutation(n)
    n_val = max(1, int(round(n * val_fraction)))
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


class _GlobalBatchShard(DistributedSampler):
    """Process ``rank``'s share of each global batch of the one-process order (:class:`EpochSeededSampler`).

    Global batch ``s`` holds positions ``[s * G, (s + 1) * G)`` of the epoch's permutation (``G = world * batch``);
    rank ``r`` takes its ``r``-th slice of ``batch`` positions, so the ranks together (in rank order, as FastCLIP
    gathers them) train on the batches one process would train on with ``batch_size = G``. No sample is repeated
    (no padding: the estimators need distinct samples). Without ``drop_last`` the remainder is split evenly (what
    does not divide is left out), so every rank runs the same number of steps. A ``DistributedSampler``, so
    Lightning keeps it (and calls ``set_epoch``).
    """

    def __init__(self, dataset: Sized, world: int, rank: int, batch: int, seed: int, drop_last: bool) -> None:
        super().__init__(dataset, world, rank, shuffle=True, seed=seed, drop_last=True)  # type: ignore[arg-type]
        self.n, self.batch = len(dataset), int(batch)
        self.keep_rest = not drop_last

    def _positions(self) -> list[int]:
        global_batch = self.batch * self.num_replicas
        full = self.n // global_batch
        out: list[int] = []
        for s in range(full):
            start = s * global_batch + self.rank * self.batch
            out.extend(range(start, start + self.batch))
        if self.keep_rest:
            per_rank = (self.n - full * global_batch) // self.num_replicas
            start = full * global_batch + self.rank * per_rank
            out.extend(range(start, start + per_rank))
        return out

    def __iter__(self) -> Iterator[int]:
        order = epoch_permutation(self.n, self.seed, self.epoch)
        return iter(order[self._positions()].tolist())

    def __len__(self) -> int:
        return len(self._positions())
