"""``SolarDataModule``: SOLAR's schedule-aware loading of a large HDF5 training set as a LightningDataModule.

Sun et al., "SOLAR: A Highly Optimized Data Loading Framework for Distributed Training of CNN-based Scientific
Surrogates", arXiv 2211.00224. See :mod:`lightning_sdp.datamodules.solar.schedule` for the algorithm.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_sdp._imports import require
from lightning_sdp._options import check_option
from lightning_sdp.datamodules.solar.buffer import EVICTION_POLICIES, parse_size
from lightning_sdp.datamodules.solar.loader import (
    BatchFormat,
    BatchReader,
    SolarLoader,
    check_batch_format,
    check_choice,
    check_joinable_targets,
    no_collate,
)
from lightning_sdp.datamodules.solar.options import SolarReadOptions
from lightning_sdp.datamodules.solar.reader import (
    VALIDATE_MODES,
    DatasetInfo,
    FileIdentity,
    HDF5Reader,
    check_h5_path,
    data_fingerprint,
    inspect_h5,
)
from lightning_sdp.datamodules.solar.readplan import (
    FAST_LOCAL_STORAGE,
    READ_AHEAD_WINDOWS,
    ReadPlan,
    StorageProfile,
    page_cache_holds,
    plan_reads,
    probe_storage,
)
from lightning_sdp.datamodules.solar.schedule import EPOCH_ORDERS, SolarSchedule, epoch_steps, even_split

_T = TypeVar("_T")

_log = logging.getLogger(__name__)
DEFAULT_READ_AHEAD_BYTES = 64 * 2**20
"""Read-ahead per rank when no ``buffer_size`` is given."""


def _check_int(name: str, value: object, low: int | None, meaning: str = "") -> None:
    """Check an integer option: ``TypeError`` unless ``value`` is an integer (not a bool), ``ValueError`` under ``low``.

    Args:
        name: the option, as the user spells it.
        value: what was given.
        low: the smallest allowed value (``None``: any integer).
        meaning: a few words on the option's values for the message.
    """
    if isinstance(value, np.integer):
        value = int(value)
    check_option(name, value, int, "SolarDataModule")
    if low is None or value >= low:  # type: ignore[operator]
        return
    need = f"an integer >= {low}"
    raise ValueError(f"SolarDataModule: {name} must be {need}{f' ({meaning})' if meaning else ''}, got {value!r}.")


def _is_solar_metrics(callback: object) -> bool:
    """Whether ``callback`` is (a subclass of) ``lightning_sdp.callbacks.SolarMetrics``, found by name because
    the data layer does not import the callbacks layer."""
    return any(
        cls.__name__ == "SolarMetrics" and cls.__module__ == "lightning_sdp.callbacks.solar"
        for cls in type(callback).__mro__
    )


class SolarDataModule(LightningDataModule):
    """SOLAR data loading for a large HDF5 training set (Sun et al., arXiv 2211.00224).

    Every epoch's shuffled order is drawn ahead from ``seed``; each rank keeps a buffer of ``buffer_size / P``
    samples with Belady eviction, buffered samples are re-routed to the rank that holds them inside their global
    batch, and the step's storage reads are split evenly across ranks (local batch sizes vary; each batch carries
    ``loss_scale = P / G`` so that ``loss = loss_scale * per_sample_losses.sum()`` gives the global-mean gradient
    under DDP). Misses are read with one hyperslab per run of consecutive indices, in ``num_workers`` processes.

    Batches are ``(input, target)`` pairs by default, so a module written for ``x, y = batch`` works unchanged:
    ``input`` (B, ...), ``target`` (B, ...; one target key keeps its per-sample shape, e.g. ``(B,)`` for a 1-D label
    set; several are concatenated along dim 1, so they need one dtype and matching shapes after dim 1, checked in
    ``setup``). ``batch_format="dict"`` adds what a pair cannot carry: ``{"input", "target", "index", "loss_scale"}``
    with the sample ids and the loss scale that keeps DDP's gradient the global mean when local batch sizes differ
    (the bundled :class:`~lightning_sdp.models.PtychoNN` uses it when present). ``batch_format="tuple"`` gives
    ``(input, target_1, ..., target_k)``, one tensor per target dataset.

    ``trainer.test`` / ``trainer.predict`` read the test split (``test_path`` or ``test_split``) when one is
    configured, else the validation split; with neither they raise an error that says what to set.

    Works with any ``Trainer(use_distributed_sampler=...)``: the training loader is not a ``DataLoader`` and the
    evaluation loaders carry their own (one-replica) ``DistributedSampler`` over the rank's share, so Lightning
    replaces neither. The files are checked with ``os.stat`` before every read request: one rewritten or replaced
    during training raises :class:`~lightning_sdp.datamodules.solar.reader.FileChangedError` instead of yielding
    samples from stale offsets. To try it without data of your own, write the synthetic
    PtychoNN-like set first with :func:`~lightning_sdp.datamodules.solar.make_ptycho_h5` (keys ``diffraction`` ->
    ``amplitude``, ``phase``).

    Args:
        path: training HDF5 file.
        input_key: dataset holding the inputs (first axis = samples). Default ``"x"``.
        target_key: dataset (or list of datasets) holding the targets. Default ``"y"``.
        batch_size: nominal per-rank batch size ``B`` (global batch ``P * B``). Default 32.
        buffer_size: the loaders' memory for all ranks together: an int number of samples, or bytes as a string
            (``"8GB"``, ``"512MiB"``). The read-ahead and the buffer share it (:attr:`read_plan` says how); a size in
            bytes is a memory budget, and holds the loaders' working memory (their batches and threads) too, so
            that a memory cap of the training's own needs plus ``buffer_size`` holds. More than the data caches
            everything. 0 (default): no buffer, and up to 64 MiB per rank of read-ahead.
        num_workers: reader processes per rank for training. 0 (default): a background thread of the rank's
            process reads the plan's next windows while the model trains, on into the next epoch, within the
            read-ahead's share of ``buffer_size``; with workers, each reads ``prefetch_factor`` windows ahead within
            one epoch. Validation is read in the rank's own process.
        eviction: ``"belady"`` (default), ``"lru"``, ``"fifo"``, ``"solar"`` (consumed-first FIFO) or
            ``"artifact_fifo"`` (the SOLAR artifact's rule, transcribed).
        reroute: serve buffered samples on the rank holding them. Default True.
        balance: split storage reads evenly across ranks with variable local batches. Default True.
        epoch_order: ``"identity"`` (default) or ``"tsp"`` (order epochs for overlap; needs a fixed horizon).
        max_local_batch: cap on a local batch when balancing. Default ``2 * batch_size``.
        seed: seed of the shuffled orders. Default 0.
        max_epochs: epochs to plan. Default: the Trainer's ``max_epochs`` (or enough for ``max_steps``).
        val_path: separate validation HDF5 file with the same keys. Default None.
        val_split: fraction of ``path`` held out for validation (its last samples) when ``val_path`` is None.
            Default 0 (no validation).
        val_batch_size: validation (and test / predict) batch size per rank. Default ``batch_size``.
        test_path: separate test HDF5 file with the same keys, for ``trainer.test`` / ``trainer.predict``.
            Default None.
        test_split: fraction of ``path`` held out for testing (its last samples, after the validation share)
            when ``test_path`` is None. Default 0 (test and predict use the validation split).
        batch_format: ``"pair"`` (default): ``(input, target)``, for ``x, y = batch``; ``"dict"``: ``{"input",
            "target", "index", "loss_scale"}`` (the same tensors plus the sample ids and the loss scale);
            ``"tuple"``: ``(input, target_1, ..., target_k)``, one tensor per dataset with its own per-sample
            shape. Pairs and tuples carry no ``loss_scale``: on one process a mean loss is exact; with several ranks
            and ``balance=True`` local batch sizes differ, so a per-rank mean loss is not the global mean (``setup``
            warns): use ``"dict"`` with ``loss = batch["loss_scale"] * per_sample_losses.sum()``, or
            ``balance=False`` for equal local batches.
        validate: ``"warn"`` (default; first non-finite sample per key), ``"raise"`` or ``"off"``: check that
            float samples are finite as they are read. HDF5 checksums are verified by HDF5 where datasets have them.
        reads: how the training file is read (read window, gaps, threads, the device profile, the page cache): a
            :class:`~lightning_sdp.datamodules.solar.options.SolarReadOptions`. Default ``None``: its defaults, the
            plan chosen for the probed device.
        drop_last: drop the smaller last global batch of each epoch. Default False.
        log_metrics: expect a :class:`lightning_sdp.callbacks.SolarMetrics` callback on the Trainer (it logs the
            ``solar/*`` metrics) and warn once in ``setup`` when there is none; ``False`` trains without those
            metrics and without the warning. The DataModule cannot add the callback itself: nothing under
            ``lightning_sdp.datamodules`` imports from ``lightning_sdp.callbacks``. Default True.
    """

    def __init__(
        self,
        path: str,
        input_key: str = "x",
        target_key: str | list[str] = "y",
        batch_size: int = 32,
        buffer_size: int | str = 0,
        num_workers: int = 0,
        eviction: Literal["belady", "lru", "fifo", "solar", "artifact_fifo"] = "belady",
        reroute: bool = True,
        balance: bool = True,
        epoch_order: Literal["identity", "tsp"] = "identity",
        max_local_batch: int | None = None,
        seed: int = 0,
        max_epochs: int | None = None,
        val_path: str | None = None,
        val_split: float = 0.0,
        val_batch_size: int | None = None,
        test_path: str | None = None,
        test_split: float = 0.0,
        batch_format: BatchFormat = "pair",
        validate: Literal["warn", "raise", "off"] = "warn",
        reads: SolarReadOptions | None = None,
        drop_last: bool = False,
        log_metrics: bool = True,
    ) -> None:
        super().__init__()
        require("h5py", feature="SolarDataModule")
        _check_int("batch_size", batch_size, 1)
        _check_int("num_workers", num_workers, 0)
        _check_int("seed", seed, None)
        if reads is not None and not isinstance(reads, SolarReadOptions):
            raise TypeError(
                f"SolarDataModule: reads must be a SolarReadOptions or None, got {reads!r} ({type(reads).__name__})."
            )
        if val_batch_size is not None:
            _check_int("val_batch_size", val_batch_size, 1, "None uses batch_size")
        if max_epochs is not None:
            _check_int("max_epochs", max_epochs, 1, "None plans the Trainer's epochs")
        if max_local_batch is not None:
            _check_int("max_local_batch", max_local_batch, batch_size, "None allows 2 * batch_size")
        check_choice("eviction", eviction, EVICTION_POLICIES)
        check_choice("epoch_order", epoch_order, EPOCH_ORDERS)
        check_choice("validate", validate, VALIDATE_MODES)
        parse_size(buffer_size, 1)  # a malformed size ("8 gigs") is refused now, sized from the samples in setup
        if not 0.0 <= val_split < 1.0:
            raise ValueError(f"val_split must be in [0, 1), got {val_split}")
        if not 0.0 <= test_split < 1.0:
            raise ValueError(f"test_split must be in [0, 1), got {test_split}")
        if val_split + test_split >= 1.0:
            raise ValueError(
                f"val_split + test_split must be below 1 to leave training samples, got {val_split} + {test_split}"
            )
        check_batch_format(batch_format)
        self.save_hyperparameters()
        self.path = os.fspath(path)
        self.input_key = input_key
        self.target_keys = [target_key] if isinstance(target_key, str) else list(target_key)
        if not self.target_keys:
            raise ValueError("target_key must name at least one dataset")
        self.batch_size = batch_size
        self.buffer_size = buffer_size
        self.num_workers = num_workers
        self.eviction, self.reroute, self.balance, self.epoch_order = eviction, reroute, balance, epoch_order
        self.max_local_batch, self.seed, self.max_epochs = max_local_batch, seed, max_epochs
        self.val_path, self.val_split = val_path, val_split
        self.val_batch_size = val_batch_size or batch_size
        self.test_path, self.test_split = test_path, test_split
        self.batch_format = batch_format
        self.drop_last, self.validate = drop_last, validate
        self.reads = reads if reads is not None else SolarReadOptions()
        self.cold_gap: int | None = None
        self._page_cache = False
        self.read_plan: ReadPlan | None = None
        self.log_metrics = log_metrics
        self.schedule: SolarSchedule | None = None
        self.info: DatasetInfo | None = None
        self.train_loader: SolarLoader | None = None
        self.rank, self.world_size = 0, 1
        self.num_train = 0
        self._val_ids: np.ndarray | None = None
        self._test_ids: np.ndarray | None = None
        self._pending_state: dict[str, Any] | None = None
        self._identities: dict[str, FileIdentity] = {}
        self._fingerprint: dict[str, Any] | None = None

    # ------------------------------------------------------------------ schedule
    def _num_epochs(self, trainer: Trainer | None, steps_per_epoch: int) -> int:
        if self.max_epochs is not None:
            return self.max_epochs
        if trainer is not None:
            if trainer.max_epochs is not None and trainer.max_epochs > 0:
                return trainer.max_epochs
            if trainer.max_steps is not None and trainer.max_steps > 0:
                return max(1, math.ceil(trainer.max_steps / steps_per_epoch))
        if self.epoch_order == "tsp":
            raise ValueError(
                "epoch_order='tsp' needs a fixed number of epochs: set SolarDataModule(max_epochs=...) or "
                "Trainer(max_epochs=...)"
            )
        return 1

    @override
    def setup(self, stage: str) -> None:
        """Check the files and the Trainer, and build the schedule for this rank."""
        trainer = self.trainer
        if trainer is not None:
            # No use_distributed_sampler check: Lightning injects a DistributedSampler only into DataLoaders without
            # one, under a distributed strategy. The training loader is not a DataLoader, and the evaluation loaders
            # bring a one-replica DistributedSampler over this rank's share (see _eval_loader).
            self.rank, self.world_size = trainer.global_rank, trainer.world_size
            callbacks = trainer.callbacks  # type: ignore[attr-defined]
            if self.log_metrics and not any(_is_solar_metrics(c) for c in callbacks):
                rank_zero_warn(
                    "SolarDataModule: the Trainer has no SolarMetrics callback, so the solar/* loading metrics "
                    "(buffer hit rate, storage bytes, samples/s) are not logged. Add it with "
                    "`Trainer(callbacks=[lightning_sdp.callbacks.SolarMetrics()], ...)` (YAML: `trainer: {callbacks: "
                    "[{class_path: lightning_sdp.callbacks.SolarMetrics}]}`), or create the DataModule with "
                    "log_metrics=False to train without them."
                )
        if self.schedule is not None and self.schedule.world_size == self.world_size:
            return
        if not Path(self.path).exists():
            raise FileNotFoundError(
                f"SOLAR training file {self.path!r} does not exist. Point path= at your HDF5 file, or write the "
                f"synthetic PtychoNN-like set there first: `lightning-sdp ptycho-generate --out {self.path}` (in "
                "Python: lightning_sdp.datamodules.solar.make_ptycho_h5(path))."
            )
        check_h5_path(self.path, "training file")  # a directory
        keys = [self.input_key, *self.target_keys]
        self._identities = {self.path: FileIdentity.of(self.path)}
        self.info = inspect_h5(self.path, keys)
        check_joinable_targets(self.info.shapes, self.info.dtypes, self.target_keys, self.batch_format)
        self._fingerprint = data_fingerprint(self.path, keys)
        self._identities[self.path].check(self.path)  # the layout and fingerprint belong to the file first seen
        n = self.info.num_samples
        # the file's layout: [training | validation share | test share]
        n_test = 0 if self.test_path is not None or self.test_split <= 0 else max(1, round(n * self.test_split))
        n_val = 0 if self.val_path is not None or self.val_split <= 0 else max(1, round(n * self.val_split))
        if n_val + n_test >= n:
            raise ValueError(
                f"val_split={self.val_split} and test_split={self.test_split} leave no training samples out of {n}"
            )
        self.num_train = n - n_val - n_test
        if self.val_path is not None:
            self._val_ids = np.arange(self._held_out_samples(self.val_path, "validation"), dtype=np.int64)
        else:
            self._val_ids = np.arange(self.num_train, self.num_train + n_val, dtype=np.int64) if n_val else None
        if self.test_path is not None:
            self._test_ids = np.arange(self._held_out_samples(self.test_path, "test"), dtype=np.int64)
        else:
            self._test_ids = np.arange(n - n_test, n, dtype=np.int64) if n_test else None
        if self.batch_format != "dict" and self.world_size > 1 and self.balance:
            rank_zero_warn(
                f"SolarDataModule(batch_format={self.batch_format!r}): these batches carry no loss_scale, and with "
                "balance=True the local batch sizes differ between ranks, so a per-rank mean loss under DDP is not "
                "the global mean. Set balance=False for equal local batches, or use batch_format='dict' with "
                "loss = batch['loss_scale'] * per_sample_losses.sum()."
            )
        capacity = parse_size(self.buffer_size, self.info.sample_nbytes)
        if capacity == 0 and isinstance(self.buffer_size, str) and parse_size(self.buffer_size, 1) > 0:
            rank_zero_warn(
                f"SolarDataModule(buffer_size={self.buffer_size!r}) is less than one sample "
                f"({self.info.sample_nbytes} bytes), so the buffer holds nothing and every sample is read from "
                "storage each epoch. Give a larger size (e.g. '512MiB') or an int number of samples."
            )
        if capacity > self.num_train:
            _log.info("SolarDataModule: buffer (%d samples) holds the whole training set", capacity)
        self._page_cache = self._page_cache_holds()
        self.read_plan = self._plan_reads(capacity)
        self.cold_gap = self._plan_cold_gap(capacity, self.read_plan)
        self._warn_if_budget_short(capacity, self.read_plan)
        warming = (
            ""
            if self.cold_gap is None
            else f"; file streamed into the page cache, reads across gaps up to {self.cold_gap}"
        )
        rank_zero_info(f"SolarDataModule read plan: {self.read_plan.describe()}{warming}")
        self._build_schedule(self.read_plan)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)

    def _warn_if_budget_short(self, capacity: int, plan: ReadPlan) -> None:
        """Warn when a byte ``buffer_size`` holds less than the loaders' working memory and the read-ahead's windows."""
        assert self.info is not None
        needed = plan.working_samples + READ_AHEAD_WINDOWS * plan.read_window * self.batch_size * self.world_size
        if capacity == 0 or needed <= capacity or not isinstance(self.buffer_size, str):
            return
        mib = needed * self.info.sample_nbytes / 2**20
        rank_zero_warn(
            f"SolarDataModule(buffer_size={self.buffer_size!r}) is {capacity} samples, less than the loaders' "
            f"working memory and {READ_AHEAD_WINDOWS} read windows on each of {self.world_size} ranks ({needed} "
            f"samples, {mib:.1f} MiB): the loaders will use more memory than buffer_size, and no buffer is kept. "
            f"Give buffer_size >= '{math.ceil(mib)}MiB', or a smaller batch_size."
        )

    def _plan_cold_gap(self, capacity: int, plan: ReadPlan) -> int | None:
        """The gap for runs the page cache does not hold yet (``None``: no warming), with the plan's window."""
        warm = self.reads.warm_page_cache
        if warm is False or plan.max_gap == 0 or self.num_workers > 0:
            return None
        if warm == "auto" and (self.reads.max_gap != "auto" or not self._page_cache):
            return None  # a gap the user chose, or a plan that counts every transferred row (what a cold device pays)
        cold = self._plan_reads(capacity, window=plan.read_window, page_cache=False).max_gap
        return cold if cold < plan.max_gap else None  # the plan's runs are what a cold device pays for anyway

    def _plan_reads(self, capacity: int, window: int | None = None, page_cache: bool | None = None) -> ReadPlan:
        """Window, gap and the memory split (buffer + read-ahead = ``buffer_size``) for this device."""
        assert self.info is not None
        if window is None:
            window, gap = self.reads.fixed_window, self.reads.fixed_gap
        else:
            gap = None
        if page_cache is None:
            page_cache = self._page_cache
        storage = self.reads.storage if isinstance(self.reads.storage, StorageProfile) else FAST_LOCAL_STORAGE
        if self.reads.storage == "probe" and (window is None or gap is None):
            storage = self._probe()
        sample = self.info.sample_nbytes
        with_buffer = capacity > 0
        # no buffer_size: the read-ahead alone, at most DEFAULT_READ_AHEAD_BYTES per rank
        memory = capacity if with_buffer else self.world_size * max(1, DEFAULT_READ_AHEAD_BYTES // sample)
        trainer = self.trainer
        return plan_reads(
            num_samples=self.num_train,
            world_size=self.world_size,
            ranks_per_device=trainer.num_devices if trainer is not None else 1,
            batch_size=self.batch_size,
            memory_samples=memory,
            row_nbytes=list(self.info.row_nbytes.values()),
            storage=storage,
            read_window=window,
            max_gap=gap,
            balance=self.balance,
            with_buffer=with_buffer,
            page_cache=page_cache,
            io_threads=self.reads.io_threads,
            # a size in bytes is a memory budget (e.g. a cgroup's): it holds the loaders' batches and threads too
            reserve_working=with_buffer and isinstance(self.buffer_size, str),
        )

    def _page_cache_holds(self) -> bool:
        """Whether the page cache can keep the training file for an epoch (:func:`page_cache_holds`: the memory the
        machine and this process's memory cgroups leave free), decided on rank 0."""
        return bool(self._on_rank_zero(lambda: page_cache_holds(os.path.getsize(self.path))))

    def _probe(self) -> StorageProfile:
        """The training file's device, probed on rank 0."""
        return self._on_rank_zero(lambda: probe_storage(self.path, self.reads.io_threads))

    def _on_rank_zero(self, decide: Callable[[], _T]) -> _T:
        """``decide()`` on rank 0, broadcast to every rank: inputs of the plan, which must be one plan for all."""
        trainer = self.trainer
        if trainer is None or self.world_size == 1:
            return decide()
        value = trainer.strategy.broadcast(decide() if self.rank == 0 else None, src=0)
        assert value is not None  # rank 0 sent its decision
        return value

    def _build_schedule(self, plan: ReadPlan) -> None:
        steps = epoch_steps(self.num_train, self.world_size, self.batch_size, self.drop_last)
        if self.train_loader is not None:
            self.train_loader.close()
        self.train_loader = None
        self.schedule = SolarSchedule(
            num_samples=self.num_train,
            num_epochs=self._num_epochs(self.trainer, max(steps, 1)),
            world_size=self.world_size,
            local_batch_size=self.batch_size,
            buffer_size=plan.buffer_samples,
            seed=self.seed,
            eviction=self.eviction,
            reroute=self.reroute,
            balance=self.balance,
            epoch_order=self.epoch_order,
            max_local_batch=self.max_local_batch,
            drop_last=self.drop_last,
        )

    def _held_out_samples(self, path: str, role: str) -> int:
        """Samples of a separate validation or test file, after checking its per-sample shapes and dtypes against
        the training file's (a mismatch would otherwise fail at the first evaluation batch, or not at all)."""
        assert self.info is not None
        check_h5_path(path, f"{role} file")
        self._identities[path] = FileIdentity.of(path)
        info = inspect_h5(path, [self.input_key, *self.target_keys])
        bad = [
            f"{k}: {info.dtypes[k].name} {info.shapes[k]} vs {self.info.dtypes[k].name} {self.info.shapes[k]}"
            for k in info.shapes
            if info.shapes[k] != self.info.shapes[k] or info.dtypes[k] != self.info.dtypes[k]
        ]
        if bad:
            raise ValueError(
                f"{role} file {path!r} does not match the training file {self.path!r} in sample shapes or dtypes "
                f"(per sample, {role} vs training: {'; '.join(bad)}). Write the {role} set with the same per-sample "
                "shapes and dtypes as the training set (e.g. with the same script), or hold out part of the training "
                f"file with {'val' if role == 'validation' else 'test'}_split= instead."
            )
        return info.num_samples

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Per-sample input shape (after ``setup``)."""
        self._require_setup()
        assert self.info is not None
        return self.info.shapes[self.input_key]

    @property
    def resolved_read_window(self) -> int:
        """``read_window`` in steps (``"auto"``: the read plan's; after ``setup``)."""
        self._require_setup()
        assert self.read_plan is not None
        return self.read_plan.read_window

    @property
    def resolved_max_gap(self) -> int:
        """``max_gap`` in rows (``"auto"``: the read plan's; after ``setup``)."""
        self._require_setup()
        assert self.read_plan is not None
        return self.read_plan.max_gap

    def _require_setup(self) -> None:
        if self.schedule is None:
            raise RuntimeError("call SolarDataModule.setup() (or Trainer.fit) first")

    def _reader(self, path: str) -> HDF5Reader:
        return HDF5Reader(
            path,
            [self.input_key, *self.target_keys],
            identity=self._identities.get(path),
            # with the warmer, runs merge across the gaps a cold device pays for; it streams the long runs
            max_gap=self.cold_gap if self.cold_gap is not None and path == self.path else self.resolved_max_gap,
            io_threads=self.reads.io_threads,
            readahead=self.reads.readahead,
            validate=self.validate,
        )

    # ------------------------------------------------------------------ loaders
    @override
    def train_dataloader(self) -> SolarLoader:
        self._require_setup()
        assert self.schedule is not None
        if self.train_loader is None or self.train_loader.schedule is not self.schedule:
            self.train_loader = SolarLoader(
                self.schedule,
                self.rank,
                self._reader(self.path),
                self.input_key,
                self.target_keys,
                num_workers=self.num_workers,
                prefetch_factor=self.reads.prefetch_factor,
                trainer=lambda: self.trainer,
                batch_format=self.batch_format,
                read_window=self.resolved_read_window,
                read_ahead_bytes=self._read_ahead_bytes(),
                warm_rows=self._warm_rows() if self.cold_gap is not None else None,
                memory_sharers=self.trainer.num_devices if self.trainer is not None else 1,
            )
        if self._pending_position is not None:
            self.train_loader.load_state_dict(self._pending_position)
            self._pending_position = None
        return self.train_loader

    _pending_position: dict[str, Any] | None = None

    def _warm_rows(self) -> tuple[int, int]:
        """This rank's share of the training rows for the page-cache warmer: the node's ranks split them."""
        trainer = self.trainer
        local_rank, local_ranks = (trainer.local_rank, trainer.num_devices) if trainer is not None else (0, 1)
        sizes = even_split(self.num_train, local_ranks)
        lo = int(sum(sizes[:local_rank]))
        return lo, lo + int(sizes[local_rank])

    def _read_ahead_bytes(self) -> int:
        """This rank's share of the plan's read-ahead, in bytes."""
        assert self.read_plan is not None and self.info is not None
        share = even_split(self.read_plan.read_ahead_samples, self.world_size)[self.rank]
        return int(share) * self.info.sample_nbytes

    def _eval_loader(self, ids: np.ndarray, path: str) -> DataLoader:
        """This rank's even share of ``ids`` (in file order), in batches of ``val_batch_size``."""
        sizes = even_split(len(ids), self.world_size)
        lo = int(sizes[: self.rank].sum())
        shard = ids[lo : lo + int(sizes[self.rank])]
        batches = [shard[i : i + self.val_batch_size] for i in range(0, len(shard), self.val_batch_size)]
        dataset = BatchReader(
            self._reader(path), self.input_key, self.target_keys, batches=batches, batch_format=self.batch_format
        )
        # Evaluation reads run in the rank's own process: the held-out share is small, and forking short-lived
        # workers next to the persistent training readers hung under DDP (gloo) in our tests.
        # The share is this rank's already: a one-replica DistributedSampler (in order, no padding) keeps Lightning
        # from injecting its own, which would split the share again, with use_distributed_sampler=True (the default).
        sampler: DistributedSampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
        return DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=0, collate_fn=no_collate)

    @override
    def val_dataloader(self) -> DataLoader | list:
        self._require_setup()
        if self._val_ids is None:
            return []
        return self._eval_loader(self._val_ids, self.val_path or self.path)

    @override
    def test_dataloader(self) -> DataLoader:
        """The test split (``test_path`` / ``test_split``) if configured, else the validation split."""
        self._require_setup()
        if self._test_ids is not None:
            return self._eval_loader(self._test_ids, self.test_path or self.path)
        if self._val_ids is not None:
            return self._eval_loader(self._val_ids, self.val_path or self.path)
        raise ValueError(
            "SolarDataModule has no held-out data for trainer.test / trainer.predict: set test_path= or "
            "test_split= (or val_path= / val_split=, which they use when no test split is configured)"
        )

    @override
    def predict_dataloader(self) -> DataLoader:
        """The same samples as :meth:`test_dataloader`, in file order."""
        return self.test_dataloader()

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        """Configuration, schedule hash, position (epoch, step) of the training order, and the training data's
        fingerprint (see :func:`~lightning_sdp.datamodules.solar.reader.data_fingerprint`)."""
        if self.schedule is None:
            return {}
        position = (
            self.train_loader.state_dict()
            if self.train_loader is not None
            else {
                "epoch": 0,
                "step": 0,
                "sample": 0,
                "schedule_hash": self.schedule.schedule_hash,
                "order_hash": self.schedule.order_hash,
            }
        )
        assert self.read_plan is not None
        return {
            "config": self.schedule.config,
            "read_plan": _plan_state(self.read_plan),
            "schedule_hash": self.schedule.schedule_hash,
            "position": position,
            "data": {**(self._fingerprint or {}), "path": self.path},
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check that the checkpoint's schedule and training data are these, then continue from its position.

        The data are compared by content (sample count, per-sample shapes and dtypes, a hash of sampled rows), not by
        path, modification time or inode, so a copy of the file on another machine resumes and another file of the
        same length is refused.
        """
        if not state_dict:
            return
        if self.schedule is None:
            self._pending_state = state_dict
            return
        saved, current = state_dict.get("config", {}), self.schedule.config
        resized = any(saved.get(k) != current[k] for k in ("world_size", "local_batch_size"))
        if resized and self._elastic(state_dict):
            self._check_data(state_dict.get("data"))
            self._resume_position(state_dict["position"])
            return
        saved_plan = state_dict.get("read_plan")
        assert self.read_plan is not None  # set with the schedule in setup
        current_plan = _plan_state(self.read_plan)
        if saved_plan is not None and saved_plan != current_plan:
            # a checkpoint from before the working memory was planned counted it in the buffer
            saved_memory = sum(saved_plan.get(k, 0) for k in _MEMORY_KEYS)
            memory = sum(current_plan[k] for k in _MEMORY_KEYS)
            if saved_memory != memory:
                raise ValueError(
                    f"the checkpoint's SOLAR memory budget does not match this configuration (buffer_size: "
                    f"checkpoint {saved_memory} vs now {memory} samples, buffer, read-ahead and working memory "
                    "together). Resume with the same buffer_size, or start a new run."
                )
            # the same options, but the device measured differently: keep the checkpoint's plan and schedule
            self.read_plan = replace(self.read_plan, **saved_plan)
            self._build_schedule(self.read_plan)
        saved, current = state_dict.get("config", {}), self.schedule.config
        diff = {
            k: (saved.get(k), current.get(k))
            for k in sorted(set(saved) | set(current))
            if saved.get(k) != current.get(k)
        }
        if diff or state_dict.get("schedule_hash") != self.schedule.schedule_hash:
            detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items()) or "same options"
            raise ValueError(
                f"the checkpoint's SOLAR schedule does not match this configuration ({detail}; schedule hash "
                f"{state_dict.get('schedule_hash')} vs {self.schedule.schedule_hash}). Resume with the same data, "
                "batch size, world size, buffer size, seed and SOLAR options, or start a new run."
            )
        self._check_data(state_dict.get("data"))
        self._resume_position(state_dict["position"])

    def _resume_position(self, position: dict[str, Any]) -> None:
        if self.train_loader is not None:
            self.train_loader.load_state_dict(position)
        else:
            self._pending_position = position

    def _elastic(self, state_dict: dict[str, Any]) -> bool:
        """Whether a checkpoint of another world size or batch size can continue here: the same options otherwise
        and the same global sample order. Raises when only the order differs (another buffer size with
        ``epoch_order="tsp"``)."""
        assert self.schedule is not None
        saved, current = state_dict.get("config", {}), self.schedule.config
        if any(saved.get(k) != current[k] for k in current if k not in ELASTIC_KEYS):
            return False  # refused below, with the differences named
        position = state_dict["position"]
        if "sample" not in position or position.get("order_hash") != self.schedule.order_hash:
            raise ValueError(
                "the checkpoint's SOLAR run visited the samples in another order than this configuration would "
                f"(world size {saved.get('world_size')} -> {current['world_size']}, batch size "
                f"{saved.get('local_batch_size')} -> {current['local_batch_size']}), or was written by an older "
                "lightning-sdp, so it cannot continue at the same sample. Resume with the world size and batch "
                "size it was written with, or start a new run."
            )
        return True

    def _check_data(self, saved: dict[str, Any] | None) -> None:
        """Refuse a checkpoint written while training on other data (warn when it has no fingerprint)."""
        current = self._fingerprint or {}
        if not saved or "rows_sha256" not in saved:
            rank_zero_warn(
                "SolarDataModule: this checkpoint has no fingerprint of its training data (it was written by an "
                f"older lightning-sdp), so it cannot be checked against {self.path!r}; resuming as if it were the same "
                "file."
            )
            return
        diff = [
            f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}"
            for k in ("num_samples", "shapes", "dtypes", "rows_sha256")
            if saved.get(k) != current.get(k)
        ]
        if diff:
            raise ValueError(
                f"the checkpoint was written while training on other data than {self.path!r} (it trained on "
                f"{saved.get('path')!r}; {', '.join(diff)}): its position in the sample order would index other "
                "samples. Resume with the file the checkpoint was trained on (a copy is fine: the check compares "
                "sampled rows, not paths or times). To train these weights on the new data, start a new run from "
                "them: `Model.load_from_checkpoint(ckpt)` then `trainer.fit(model, datamodule)` without ckpt_path."
            )

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Add a hint to the errors that reading a batch in another format than ``batch_format`` raises."""
        if any("SolarDataModule" in n for n in getattr(exception, "__notes__", ())):
            return
        unpack = isinstance(exception, ValueError) and "values to unpack" in str(exception)
        if self.batch_format == "dict":
            index = isinstance(exception, KeyError) and bool(exception.args) and isinstance(exception.args[0], int)
            if unpack or index:
                _add_note(
                    exception,
                    "Hint: SolarDataModule(batch_format='dict') batches are dicts with keys 'input', 'target', "
                    "'index', 'loss_scale', so `x, y = batch` unpacks the keys and `batch[0]` is a missing key. Read "
                    "batch['input'] and batch['target'], or leave batch_format at its default 'pair' to get "
                    "(input, target).",
                )
            return
        by_name = isinstance(exception, TypeError) and "indices must be integers" in str(exception)
        if unpack or by_name:
            shape = (
                "(input, target)" + (" with the targets joined along dim 1" if len(self.target_keys) > 1 else "")
                if self.batch_format == "pair"
                else f"(input, {', '.join(self.target_keys)})"
            )
            _add_note(
                exception,
                f"Hint: SolarDataModule(batch_format={self.batch_format!r}) batches are tuples {shape}. "
                "batch_format='dict' gives {'input', 'target', 'index', 'loss_scale'} (read batch['input']), "
                "'pair' gives (input, target), 'tuple' gives (input, target_1, ..., target_k).",
            )

    @override
    def teardown(self, stage: str) -> None:
        if self.train_loader is not None and stage == "fit":
            self.train_loader.close()


ELASTIC_KEYS = ("world_size", "local_batch_size", "max_local_batch", "buffer_size")
"""Schedule options a checkpoint may differ in and still continue at the same sample (the buffer's share of
``buffer_size`` depends on the world size)."""


def _plan_state(plan: ReadPlan) -> dict[str, int]:
    """What of a read plan a resumed run must reuse: the schedule's buffer and the reader's window and gap."""
    return {
        "read_window": plan.read_window,
        "max_gap": plan.max_gap,
        "buffer_samples": plan.buffer_samples,
        "read_ahead_samples": plan.read_ahead_samples,
        "working_samples": plan.working_samples,
    }


_MEMORY_KEYS = ("buffer_samples", "read_ahead_samples", "working_samples")


def _add_note(exception: BaseException, note: str) -> None:
    """``exception.add_note(note)``, also on Python 3.10, which has no ``add_note``.

    Args:
        exception: the exception to annotate.
        note: the text to add to its ``__notes__``.
    """
    if sys.version_info >= (3, 11):
        exception.add_note(note)
    else:
        _add_note_py310(exception, note)


def _add_note_py310(exception: BaseException, note: str) -> None:
    # 3.10 neither has add_note nor prints __notes__: keep the note where 3.11+ and pytest look for it, and log
    # it so that the user sees it with the traceback.
    setattr(exception, "__notes__", [*getattr(exception, "__notes__", ()), note])  # noqa: B010
    _log.error("%s: %s", type(exception).__name__, note)


def per_sample_loss_scale(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The factor to multiply the *sum* of per-sample losses by (``P / G``; ``1 / B`` for plain batches)."""
    scale = batch.get("loss_scale")
    if scale is None:
        return torch.tensor(1.0 / max(len(batch["input"]), 1))
    return scale
