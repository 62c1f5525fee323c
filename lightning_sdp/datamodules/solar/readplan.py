"""A read plan that knows the device: how many steps to read at once and which gaps to read through.

A storage request costs a fixed time on top of its bytes (a seek, a network round trip, a token of a read-IOPS
limit), so merging two runs of wanted rows into one request that also reads the rows between them pays when those
rows cost less than a request. How many rows lie between two wanted rows depends on how many steps' reads are
sorted together (the read window): the misses of ``W`` steps are a random subset of the file, denser as ``W``
grows. A larger window holds more read samples in memory, and under one memory budget that memory is taken from
the buffer, whose hit rate falls. :func:`plan_reads` weighs the three with a device's measured bandwidth and
request rate (:func:`probe_storage`) and picks the window and gap of the least predicted device time per epoch.

The prediction assumes what the schedule guarantees: a uniformly random permutation per epoch, a buffer at its hit
rate bound (buffer / samples), and with ``balance`` each rank reading a contiguous slice of every step's sorted misses.
Where the file fits in the memory left free (:func:`page_cache_holds`), a row read twice in an epoch is counted
once: the OS page cache serves the second read.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_sdp.datamodules.solar.reader import GAP_PIECE_BYTES

READ_AHEAD_WINDOWS = 2
"""Windows a rank holds besides its buffer: the one being trained on and the one being read."""
LOADER_FIXED_BYTES = 4 * 2**20
"""Memory a rank's loader holds whatever its plan: its threads' stacks and heaps, file handles, the page-cache
warmer's scratch."""
BATCHES_IN_FLIGHT = 3
"""Local batches alive beside the read-ahead's windows: the one being assembled, its gather's copy of the window's
rows, and the one the model trains on."""
WINDOW_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
GAP_CANDIDATES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
SPLIT_REQUEST_BYTES = 2**20
"""A longer read reaches the device as several requests of about this size (the block layer's request limit)."""
EQUAL_WITHIN = 0.02
EQUAL_WITHIN_S = 0.05
"""Plans within 2% or 50 ms per epoch of the fastest count as equally fast; the one holding less memory wins."""


