"""Runtime side of SOLAR: the per-rank loader that follows a :class:`SolarSchedule`.

Worker processes (a ``torch.utils.data.DataLoader`` with ``batch_size=None``) only read: each request is one step's
storage reads, served by :class:`~lightning_sdp.datamodules.solar.reader.HDF5Reader` with coalesced hyperslab reads.
The main process holds the buffered samples (the *store*), assembles every local batch from store and reads, and
applies the plan's inserts and evictions. Since the plan is known ahead, the workers read future steps while the
model trains (``prefetch_factor``).
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_sdp.datamodules.solar.prefetch import PageCacheWarmer, ReadAhead, ReadResult, return_free_memory
from lightning_sdp.datamodules.solar.reader import HDF5Reader
from lightning_sdp.datamodules.solar.readplan import anonymous_headroom
from lightning_sdp.datamodules.solar.schedule import SolarSchedule
from lightning_sdp.datamodules.solar.store import SampleStore, torch_dtype


def _same_requests(
    a: Sequence[tuple[tuple[int, int], np.ndarray]], b: Sequence[tuple[tuple[int, int], np.ndarray]]
) -> bool:
    """Whether two lists of ``(key, ids)`` read requests are the same requests in the same order."""
    return len(a) == len(b) and all(
        ka == kb and np.array_equal(ia, ib) for (ka, ia), (kb, ib) in zip(a, b, strict=True)
    )


def _align_lightning_step(trainer: Any, step: int) -> None:
    """Set the training loop's batch counters to ``step`` where a resume continues at another step than the loop
    restored: a checkpoint of another world size or batch size, whose step counted other global batches.

    Lightning ends an epoch when its counter reaches the loader's length, so after such a resume the counter must
    count this schedule's steps, or the epoch would end early (more ranks: fewer, larger steps) or late.
    """
    if trainer is None or not getattr(trainer, "training", False):
        return
    loop = trainer.fit_loop.epoch_loop
    current, total = loop.batch_progress.current, loop.batch_progress.total
    delta = step - current.ready
    if delta == 0:
        return
    for progress in (current, total):
        progress.ready += delta
        progress.started += delta
        progress.processed += delta
        progress.completed += delta
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        fetcher.fetched += delta


def no_collate(item: Any) -> Any:
    """``collate_fn`` for datasets whose items are whole batches already (``DataLoader(batch_size=None)``)."""
    return item


@dataclass
class StepStats:
    """This rank's loading counters for one training step of a :class:`SolarLoader`.

    Args:
        samples: samples in the local batch.
        hits: the plan's buffer hits (with a read window some arrive with a neighbour step's read instead).
        reads: the plan's misses, read from storage (``samples - hits``).
        storage_bytes: bytes read from storage for this step, measured (with ``max_gap`` the gap rows too; 0 for
            the later steps of a read window, whose bytes count on its first step).
        wait_s: seconds the training loop waited for the batch.
        read_s: seconds the reader spent on the step's read request (0 for the later steps of a read window).
        samples_per_s: local samples per second of wall time since the previous batch.
    """

    samples: int
    hits: int
    reads: int
    storage_bytes: int
    wait_s: float
    read_s: float
    samples_per_s: float

    @property
    def hit_rate(self) -> float:
        """Buffer hits / local batch (0 for an empty batch)."""
        return self.hits / self.samples if self.samples else 0.0

    def to_dict(self) -> dict[str, float]:
        """JSON-ready counters (keys ``samples``, ``hits``, ``hit_rate``, ``reads``, ``bytes``, ``wait_s``,
        ``read_s``, ``samples_per_s``)."""
        return {
            "samples": float(self.samples),
            "hits": float(self.hits),
            "hit_rate": self.hit_rate,
            "reads": float(self.reads),
            "bytes": float(self.storage_bytes),
            "wait_s": self.wait_s,
            "read_s": self.read_s,
            "samples_per_s": self.samples_per_s,
        }


@dataclass
class EpochStats:
    """This rank's loading counters summed over the steps of the current (or last) epoch of a :class:`SolarLoader`.

    Args:
        samples: samples yielded.
        hits: the plan's buffer hits.
        reads: the plan's misses (``samples - hits``).
        storage_bytes: bytes read from storage (measured; gap rows included).
        wait_s: seconds the training loop waited for batches.
        read_s: seconds the reader spent on read requests.
        steps: steps yielded.
        wall_s: wall seconds from the start of the epoch to the latest batch.
    """

    samples: int = 0
    hits: int = 0
    reads: int = 0
    storage_bytes: int = 0
    wait_s: float = 0.0
    read_s: float = 0.0
    steps: int = 0
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Buffer hits / samples (0 before the first step)."""
        return self.hits / self.samples if self.samples else 0.0

    @property
    def samples_per_s(self) -> float:
        """Samples per wall second of the epoch so far (0 before the first step)."""
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    def add(self, step: StepStats) -> None:
        """Count one step (``wall_s`` is set by the loader)."""
        self.samples += step.samples
        self.hits += step.hits
        self.reads += step.reads
        self.storage_bytes += step.storage_bytes
        self.wait_s += step.wait_s
        self.read_s += step.read_s
        self.steps += 1

    def to_dict(self) -> dict[str, float]:
        """JSON-ready counters (keys ``samples``, ``hits``, ``reads``, ``bytes``, ``wait_s``, ``read_s``,
        ``steps``, ``wall_s``)."""
        return {
            "samples": float(self.samples),
            "hits": float(self.hits),
            "reads": float(self.reads),
            "bytes": float(self.storage_bytes),
            "wait_s": self.wait_s,
            "read_s": self.read_s,
            "steps": float(self.steps),
            "wall_s": self.wall_s,
        }


