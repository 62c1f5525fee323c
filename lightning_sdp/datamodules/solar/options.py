"""``SolarReadOptions``: how ``SolarDataModule`` reads its training file (the read plan, threads, the page cache)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lightning_sdp._options import check_options
from lightning_sdp.datamodules.solar.readplan import StorageProfile


@dataclass(frozen=True)
class SolarReadOptions:
    """How the training file is read; the defaults choose everything for the device at ``setup``.

    Passed as ``SolarDataModule(..., reads=SolarReadOptions(read_window=1, max_gap=0))`` (YAML:
    ``reads: {read_window: 1, max_gap: 0}``). Construction checks every value: a wrong type raises ``TypeError``, a
    value out of range ``ValueError``, each naming the option.

    Args:
        read_window: steps whose reads are issued together as one sorted, coalesced request list (the plan knows
            them ahead). Larger windows give fewer, longer device requests (with ``max_gap``) at the cost of holding
            two windows of read samples, taken from the buffer's share of ``buffer_size``. Default ``"auto"``: the
            window and gap of least predicted device time per epoch
            (:func:`~lightning_sdp.datamodules.solar.readplan.plan_reads`), weighing bytes against requests with the
            device's measured bandwidth and request rate. ``read_window=1, max_gap=0`` reads exactly the planned
            misses (the fewest bytes) in more, shorter requests.
        max_gap: merge read runs separated by at most this many unrequested samples (read and dropped: one longer
            request instead of two). Default ``"auto"``: chosen with ``read_window`` for the device. 0: exact bytes.
        io_threads: threads per reader that issue a step's run reads concurrently (contiguous HDF5 layouts; chunked
            data uses h5py hyperslab reads one after another). Default 4.
        storage: the device, for the ``"auto"`` plan. ``"probe"`` (default): rank 0 times random reads of the
            training file at setup (about 1.5 s on a slow device; files under 8 MiB are assumed fast and not probed)
            and shares the result; or a :class:`~lightning_sdp.datamodules.solar.readplan.StorageProfile` (or a dict
            of its fields: ``bandwidth_bytes_per_s``, ``requests_per_s``, ``overlap``).
        readahead: let the kernel's readahead act on the training reads. Default False: reads are positional reads
            advised ``POSIX_FADV_RANDOM``, so the device serves the planned bytes only (with readahead the device
            read the whole file every epoch and the buffer saved nothing).
        warm_page_cache: when the plan's long runs count on the page cache (the file fits in free memory), each
            epoch a thread per rank streams its share of the node's file into the page cache in long requests, and
            each training read waits for the stream to pass its rows and copies them from memory (rows of other
            ranks' shares are read in the shorter runs a cold device pays for), so a cold cache (the first epoch, or
            a file the OS dropped) costs one stream of the file, not a request per run. Default ``"auto"``: on
            exactly then, when ``max_gap`` is ``"auto"``; ``True``: on for any plan with gaps; ``False``: off.
        prefetch_factor: read requests in flight per worker process (``num_workers > 0``). Default 2.
    """

    read_window: int | Literal["auto"] = "auto"
    max_gap: int | Literal["auto"] = "auto"
    io_threads: int = 4
    storage: Literal["probe"] | StorageProfile | dict[str, Any] = "probe"
    readahead: bool = False
    warm_page_cache: bool | Literal["auto"] = "auto"
    prefetch_factor: int = 2

    def __post_init__(self) -> None:
        check_options(self, "SolarReadOptions")
        for name, low, meaning in (
            ("read_window", 1, "steps"),
            ("max_gap", 0, "rows"),
            ("io_threads", 1, "1 reads one run after another"),
            ("prefetch_factor", 1, "read requests in flight per worker"),
        ):
            value = getattr(self, name)
            if value != "auto" and value < low:
                accepted = f"'auto' or an int >= {low}" if name in ("read_window", "max_gap") else f"an int >= {low}"
                raise ValueError(f"SolarReadOptions: {name} must be {accepted} ({meaning}), got {value}")
        if isinstance(self.storage, dict):
            object.__setattr__(self, "storage", StorageProfile(**self.storage))

    @property
    def fixed_window(self) -> int | None:
        """``read_window`` in steps, ``None`` for ``"auto"``."""
        return None if self.read_window == "auto" else int(self.read_window)

    @property
    def fixed_gap(self) -> int | None:
        """``max_gap`` in rows, ``None`` for ``"auto"``."""
        return None if self.max_gap == "auto" else int(self.max_gap)