@dataclass(frozen=True)
class StorageProfile:
    """What one device (or file system) delivers to the readers of one node.

    Args:
        bandwidth_bytes_per_s: bytes per second of large reads.
        requests_per_s: small random reads per second, issued as concurrently as the reader does (``io_threads``).
        overlap: how a request's fixed cost and its transfer combine: 1 (a disk: seek, then transfer) adds them,
            0 (a device with separate byte and request limits, e.g. a cgroup or cloud volume with an IOPS cap)
            takes the larger. Default 1.
        source: how it was obtained (``"probe"``, ``"default"``, ``"user"``), for logs.
    """

    bandwidth_bytes_per_s: float
    requests_per_s: float
    overlap: float = 1.0
    source: str = "user"

    def __post_init__(self) -> None:
        for name in ("bandwidth_bytes_per_s", "requests_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"StorageProfile.{name} must be a positive number, got {value!r}")
        if not (isinstance(self.overlap, (int, float)) and 0.0 <= self.overlap <= 1.0):
            raise ValueError(f"StorageProfile.overlap must be in [0, 1], got {self.overlap!r}")

    def seconds(self, nbytes: float, requests: float) -> float:
        """Predicted device seconds for ``requests`` reads of ``nbytes`` in total."""
        transfer, fixed = nbytes / self.bandwidth_bytes_per_s, requests / self.requests_per_s
        return max(transfer, fixed) + self.overlap * min(transfer, fixed)

    def describe(self) -> str:
        """``"412 MB/s, 3,900 requests/s, overlap 0.1 (probe)"``."""
        return (
            f"{self.bandwidth_bytes_per_s / 1e6:.0f} MB/s, {self.requests_per_s:,.0f} requests/s, overlap "
            f"{self.overlap:.2f} ({self.source})"
        )


FAST_LOCAL_STORAGE = StorageProfile(2e9, 50_000.0, 1.0, "default")
"""Assumed when a file is too small to probe (it is served from the page cache after the first epoch anyway)."""
PROBE_MIN_FILE_BYTES = 8 * 2**20
_PROBED: dict[tuple[int, int], StorageProfile] = {}
_PROBE_LOCK = threading.Lock()


def probe_storage(path: str | os.PathLike, io_threads: int = 4, seed: int = 0) -> StorageProfile:
    """Measure a file's device: small random reads per second and large-read bandwidth, at ``io_threads`` at once.

    The file's cached pages are dropped first (``POSIX_FADV_DONTNEED``) and reads are advised random, so the reads
    reach the device. It times pages, 64 KiB reads and 1 MiB reads at random offsets (:func:`profile_reads`), each
    kind for :data:`PROBE_PHASE_S` after :data:`PROBE_WARM_S` of untimed reads (a throttled device lets a burst
    through first) or until its region of the file runs out: about two seconds on a slow device, less on a fast one.
    The medium reads tell how a request's fixed cost and its transfer combine (``overlap``). Results are kept per file
    system for the life of the process. A file under 8 MiB is not probed (:data:`FAST_LOCAL_STORAGE`).

    Args:
        path: a file on the device (e.g. the training file).
        io_threads: reads in flight at once, as the reader will issue them.
        seed: seed of the probe's random offsets.
    """
    st = os.stat(path)
    key = (int(st.st_dev), int(io_threads))
    with _PROBE_LOCK:
        if key in _PROBED:
            return _PROBED[key]
        if st.st_size < PROBE_MIN_FILE_BYTES or not hasattr(os, "posix_fadvise"):
            return FAST_LOCAL_STORAGE
        profile = _probe(os.fspath(path), int(st.st_size), max(1, int(io_threads)), seed)
        _PROBED[key] = profile
        return profile


PROBE_PHASE_S = 0.4
"""Seconds each kind of probe read is timed for (after its untimed burst), unless its region runs out first."""
PROBE_WARM_S = 0.15
"""Seconds of untimed reads before each kind is timed: longer than a cgroup's throttle slice (0.1 s), whose
budget a throttled device serves at once."""


def _probe(path: str, size: int, threads: int, seed: int) -> StorageProfile:
    """:func:`profile_reads` of positional reads of ``path``, its cached pages dropped before and after."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

        def read(offset: int, length: int) -> int:
            return len(os.pread(fd, length, offset))

        profile = profile_reads(read, size, threads=threads, seed=seed)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return profile


def profile_reads(
    read: Callable[[int, int], int],
    size: int,
    *,
    threads: int = 4,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> StorageProfile:
    """The :class:`StorageProfile` of a device from timed reads at random offsets of a file of ``size`` bytes.

    Pages, 64 KiB reads and 1 MiB reads, each in its own region of the file (large: the first half; medium: the
    third quarter; small: the last quarter) and at offsets drawn without repeats, so that no read is served from pages
    another one brought in. Each kind is read untimed for :data:`PROBE_WARM_S` first (a throttled device serves a
    burst at once), then timed for :data:`PROBE_PHASE_S`; the untimed reads stop at half of the kind's offsets at
    most, the timed ones when the offsets run out.

    Args:
        read: ``read(offset, length)`` reads from the device and returns the bytes read.
        size: the file's size in bytes.
        threads: reads in flight at once.
        seed: seed of the random offsets.
        clock: seconds (``time.perf_counter``; a test passes the clock of a simulated device).
    """
    rng = random.Random(seed)
    page = 4096
    quarter = size // 4 // page
    kinds = {
        "small": (page, 3 * quarter, 4 * quarter),
        "mid": (64 * 1024, 2 * quarter, 3 * quarter),
        "big": (2**20, 0, 2 * quarter),
    }
    seconds, nbytes, counts = {}, {}, {}
    batch = 4 * threads

    def read_all(jobs: list[tuple[int, int]]) -> int:
        return sum(pool.map(lambda job: read(*job), jobs))

    with ThreadPoolExecutor(threads) as pool:
        for name, (length, lo, hi) in kinds.items():
            slots = range(lo, hi - length // page, length // page)
            jobs = [(k * page, length) for k in rng.sample(slots, min(len(slots), 4096))]
            # a throttled device lets a burst through first (a cgroup's throttle slice of bytes and requests):
            # reads are untimed until PROBE_WARM_S has passed, not for a count of reads, which on a fast burst
            # would time the burst itself (bandwidths of GB/s measured on a 40 MB/s device)
            warm, w0, half = 0, clock(), len(jobs) // 2
            while warm < half and (warm < 2 or clock() - w0 < PROBE_WARM_S):
                read_all(jobs[warm : min(warm + batch, half)])
                warm = min(warm + batch, half)
            done, total, t0 = warm, 0, clock()
            while done < len(jobs) and (done == warm or clock() - t0 < PROBE_PHASE_S):
                total += read_all(jobs[done : done + batch])
                done += len(jobs[done : done + batch])
            seconds[name] = max(clock() - t0, 1e-6)
            nbytes[name], counts[name] = total, done - warm
    rate = counts["small"] / seconds["small"]
    # 1 MiB reads are bound by the transfer (their fixed cost, where it adds, makes the bandwidth conservative)
    bandwidth = nbytes["big"] / seconds["big"]
    transfer, fixed = nbytes["mid"] / bandwidth, counts["mid"] / rate
    overlap = (seconds["mid"] - max(transfer, fixed)) / max(min(transfer, fixed), 1e-9)
    return StorageProfile(bandwidth, rate, float(min(1.0, max(0.0, overlap))), "probe")


def memory_cgroup_limits(
    proc_cgroup: str | os.PathLike = "/proc/self/cgroup", sysfs: str | os.PathLike = "/sys/fs/cgroup"
) -> list[tuple[Path, Path]]:
    """``(limit file, usage file)`` of this process's memory cgroup and of each of its ancestors, v1 or v2.

    A cap on any ancestor caps this process too, so all are returned (those that exist; in a container the path in
    ``/proc/self/cgroup`` may lie above the mounted hierarchy, whose root is then the process's own group).

    Args:
        proc_cgroup: the process's cgroup membership file.
        sysfs: where the cgroup hierarchies are mounted.
    """
    sysfs = Path(sysfs)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = []
    found: list[tuple[Path, Path]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, relative = parts
        if controllers == "":
            root, names = sysfs, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            root, names = sysfs / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        group = Path(relative.strip() or "/")
        for level in (group, *group.parents):
            directory = root / level.relative_to("/")
            limit = directory / names[0]
            if limit.exists() and (limit, directory / names[1]) not in found:
                found.append((limit, directory / names[1]))
    return found


def available_memory(
    proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
    sysfs: str | os.PathLike = "/sys/fs/cgroup",
    meminfo: str | os.PathLike = "/proc/meminfo",
) -> int:
    """Bytes this process's memory cgroups (v1 or v2, its own group and every ancestor: page cache counts against
    their caps) and the machine (``MemAvailable``) leave free, the inactive page cache counted as free; 0: unknown.

    Args:
        proc_cgroup: the process's cgroup membership file.
        sysfs: where the cgroup hierarchies are mounted.
        meminfo: the kernel's memory summary.
    """
    free = _mem_available(meminfo)
    for limit, usage, cap in _capped_groups(proc_cgroup, sysfs):
        with contextlib.suppress(OSError, ValueError):
            # the group's working set: its usage less the inactive page cache, which the kernel reclaims first
            # (files read once, e.g. at import); the same estimate container runtimes use
            working = int(usage.read_text().strip()) - _inactive_file(limit.parent / "memory.stat")
            free.append(max(0, cap - working))
    return min(free) if free else 0


def anonymous_headroom(
    proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
    sysfs: str | os.PathLike = "/sys/fs/cgroup",
    meminfo: str | os.PathLike = "/proc/meminfo",
) -> int | None:
    """Bytes this process's memory can still give to new allocations before the kernel runs out of page cache to
    reclaim: every capped memory cgroup's cap less its anonymous memory (v1 ``total_rss``, v2 ``anon``), and the
    machine's ``MemAvailable``; ``None``: unknown.

    The page cache counts against a cgroup's cap but is reclaimed before anything is killed, so it is left out here,
    unlike :func:`available_memory` (which decides whether the cache can hold a file).

    Args:
        proc_cgroup: the process's cgroup membership file.
        sysfs: where the cgroup hierarchies are mounted.
        meminfo: the kernel's memory summary.
    """
    room = _mem_available(meminfo)
    for limit, _, cap in _capped_groups(proc_cgroup, sysfs):
        anon = _stat_field(limit.parent / "memory.stat", ("total_rss", "anon"))
        if anon is not None:
            room.append(cap - anon)
    return min(room) if room else None


def _mem_available(meminfo: str | os.PathLike) -> list[int]:
    """The machine's ``MemAvailable`` in bytes, as a list of zero or one value."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(meminfo) as fh:
        return [int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:")]
    return []


def _capped_groups(proc_cgroup: str | os.PathLike, sysfs: str | os.PathLike) -> list[tuple[Path, Path, int]]:
    """``(limit file, usage file, cap in bytes)`` of this process's memory cgroups that have a cap."""
    capped = []
    for limit, usage in memory_cgroup_limits(proc_cgroup, sysfs):
        with contextlib.suppress(OSError, ValueError):
            text = limit.read_text().strip()
            cap = 2**63 if text == "max" else int(text)
            if cap < 2**60:  # v1 writes "no cap" as a number near 2**63
                capped.append((limit, usage, cap))
    return capped


def _stat_field(stat: Path, names: Sequence[str]) -> int | None:
    """The first of ``names`` in a memory cgroup's ``memory.stat``; ``None``: none of them, or unreadable."""
    with contextlib.suppress(OSError, ValueError):
        fields = dict(line.split() for line in stat.read_text().splitlines() if line.count(" ") == 1)
        for name in names:
            if name in fields:
                return int(fields[name])
    return None


def _inactive_file(stat: Path) -> int:
    """Inactive page-cache bytes of a memory cgroup (v1 ``total_inactive_file``, v2 ``inactive_file``); 0: unknown."""
    return _stat_field(stat, ("total_inactive_file", "inactive_file")) or 0


def page_cache_holds(file_bytes: int) -> bool:
    """Whether the OS page cache can keep ``file_bytes`` for an epoch: at most half the memory left free."""
    return 0 < 2 * file_bytes <= available_memory()


@dataclass(frozen=True)
class ReadCosts:
    """Device seconds per epoch of the two ways to read an epoch's misses, on one device.

    Args:
        through_gaps_s: the whole file streamed (in requests of :data:`SPLIT_REQUEST_BYTES`): every miss is then a
            copy from the page cache.
        misses_s: the misses alone, one request per missed sample per dataset: the fewest bytes, the most requests.
    """

    through_gaps_s: float
    misses_s: float

    @property
    def seconds(self) -> float:
        """The cheaper of the two: the device's bound on an epoch of these reads."""
        return min(self.through_gaps_s, self.misses_s)

    @property
    def through_gaps(self) -> bool:
        """Whether streaming the file is faster than reading the misses alone by more than a tie
        (:data:`EQUAL_WITHIN`, :data:`EQUAL_WITHIN_S`); on a tie the misses win (fewer bytes, a buffer that pays)."""
        return self.misses_s > max(self.through_gaps_s * (1 + EQUAL_WITHIN), self.through_gaps_s + EQUAL_WITHIN_S)

    def describe(self) -> str:
        """``"through the gaps (device s/epoch: the file streamed 2.52, the misses alone 11.52)"``."""
        chosen = "through the gaps" if self.through_gaps else "only the misses"
        return (
            f"{chosen} (device s/epoch: the file streamed {self.through_gaps_s:.2f}, the misses alone "
            f"{self.misses_s:.2f})"
        )


def read_costs(
    *,
    num_samples: int,
    world_size: int,
    ranks_per_device: int,
    buffer_samples: int,
    row_nbytes: Sequence[int],
    storage: StorageProfile,
) -> ReadCosts:
    """The device seconds per epoch of streaming the file and of reading only the misses (:class:`ReadCosts`).

    The device serves ``ranks_per_device`` ranks; each misses ``num_samples / world_size * (1 - hit)`` samples per
    epoch, hit = ``buffer_samples / num_samples`` (the schedule's bound). Streaming reads the file once per device
    (the page-cache warmers of a node's ranks split it); reading the misses costs one request per missed sample per
    dataset. Both are priced by ``storage`` (:meth:`StorageProfile.seconds`): on a device with separate byte and
    request limits (``overlap`` 0) and few requests per stream, the file's bytes at the bandwidth against the misses'
    requests at the request rate (or their bytes at the bandwidth, if more).

    Args:
        num_samples: training samples.
        world_size: ranks.
        ranks_per_device: ranks that share one device.
        buffer_samples: buffer over all ranks.
        row_nbytes: bytes of one row of each dataset read.
        storage: the device.
    """
    sample_nbytes = sum(row_nbytes)
    file_nbytes = num_samples * sample_nbytes
    misses = ranks_per_device * num_samples / world_size * (1 - min(1.0, buffer_samples / num_samples))
    return ReadCosts(
        through_gaps_s=storage.seconds(file_nbytes, file_nbytes / SPLIT_REQUEST_BYTES),
        misses_s=storage.seconds(misses * sample_nbytes, misses * len(row_nbytes)),
    )


@dataclass(frozen=True)
class ReadPlan:
    """How a rank reads: the window, the gap and the memory split, with the prediction that chose them.

    Args:
        read_window: steps whose reads are sorted and issued together.
        max_gap: unwanted rows read through between two wanted runs.
        buffer_samples: the buffer's share of the memory budget, over all ranks.
        read_ahead_samples: the read-ahead's share, over all ranks (``READ_AHEAD_WINDOWS`` windows per rank).
        predicted_epoch_s: predicted device seconds per epoch (all ranks of a node share the device).
        predicted_bytes: predicted bytes per epoch per rank.
        predicted_requests: predicted device requests per epoch per rank.
        storage: the device profile used.
        costs: the two ways to read the misses that chose between gaps and none (``None``: a fixed gap, or no page
            cache to stream the file into).
        working_samples: the loaders' own working memory (:func:`working_samples`) over all ranks, in samples: the
            part of the budget that neither the buffer nor the read-ahead gets.
    """

    read_window: int
    max_gap: int
    buffer_samples: int
    read_ahead_samples: int
    predicted_epoch_s: float
    predicted_bytes: float
    predicted_requests: float
    storage: StorageProfile
    costs: ReadCosts | None = None
    working_samples: int = 0

    def describe(self) -> str:
        """One line for logs."""
        chose = f"; reads {self.costs.describe()}" if self.costs is not None else ""
        return (
            f"read window {self.read_window} steps, gaps up to {self.max_gap} rows read through, buffer "
            f"{self.buffer_samples} + read-ahead {self.read_ahead_samples} + working {self.working_samples} "
            "samples; predicted "
            f"{self.predicted_epoch_s:.2f} s of device time per epoch ({self.predicted_bytes / 2**20:.1f} MiB, "
            f"{self.predicted_requests:,.0f} requests per rank) on {self.storage.describe()}{chose}"
        )


def window_reads(
    *,
    num_samples: int,
    world_size: int,
    batch_size: int,
    buffer_samples: int,
    read_window: int,
    max_gaps: Sequence[int],
    balance: bool = True,
    seed: int = 0,
) -> list[tuple[float, float, float]]:
    """Per ``max_gap``: ``(runs, rows transferred, distinct rows)`` one rank reads in one epoch.

    One epoch of a rank is drawn from the model the schedule guarantees: its misses, ``1 - hit`` of its
    ``num_samples / world_size`` samples, lie at random in its id range (the whole file, or with ``balance`` a
    contiguous ``1 / world_size`` of it) and come in random order,
    ``read_window`` steps of them at a time; each window's ids are sorted and merged into runs across gaps of up to
    ``max_gap`` unwanted rows. Rows transferred count every read; distinct rows count a row read twice in the epoch
    once (the page cache served the second read).

    Args:
        num_samples: training samples.
        world_size: ranks.
        batch_size: nominal local batch.
        buffer_samples: buffer over all ranks (hit rate ``buffer_samples / num_samples``).
        read_window: steps per window.
        max_gaps: the gaps to evaluate, in rows.
        balance: each rank reads a contiguous slice of the step's sorted misses.
        seed: seed of the drawn epoch.
    """
    span = max(1, num_samples // world_size if balance else num_samples)
    hit = min(1.0, buffer_samples / num_samples)
    # a rank misses (1 - hit) of its num_samples / world_size samples, drawn from its span
    misses = int(round(max(1, num_samples // world_size) * (1 - hit)))
    if misses == 0:
        return [(0.0, 0.0, 0.0) for _ in max_gaps]
    steps = max(1, math.ceil(num_samples / (world_size * batch_size)))
    per_window = max(1, math.ceil(misses / math.ceil(steps / read_window)))
    order = np.random.default_rng(seed).permutation(span)[:misses]
    window = np.arange(misses) // per_window
    by = np.lexsort((order, window))
    ids, win = order[by], window[by]
    step = np.diff(ids)
    new_window = np.diff(win) != 0
    out = []
    for gap in max_gaps:
        breaks = np.flatnonzero((step > gap + 1) | new_window)
        starts = ids[np.concatenate(([0], breaks + 1))]
        stops = ids[np.concatenate((breaks, [len(ids) - 1]))] + 1
        delta = np.zeros(span + 1, dtype=np.int64)
        np.add.at(delta, starts, 1)
        np.add.at(delta, stops, -1)
        distinct = int(np.count_nonzero(np.cumsum(delta)[:span]))
        out.append((float(len(starts)), float(np.sum(stops - starts)), float(distinct)))
    return out


def plan_reads(
    *,
    num_samples: int,
    world_size: int,
    ranks_per_device: int,
    batch_size: int,
    memory_samples: int,
    row_nbytes: Sequence[int],
    storage: StorageProfile,
    read_window: int | None = None,
    max_gap: int | None = None,
    balance: bool = True,
    with_buffer: bool = True,
    page_cache: bool = False,
    io_threads: int = 1,
    reserve_working: bool = False,
) -> ReadPlan:
    """The read window and gap of least predicted device time, and the buffer / read-ahead split of the memory.

    Where the page cache holds the file, a gap read through costs its rows once an epoch, and streaming the file is
    the limit of long gaps: then the plan reads through gaps (``max_gap > 0``) exactly when streaming the file costs
    less than reading only the misses, both priced by ``storage`` (:func:`read_costs`), and the misses alone
    (``max_gap = 0``) otherwise. Without the page cache a row read through is read again by every window that spans
    it, and every gap is weighed by its predicted runs and rows (:func:`window_reads`).

    Each rank holds its working memory (:func:`working_samples`) and :data:`READ_AHEAD_WINDOWS` whole windows
    (``W * batch_size`` samples each, what a window with no buffer hit reads) besides its share of the buffer; the
    buffer gets what remains of ``memory_samples``. Sized
    for the average window instead, half the windows would not fit beside the one being trained on, and their reads
    would wait for it: reading and training one after another instead of at once. A window that
    leaves no buffer is still allowed (the buffer may be worth less than long requests). Among plans within
    :data:`EQUAL_WITHIN` (or :data:`EQUAL_WITHIN_S`) of the fastest, the one holding the least read-ahead memory
    wins, then the fewest bytes: on a fast device, the buffer's hit rate and exact reads.

    Args:
        num_samples: training samples.
        world_size: ranks.
        ranks_per_device: ranks that share one device (a node's ranks on a local disk).
        batch_size: nominal local batch.
        memory_samples: the loaders' memory over all ranks, in samples.
        row_nbytes: bytes of one row of each dataset read.
        storage: the device.
        read_window: fixed window (``None``: chosen).
        max_gap: fixed gap in rows (``None``: chosen).
        balance: misses split as contiguous id slices across ranks (the schedule's ``balance``).
        with_buffer: ``False``: no buffer; the whole memory is read-ahead.
        page_cache: rows read twice in an epoch reach the device once (the OS page cache keeps the file for an
            epoch: see :func:`page_cache_holds`); ``False``: every transferred row counts.
        io_threads: threads per rank that read runs at once (each holds a piece of a run read through gaps).
        reserve_working: ``memory_samples`` is a memory budget that holds the loaders' working memory too
            (:func:`working_samples`); ``False``: buffer and read-ahead only.
    """
    costs = read_costs(
        num_samples=num_samples,
        world_size=world_size,
        ranks_per_device=ranks_per_device,
        buffer_samples=memory_samples if with_buffer else 0,
        row_nbytes=row_nbytes,
        storage=storage,
    )
    windows = [read_window] if read_window is not None else list(WINDOW_CANDIDATES)
    if max_gap is not None:
        gaps = [max_gap]
    elif page_cache:
        gaps = [g for g in GAP_CANDIDATES if g > 0] if costs.through_gaps else [0]
    else:
        gaps = list(GAP_CANDIDATES)
    chosen_by = costs if max_gap is None and page_cache else None
    sample_nbytes = sum(row_nbytes)
    plans: list[ReadPlan] = []
    # plans that read through gaps hold a piece of a run per I/O thread: they are split apart from the exact ones
    gap_groups = [group for group in ([g for g in gaps if g == 0], [g for g in gaps if g > 0]) if group]
    for w in windows:
        for group in gap_groups:
            working = (
                world_size * working_samples(batch_size, group[0], sample_nbytes, io_threads) if reserve_working else 0
            )
            split = _split_memory(world_size, batch_size, memory_samples - working, w, with_buffer)
            if split is None and (plans or w != windows[0]):
                continue  # its read-ahead alone exceeds the memory (the smallest window is always allowed)
            read_ahead, buffer = split if split is not None else (max(0, memory_samples - working), 0)
            reads = window_reads(
                num_samples=num_samples,
                world_size=world_size,
                batch_size=batch_size,
                buffer_samples=buffer,
                read_window=w,
                max_gaps=group,
                balance=balance,
            )
            for g, (runs, rows, distinct) in zip(group, reads, strict=True):
                nbytes = (distinct if page_cache else rows) * sample_nbytes
                requests = runs * len(row_nbytes) + rows * sample_nbytes / SPLIT_REQUEST_BYTES
                seconds = ranks_per_device * storage.seconds(nbytes, requests)
                plans.append(ReadPlan(w, g, buffer, read_ahead, seconds, nbytes, requests, storage, chosen_by, working))
    fastest = min(p.predicted_epoch_s for p in plans)
    close = [p for p in plans if p.predicted_epoch_s <= max(fastest * (1 + EQUAL_WITHIN), fastest + EQUAL_WITHIN_S)]
    return min(close, key=lambda p: (p.read_ahead_samples, p.predicted_bytes, p.read_window))


def working_samples(batch_size: int, max_gap: int, sample_nbytes: int, io_threads: int) -> int:
    """Memory one rank's loader holds beyond its buffer share and its read-ahead windows, in samples (rounded up).

    What a loader's resident memory held step by step beyond its buffer and read-ahead: :data:`LOADER_FIXED_BYTES`,
    :data:`BATCHES_IN_FLIGHT` local batches and, when runs are read through gaps, one piece of
    :data:`~lightning_sdp.datamodules.solar.reader.GAP_PIECE_BYTES` per I/O thread. Under a memory cap (a cgroup
    charges every page) the budget must hold these too.

    Args:
        batch_size: nominal local batch.
        max_gap: rows read through between wanted runs (``0``: no gap pieces).
        sample_nbytes: bytes of one sample.
        io_threads: threads per rank that read runs at once.
    """
    nbytes = LOADER_FIXED_BYTES + BATCHES_IN_FLIGHT * batch_size * sample_nbytes
    if max_gap > 0:
        nbytes += max(1, io_threads) * GAP_PIECE_BYTES
    return -(-nbytes // max(1, sample_nbytes))


def _split_memory(
    world_size: int, batch_size: int, memory: int, window: int, with_buffer: bool
) -> tuple[int, int] | None:
    """``(read-ahead, buffer)`` samples over all ranks for ``window`` steps under ``memory``; ``None``: no fit."""
    full = READ_AHEAD_WINDOWS * window * batch_size * world_size
    if full > memory:
        return None
    return full, memory - full if with_buffer else 0