BatchFormat = Literal["pair", "dict", "tuple"]
BATCH_FORMATS: tuple[str, ...] = ("pair", "dict", "tuple")
"""``"pair"``: ``(input, target)``; ``"dict"``: ``{"input", "target", "index", "loss_scale"}``; ``"tuple"``:
``(input, target_1, ..., target_k)``. See :func:`make_batch`."""


def assemble_targets(arrays: Sequence[torch.Tensor]) -> torch.Tensor:
    """One target array as it is; several ``(n, c_i, ...)`` arrays concatenated along dim 1.

    A single target keeps its per-sample shape (a ``(n,)`` label array stays ``(n,)``). When several are joined,
    a ``(n,)`` array counts as one channel.
    """
    if len(arrays) == 1:
        return arrays[0]
    return torch.cat([a.unsqueeze(1) if a.dim() == 1 else a for a in arrays], dim=1)


def check_choice(name: str, value: object, allowed: Sequence[str]) -> None:
    """Raise unless ``value`` is one of ``allowed``: ``TypeError`` for a non-string, else a ``ValueError`` that lists
    the allowed values (and the closest one).

    Args:
        name: the option, as the user spells it.
        value: what was given.
        allowed: the accepted strings.
    """
    if isinstance(value, str) and value in allowed:
        return
    options = ", ".join(map(repr, allowed))
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {options}, got {value!r} ({type(value).__name__}).")
    close = difflib.get_close_matches(value, list(allowed), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"{name} must be one of {options}, got {value!r}{hint}.")


def check_batch_format(batch_format: str) -> None:
    """Raise a ``ValueError`` naming the accepted values when ``batch_format`` is not one of them."""
    check_choice("batch_format", batch_format, BATCH_FORMATS)


def check_joinable_targets(
    shapes: dict[str, tuple[int, ...]], dtypes: dict[str, np.dtype], target_keys: Sequence[str], batch_format: str
) -> None:
    """Raise a ``ValueError`` when several targets cannot be joined into one tensor by :func:`assemble_targets`.

    ``"pair"`` and ``"dict"`` batches hold one ``target`` tensor: several target datasets are concatenated along
    dim 1, which needs one dtype and per-sample shapes that agree after their first axis (a ``(n,)`` array counts as
    one channel). ``"tuple"`` batches keep one tensor per dataset and need nothing.

    Args:
        shapes: per-sample shape of each dataset.
        dtypes: dtype of each dataset.
        target_keys: the target datasets, in order.
        batch_format: the batch format.
    """
    if batch_format == "tuple" or len(target_keys) < 2:
        return
    trailing = {k: tuple(shapes[k][1:]) for k in target_keys}
    kinds = {k: np.dtype(dtypes[k]).name for k in target_keys}
    if len(set(trailing.values())) == 1 and len(set(kinds.values())) == 1:
        return
    described = ", ".join(f"{k} {kinds[k]} {tuple(shapes[k])}" for k in target_keys)
    raise ValueError(
        f"SolarDataModule(batch_format={batch_format!r}) joins the targets into one tensor along dim 1, but they "
        f"(per sample: {described}) differ in dtype or in the dims after the first. Use batch_format='tuple' for "
        "(input, target_1, ..., target_k), one tensor per dataset, or give targets of one dtype and matching shapes."
    )


def make_batch(
    arrays: dict[str, torch.Tensor],
    input_key: str,
    target_keys: Sequence[str],
    ids: np.ndarray,
    loss_scale: float,
    batch_format: str = "dict",
) -> dict[str, torch.Tensor] | tuple[torch.Tensor, ...]:
    """Build one batch from per-dataset arrays.

    Args:
        arrays: ``{dataset name: (n, *sample_shape) tensor}`` for ``input_key`` and every target key.
        input_key: dataset name of the inputs.
        target_keys: dataset names of the targets.
        ids: the ``n`` sample ids.
        loss_scale: the factor for the sum of per-sample losses.
        batch_format: ``"pair"``: ``(input, target)``, the targets joined by :func:`assemble_targets` (the same
            tensors as a dict batch's ``input`` and ``target``); ``"dict"``: ``{"input", "target", "index",
            "loss_scale"}``; ``"tuple"``: ``(input, target_1, ..., target_k)``, each dataset with its own per-sample
            shape, in the configured key order. Default ``"dict"``.
    """
    if batch_format == "pair":
        return arrays[input_key], assemble_targets([arrays[k] for k in target_keys])
    if batch_format == "tuple":
        return tuple(arrays[k] for k in (input_key, *target_keys))
    return {
        "input": arrays[input_key],
        "target": assemble_targets([arrays[k] for k in target_keys]),
        "index": torch.from_numpy(np.asarray(ids, dtype=np.int64).copy()),
        "loss_scale": torch.tensor(loss_scale, dtype=torch.float32),
    }


class ReadRequests(Dataset):
    """Map-style dataset whose "index" is a read request ``(tag, ids)``; returns the rows and I/O counters.

    Args:
        reader: the HDF5 reader (pickled into each worker; it opens the file lazily there).
    """

    def __init__(self, reader: HDF5Reader) -> None:
        self.reader = reader

    def __getitem__(self, request: tuple[int, np.ndarray]) -> dict[str, Any]:
        tag, ids = request
        start, before = time.perf_counter(), self.reader.bytes_read
        rows = self.reader.read(ids)
        return {
            "tag": tag,
            "ids": ids,
            "data": {k: torch.from_numpy(v) for k, v in rows.items()},
            "bytes": self.reader.bytes_read - before,
            "seconds": time.perf_counter() - start,
        }

    def __len__(self) -> int:  # requests come from the sampler; the length is not used
        return 0


class _RequestSampler(Sampler):
    """Yields the read requests set for the coming epoch (mutable, so persistent workers can be kept)."""

    def __init__(self) -> None:
        self.requests: list[tuple[int, np.ndarray]] = []

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        return iter(self.requests)

    def __len__(self) -> int:
        return len(self.requests)


class BatchReader(Dataset):
    """Map-style dataset whose index is an array of sample ids; returns a ready batch (validation, baselines).

    Args:
        reader: the HDF5 reader.
        input_key: dataset name of the inputs.
        target_keys: dataset names of the targets (concatenated along dim 1 in dict batches).
        batches: the id arrays, one per batch; ``len`` is their number and ``__getitem__(int)`` reads one.
        batch_format: ``"pair"``, ``"dict"`` or ``"tuple"`` (see :func:`make_batch`). Default ``"dict"``.
    """

    def __init__(
        self,
        reader: HDF5Reader,
        input_key: str,
        target_keys: Sequence[str],
        batches: Sequence[np.ndarray] = (),
        batch_format: BatchFormat = "dict",
    ) -> None:
        check_batch_format(batch_format)
        self.reader, self.input_key, self.target_keys = reader, input_key, list(target_keys)
        self.batches = list(batches)
        self.batch_format = batch_format

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, item: int | np.ndarray) -> dict[str, torch.Tensor] | tuple[torch.Tensor, ...]:
        ids = self.batches[item] if isinstance(item, (int, np.integer)) else np.asarray(item)
        rows = self.reader.read(ids)
        arrays = {k: torch.from_numpy(v) for k, v in rows.items()}
        loss_scale = 1.0 / max(len(ids), 1)
        return make_batch(arrays, self.input_key, self.target_keys, ids, loss_scale, self.batch_format)


class SolarLoader:
    """The training iterable of one rank: yields ``{"input", "target", "index", "loss_scale"}`` batches.

    With ``batch_format="pair"`` it yields ``(input, target)`` and with ``"tuple"`` ``(input, target_1, ...,
    target_k)`` instead (no ids, no loss scale). The default here is ``"dict"`` (benchmarks and tools built on the
    loader read the ids); :class:`~lightning_sdp.datamodules.solar.SolarDataModule` defaults to ``"pair"``.

    Implements ``state_dict``/``load_state_dict`` so Lightning treats it as resumable; it resumes at any step of
    any epoch with the identical remaining sequence (samples the plan expects buffered are re-read once).

    ``last_stats`` (:class:`StepStats`, ``None`` before the first batch) and ``epoch_stats`` (:class:`EpochStats`)
    hold this rank's loading counters; :class:`lightning_sdp.callbacks.SolarMetrics` logs them.

    Args:
        schedule: the shared schedule.
        rank: this rank.
        reader: reader of the training file (keys ``input_key`` + ``target_keys``).
        input_key: dataset name of the inputs.
        target_keys: dataset names of the targets.
        num_workers: reader processes (0: read in the main process). Default 0.
        prefetch_factor: read requests in flight per worker. Default 2.
        trainer: callable returning the attached Trainer (or ``None``), for the epoch and the resume position.
        batch_format: ``"pair"``, ``"dict"`` or ``"tuple"`` (see :func:`make_batch`). Default ``"dict"``.
        read_window: steps whose reads are issued as one request list (sorted, coalesced over all of them). The
            plan knows every step's reads, so merging ``W`` steps gives longer runs and fewer device requests, at
            the cost of holding up to ``W`` steps of read samples (times ``prefetch_factor`` per worker). Default 1.
        read_ahead_bytes: with ``num_workers=0``, a background thread reads the coming windows, into the next epoch,
            while at most this many bytes of read samples are held (the window being trained on included; one
            window is always allowed). ``None``: two windows of ``W * batch`` samples. Default ``None``.
        read_across_epochs: the read-ahead thread goes on into the next epoch's first windows (through the end of
            the epoch and validation). ``False`` stops at the epoch's end (a loading-only benchmark that measures
            epochs one by one). Default ``True``.
        warm_rows: ``(lo, hi)``: with ``num_workers=0``, at the start of every epoch a
            :class:`~lightning_sdp.datamodules.solar.prefetch.PageCacheWarmer` streams rows ``lo..hi-1`` of the file
            into the page cache in long requests, so the reader's short runs mostly copy from memory. Default
            ``None``: no warming.
        memory_sharers: processes on this machine reading ahead (a node's ranks): a read beyond the first window
            waits until that many reads of its size fit in what the memory (its cgroup's cap, page cache left
            out) can still give. Default 1.
    """

    def __init__(
        self,
        schedule: SolarSchedule,
        rank: int,
        reader: HDF5Reader,
        input_key: str,
        target_keys: Sequence[str],
        num_workers: int = 0,
        prefetch_factor: int = 2,
        trainer: Callable[[], Any] | None = None,
        batch_format: BatchFormat = "dict",
        read_window: int = 1,
        read_ahead_bytes: int | None = None,
        read_across_epochs: bool = True,
        warm_rows: tuple[int, int] | None = None,
        memory_sharers: int = 1,
    ) -> None:
        check_batch_format(batch_format)
        if read_window < 1:
            raise ValueError(f"read_window must be >= 1 step, got {read_window}")
        self.read_window = int(read_window)
        if not 0 <= rank < schedule.world_size:
            raise ValueError(f"rank {rank} is outside 0..{schedule.world_size - 1}")
        self.schedule, self.rank, self.reader = schedule, rank, reader
        self.input_key, self.target_keys = input_key, list(target_keys)
        self.num_workers, self.prefetch_factor = int(num_workers), int(prefetch_factor)
        self.batch_format = batch_format
        self._trainer = trainer or (lambda: None)
        info = reader.info
        keys = [input_key, *self.target_keys]
        self.store = SampleStore(
            {k: info.shapes[k] for k in keys}, {k: info.dtypes[k] for k in keys}, int(schedule.rank_capacity[rank])
        )
        self._sampler = _RequestSampler()
        self._loader: DataLoader | None = None
        self._next_pos = (0, 0)
        self._epoch_counter = 0
        self._resume: tuple[int, int] | None = None
        self._last_yield: float | None = None
        self.last_stats: StepStats | None = None
        self.epoch_stats = EpochStats()
        window_bytes = self.read_window * schedule.local_batch_size * reader.info.sample_nbytes
        self.read_ahead_bytes = int(read_ahead_bytes) if read_ahead_bytes is not None else 2 * window_bytes
        self._read_ahead: ReadAhead | None = None
        self.read_across_epochs = bool(read_across_epochs)
        self.warm_rows = warm_rows
        self.memory_sharers = int(memory_sharers)
        self._warmer: PageCacheWarmer | None = None

    def __len__(self) -> int:
        return self.schedule.steps_per_epoch

    # ------------------------------------------------------------------ state
    def position(self) -> tuple[int, int]:
        """``(epoch, step)`` of the next batch the training loop has not processed yet."""
        trainer = self._trainer()
        if trainer is not None and getattr(trainer, "training", False):
            epoch = int(trainer.current_epoch)
            processed = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
            if processed >= self.schedule.steps_per_epoch:  # saved on the epoch's last batch: the next one is due
                return epoch + 1, 0
            return epoch, processed
        return self._next_pos

    def state_dict(self) -> dict[str, Any]:
        """Position (epoch, step, and the samples of the epoch's order already trained on) and the schedule's hashes
        (the buffer content is not saved; it is re-read on resume)."""
        epoch, step = self._resume if self._resume is not None else self.position()
        return {
            "epoch": epoch,
            "step": step,
            "sample": self.schedule.step_start(epoch, step),
            "schedule_hash": self.schedule.schedule_hash,
            "order_hash": self.schedule.order_hash,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state``'s position at the next ``iter``.

        A position saved by a schedule of another world size or batch size (the same global sample order, see
        :attr:`SolarSchedule.order_hash`) continues at the same sample of the epoch's order.
        """
        epoch = int(state["epoch"])
        if state.get("schedule_hash") == self.schedule.schedule_hash:
            step = int(state["step"])
            if "sample" in state:  # the schedule may have to start the epoch mid-step, as when it was saved
                step = self.schedule.resume_at(epoch, int(state["sample"]))
        elif "sample" in state and state.get("order_hash") == self.schedule.order_hash:
            step = self.schedule.resume_at(epoch, int(state["sample"]))
        else:
            raise ValueError(
                "this checkpoint's SOLAR schedule does not match the current configuration (schedule hash "
                f"{state.get('schedule_hash')} != {self.schedule.schedule_hash}); resume with the same data, "
                "seed and SOLAR options"
            )
        self._resume = (epoch, step)
        self._epoch_counter = epoch

    def set_epoch(self, epoch: int) -> None:
        """Epoch of the next ``iter`` when no Trainer is attached."""
        self._epoch_counter = int(epoch)

    # ------------------------------------------------------------------ iteration
    def _dataloader(self) -> DataLoader:
        if self._loader is None:
            extra: dict[str, Any] = {}
            if self.num_workers > 0:
                extra = {"prefetch_factor": self.prefetch_factor, "persistent_workers": True}
            self._loader = DataLoader(
                ReadRequests(self.reader),
                sampler=self._sampler,
                batch_size=None,
                num_workers=self.num_workers,
                collate_fn=no_collate,
                **extra,
            )
        return self._loader

    def __iter__(self) -> Iterator[dict[str, torch.Tensor] | tuple[torch.Tensor, ...]]:
        return self._epoch_batches()

    def _epoch_batches(self) -> Iterator[dict[str, torch.Tensor] | tuple[torch.Tensor, ...]]:
        # The epoch is read at the first batch, not at iter(): Lightning calls iter() before it restores the loop's
        # epoch counter from a checkpoint (one saved on an epoch's last batch continues with the next epoch).
        epoch, start = self._start()
        _align_lightning_step(self._trainer(), start)
        yield from self._generate(epoch, start)

    def _start(self) -> tuple[int, int]:
        """The ``(epoch, step)`` this iteration starts at; clears the store when it does not continue the last."""
        # an HDF5 file rewritten between epochs would be read at its old offsets: refuse it here, in the main process
        # (the reader checks again before each of its reads, in whichever process reads)
        self.reader.check_unchanged()
        trainer = self._trainer()
        epoch = int(trainer.current_epoch) if trainer is not None else self._epoch_counter
        start = 0
        if self._resume is not None and self._resume[0] == epoch:
            start = self._resume[1]
        self._resume = None
        if (epoch, start) != self._next_pos:
            self.store.clear()  # the store no longer matches the plan: rebuild it from reads
        return epoch, start

    def _requests(self, steps: list, have: set[int]) -> tuple[list[tuple[int, np.ndarray]], set[int]]:
        """Per step: the plan's misses plus the planned hits the store lacks (after a resume); and the ids the
        store holds after these steps, given that it holds ``have`` before them."""
        have = set(have)
        requests = []
        for sp in steps:
            rs = sp.ranks[self.rank]
            hits = rs.indices[rs.hit]
            refill = [x for x in hits.tolist() if x not in have]
            reads = np.concatenate([rs.reads, np.asarray(refill, dtype=np.int64)])
            have.update(refill)
            have.difference_update(rs.evicts.tolist())
            have.update(rs.inserts.tolist())
            requests.append((sp.step, reads))
        return requests, have

    def _windows(self, per_step: list[tuple[int, np.ndarray]]) -> list[tuple[int, np.ndarray]]:
        """``(first step, ids)`` per read window: ``read_window`` steps' reads joined into one request, in ascending
        id order (the reader then returns its rows as read, without a reordered copy of the window)."""
        w = self.read_window
        return [
            (per_step[i][0], np.unique(np.concatenate([r for _, r in per_step[i : i + w]])))
            for i in range(0, len(per_step), w)
        ]

    def _read_for_thread(self, key: tuple[int, int], ids: np.ndarray) -> tuple[dict[str, torch.Tensor], int]:
        if self._warmer is not None and len(ids):  # the rows come from the page cache once the stream passed them
            self._warmer.wait_streamed(int(ids.max()))
        item = ReadRequests(self.reader)[(key[1], ids)]  # the same read a worker process does
        return item["data"], item["bytes"]

    def _thread_results(
        self, epoch: int, windows: list[tuple[int, np.ndarray]], store_after: set[int]
    ) -> Iterator[dict[str, Any]]:
        """This epoch's window results from the read-ahead thread, which then reads on into the next epoch.

        Args:
            epoch: the epoch.
            windows: its read windows.
            store_after: the ids the store will hold at the end of the epoch (the next epoch's reads refill the
                planned hits it lacks, after a resume).
        """
        if self._read_ahead is None:
            sample_nbytes = self.reader.info.sample_nbytes
            self._read_ahead = ReadAhead(
                self._read_for_thread, sample_nbytes, self.read_ahead_bytes, anonymous_headroom, self.memory_sharers
            )
        ra = self._read_ahead
        wanted = [((epoch, step), ids) for step, ids in windows]
        if not _same_requests(ra.queued(), wanted):  # not what was queued (first epoch, resume, a jump)
            ra.reset()
            for key, ids in wanted:
                ra.submit(key, ids)
        if self.read_across_epochs and epoch + 1 < self.schedule.num_epochs:
            requests, _ = self._requests(self.schedule.epoch_plan(epoch + 1), store_after)
            for step, ids in self._windows(requests):
                ra.submit((epoch + 1, step), ids)
        for _ in windows:
            # yielded without a name in this frame: the consumer alone keeps the window, so it is freed once trained on
            yield self._window_item(ra.get())

    def _window_item(self, res: ReadResult) -> dict[str, Any]:
        # a window read before the file changed holds the old samples; refuse the change at once all the same
        self.reader.check_unchanged()
        return {
            "tag": res.key[1],
            "ids": res.ids,
            "data": res.data,
            "bytes": res.nbytes,
            "seconds": res.seconds,
            "result": res,
        }

    def _generate(self, epoch: int, start: int) -> Iterator[dict[str, torch.Tensor] | tuple[torch.Tensor, ...]]:
        plan = self.schedule.epoch_plan(epoch)
        self.schedule.release(epoch)
        steps = [sp for sp in plan if sp.step >= start]
        requests, store_after = self._requests(steps, set(self.store))
        windows = self._windows(requests)
        self.epoch_stats = EpochStats()
        epoch_start = time.perf_counter()
        if not steps:
            return
        w = self.read_window
        if self.num_workers == 0:
            self._warm()
            results: Iterator[dict[str, Any]] = self._thread_results(epoch, windows, store_after)
        else:
            self._sampler.requests = windows
            results = iter(self._dataloader())
        self._last_yield = None
        shapes = self.reader.info.shapes
        dtypes = {key: torch_dtype(self.reader.info.dtypes[key]) for key in (self.input_key, *self.target_keys)}
        res: dict[str, Any] = {}
        read_pos: dict[int, int] = {}
        for i, sp in enumerate(steps):
            rs = sp.ranks[self.rank]
            t0 = time.perf_counter()
            fresh = i % w == 0
            window_done = (i + 1) % w == 0 or i + 1 == len(steps)
            if fresh:
                res = next(results)
                if res["tag"] != sp.step:
                    raise RuntimeError(f"SOLAR loader out of order: expected step {sp.step}, got {res['tag']}")
                read_pos = {x: k for k, x in enumerate(res["ids"].tolist())}
            ids = rs.indices
            n = len(ids)
            out = {}
            for key in (self.input_key, *self.target_keys):
                arr = torch.empty((n, *shapes[key]), dtype=dtypes[key])
                from_read = [(row, read_pos[x]) for row, x in enumerate(ids.tolist()) if x in read_pos]
                if from_read:
                    dst, src = zip(*from_read, strict=False)
                    arr[list(dst)] = res["data"][key][list(src)]
                for row, x in enumerate(ids.tolist()):
                    if x not in read_pos:
                        arr[row] = self.store.get(x, key)
                out[key] = arr
            # the plan's inserts, and the planned hits read back after a resume unless the plan evicts them now
            evicts = set(rs.evicts.tolist())
            for x in evicts:
                self.store.pop(x)
            keep = set(rs.inserts.tolist()) | {x for x in ids[rs.hit].tolist() if x in read_pos and x not in evicts}
            for x in keep:
                k = read_pos[x]
                self.store.put(x, {key: res["data"][key][k] for key in out})
            wait = time.perf_counter() - t0
            now = time.perf_counter()
            step_time = now - self._last_yield if self._last_yield is not None else wait
            # the plan's buffer hits: with a read window a planned hit may arrive with a neighbour step's read
            # (it was read anyway), so counting what came from the store would understate the buffer
            n_hits = int(np.count_nonzero(rs.hit))
            self.last_stats = StepStats(
                samples=n,
                hits=n_hits,
                reads=n - n_hits,
                storage_bytes=int(res["bytes"]) if fresh else 0,
                wait_s=wait,
                read_s=float(res["seconds"]) if fresh else 0.0,
                samples_per_s=n / step_time if step_time > 0 else 0.0,
            )
            self.epoch_stats.add(self.last_stats)
            self.epoch_stats.wall_s = time.perf_counter() - epoch_start
            last = sp.step + 1 == self.schedule.steps_per_epoch
            self._next_pos = (epoch + 1, 0) if last else (epoch, sp.step + 1)
            if last:
                self._epoch_counter = epoch + 1
            batch = make_batch(out, self.input_key, self.target_keys, ids, sp.loss_scale, self.batch_format)
            if window_done:  # the window is trained on: free its rows before the read-ahead reads into them
                done, res = res.get("result"), {}
                self._release(done)
            self._last_yield = time.perf_counter()
            yield batch

    def _release(self, done: ReadResult | None) -> None:
        """Drop a trained-on window's rows, then give its bytes back to the read-ahead (otherwise three windows are
        alive where the plan counts two: this one, the next, and the one read into the freed budget)."""
        if done is not None:
            done.data = {}
            if self._read_ahead is not None:
                self._read_ahead.release(done)
        return_free_memory()

    def _warm(self) -> None:
        """Start this epoch's pass of the page-cache warmer (made on first use; positional reads of a plain file):
        it streams the rank's share of the file, and the read-ahead reads each window once the stream has passed
        its rows (:meth:`PageCacheWarmer.wait_streamed`), from the page cache."""
        if self.warm_rows is None:
            return
        layout = self.reader.direct_layout()
        if self._warmer is None:
            if layout is None:
                self.warm_rows = None  # chunked, filtered or linked datasets: nothing to stream
                return
            reader = self.reader
            self._warmer = PageCacheWarmer(
                reader.path, layout, *self.warm_rows, yield_to=lambda: reader.reads_in_flight > 0
            )
        self._warmer.start_pass()

    @property
    def peak_read_ahead_bytes(self) -> int:
        """Most bytes of read samples the read-ahead thread held at once (0 without it)."""
        return self._read_ahead.peak_held_bytes if self._read_ahead is not None else 0

    @property
    def memory_waits(self) -> int:
        """Reads the read-ahead thread held back because the memory had no room for them (0 without it)."""
        return self._read_ahead.memory_waits if self._read_ahead is not None else 0

    def close(self) -> None:
        """Stop worker processes and the read-ahead thread, and drop the store."""
        self._loader = None
        if self._read_ahead is not None:
            self._read_ahead.close()
            self._read_ahead = None
        if self._warmer is not None:
            self._warmer.close()
            self._warmer = None
        self.store.clear()
