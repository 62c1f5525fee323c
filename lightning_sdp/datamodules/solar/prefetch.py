"""Reads that run beside training: a background thread issues the plan's read requests ahead, within a byte budget.

The schedule knows every future read, so a thread can read the next windows while the model trains on the current
one, and go on into the next epoch (through validation) instead of stopping at the epoch's end. The reads are
positional reads and sleeps on the device, which release the GIL, so one thread in the training process suffices.
What it holds (read, not yet trained on) is bounded by ``limit_bytes``, the read-ahead's share of the loader's memory.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

# Seconds between two looks at the memory while a read waits for room (what others free notifies no one).
MEMORY_POLL_S = 0.05


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (``None`` elsewhere: other C libraries return freed memory on their own terms)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _find_malloc_trim()


def return_free_memory() -> None:
    """Give the pages of freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    A window's rows are freed once it is trained on, but glibc keeps freed heap pages (its mmap threshold grows
    to the window's size after the first frees, so later windows come from the heap), so the process's resident
    memory grows past what the loader holds: about 3-4x the read plan's memory measured on one rank. A memory
    cgroup charges those pages and then evicts the page cache and the libraries' mapped code instead. Trimming after
    every window keeps the resident memory near what the plan holds; it costs one pass over the heap's free lists.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@dataclass
class ReadResult:
    """One request's rows and what reading it cost.

    Args:
        key: the request's key (``(epoch, first step)``).
        ids: the sample ids read, in request order.
        data: ``{dataset: (len(ids), ...) tensor}``.
        nbytes: bytes the reader transferred (gap rows included).
        seconds: seconds the read took.
        held_bytes: bytes of ``data`` (counted against the budget until released).
    """

    key: tuple[int, int]
    ids: np.ndarray
    data: dict[str, Any]
    nbytes: int
    seconds: float
    held_bytes: int


class ReadAhead:
    """A thread that reads queued requests in order, holding at most ``limit_bytes`` of unreleased results.

    A request is read when the results held plus its own size fit in ``limit_bytes`` and the memory has room for
    it (``memory_headroom``), or when nothing is held (so one request larger than the budget still makes progress).
    :meth:`get` returns results in queue order; :meth:`release` gives a result's bytes back once the training loop is
    done with it.

    Args:
        read: ``read(key, ids) -> (data, bytes transferred)``.
        sample_nbytes: bytes one sample takes in a result.
        limit_bytes: the budget for results read and not yet released.
        memory_headroom: bytes the process's memory can still allocate (``None``: unknown), asked before each read
            beyond the first held: the plan's budget counts the samples, not what the process's other work holds,
            so under a kernel-enforced cap (a memory cgroup) the read waits until ``memory_sharers`` reads of its
            size fit instead of getting the ranks killed. ``None``: the budget alone decides.
        memory_sharers: processes reading ahead from the same memory (a node's ranks).
    """

    def __init__(
        self,
        read: Callable[[tuple[int, int], np.ndarray], tuple[dict[str, Any], int]],
        sample_nbytes: int,
        limit_bytes: int,
        memory_headroom: Callable[[], int | None] | None = None,
        memory_sharers: int = 1,
    ) -> None:
        self._read, self.sample_nbytes, self.limit_bytes = read, int(sample_nbytes), int(limit_bytes)
        self._headroom, self.memory_sharers = memory_headroom, max(1, int(memory_sharers))
        self.memory_waits = 0  # reads that waited for memory although the budget had room
        self._waiting_for_memory = False  # the last check found no room: look again after MEMORY_POLL_S
        self._cond = threading.Condition()
        self._pending: deque[tuple[tuple[int, int], np.ndarray]] = deque()
        self._done: deque[ReadResult | BaseException] = deque()
        self._held = 0
        self._generation = 0
        self._closed = False
        self.peak_held_bytes = 0
        self._thread = threading.Thread(target=self._run, name="solar-read-ahead", daemon=True)
        self._thread.start()

    @property
    def queued_keys(self) -> list[tuple[int, int]]:
        """Keys of the requests read and not yet taken, being read, and queued, in order."""
        return [key for key, _ in self.queued()]

    def queued(self) -> list[tuple[tuple[int, int], np.ndarray]]:
        """``(key, ids)`` of the requests read and not yet taken, being read, and queued, in order."""
        with self._cond:
            done = [(r.key, r.ids) for r in self._done if isinstance(r, ReadResult)]
            reading = [self._reading] if self._reading is not None else []
            return done + reading + list(self._pending)

    def submit(self, key: tuple[int, int], ids: np.ndarray) -> None:
        """Queue one request (read after those queued before it)."""
        with self._cond:
            self._pending.append((key, np.asarray(ids, dtype=np.int64)))
            self._cond.notify_all()

    def get(self) -> ReadResult:
        """The next result in queue order (waits for it); re-raises an error the read raised."""
        with self._cond:
            while not self._done:
                if self._closed:
                    raise RuntimeError("SOLAR read-ahead was closed")
                if not self._pending and self._reading is None:
                    raise RuntimeError("SOLAR read-ahead: get() with no request queued")
                self._cond.wait()
            item = self._done.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def release(self, result: ReadResult) -> None:
        """Give ``result``'s bytes back to the budget."""
        with self._cond:
            self._held -= result.held_bytes
            result.held_bytes = 0
            self._cond.notify_all()

    def reset(self) -> None:
        """Drop every queued request and every result not taken (a read in flight finishes and is dropped)."""
        with self._cond:
            self._pending.clear()
            for item in self._done:
                if isinstance(item, ReadResult):
                    self._held -= item.held_bytes
            self._done.clear()
            self._reading = None  # its result is dropped when it arrives
            self._generation += 1
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread (after the read in flight) and drop everything."""
        self.reset()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)

    _reading: tuple[tuple[int, int], np.ndarray] | None = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (self._pending and self._fits(len(self._pending[0][1]))):
                    self._cond.wait(MEMORY_POLL_S if self._waiting_for_memory else None)
                if self._closed:
                    return
                key, ids = self._pending.popleft()
                generation, self._reading = self._generation, (key, ids)
                size = len(ids) * self.sample_nbytes
                self._held += size
                self.peak_held_bytes = max(self.peak_held_bytes, self._held)
            item: ReadResult | BaseException
            try:
                t0 = time.perf_counter()
                data, nbytes = self._read(key, ids)
                item = ReadResult(key, ids, data, int(nbytes), time.perf_counter() - t0, size)
            except BaseException as err:  # handed to the training loop, which raises it
                item = err
            with self._cond:
                self._reading = None
                if generation != self._generation:
                    self._held -= size
                else:
                    if isinstance(item, BaseException):
                        self._held -= size
                    self._done.append(item)
                self._cond.notify_all()

    def _fits(self, samples: int) -> bool:
        size = samples * self.sample_nbytes
        if self._held == 0:
            return True
        if self._held + size > self.limit_bytes:
            return False
        headroom = self._headroom() if self._headroom is not None else None
        short = headroom is not None and headroom < size * self.memory_sharers
        if short and not self._waiting_for_memory:
            self.memory_waits += 1
        self._waiting_for_memory = short
        return not short


class PageCacheWarmer:
    """A thread that reads rows ``[lo, hi)`` of every dataset once per pass, in file order, into the page cache.

    A plan whose long reads count on the page cache pays when the cache is cold (the first epoch, or after the OS
    dropped the file): then a window's rows lie all over the file, and reading its runs whole waits for nearly all of
    it. This thread streams the rows instead, in long requests (bandwidth-bound, few requests), and the training
    reads wait for the stream to pass their rows (:meth:`wait_streamed`), then copy them from memory; rows outside
    the share are read at the cost of a cold device. Rows the page cache already holds are copied, not read again
    (``RWF_NOWAIT`` first): a warm pass costs a memory copy. It only touches the page cache (one scratch chunk of its
    own), so it does not count against the loader's memory.

    Args:
        path: the HDF5 file.
        layout: ``{dataset: (file offset, row bytes)}`` of contiguous datasets.
        lo: first row of this thread's share (a node's ranks split the file).
        hi: end of the share (exclusive).
        chunk_bytes: bytes per request (the block layer's request size).
        yield_to: while it returns ``True`` (rows a step waits for are being read past the cache), the thread sends
            no request, so those reads have the device to themselves, for at most ``max_yield_s`` per chunk: a reader
            that always has a read in flight (loading alone, with the read-ahead never full) would otherwise stop the
            stream the plan counts on, and its short runs would be read from a cold device all epoch. Default: never.
        max_yield_s: the longest pause before the next chunk is read anyway. Default 0.05.
    """

    def __init__(
        self,
        path: str,
        layout: dict[str, tuple[int, int]],
        lo: int,
        hi: int,
        chunk_bytes: int = 2**20,
        yield_to: Callable[[], bool] | None = None,
        max_yield_s: float = 0.05,
    ) -> None:
        import os

        self._os = os
        self.fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)  # exactly the chunks asked for, no readahead
        self.regions = sorted(layout.values())
        self.lo, self.hi = int(lo), int(hi)
        self.rows_per_chunk = max(1, chunk_bytes // max(row for _, row in self.regions))
        self._scratch = bytearray(self.rows_per_chunk * max(row for _, row in self.regions))
        self._cond = threading.Condition()
        self._passes = 0  # passes asked for
        self._position = self.lo  # rows below it are streamed in the current pass
        self._closed = False
        self._yield_to = yield_to or (lambda: False)
        self.max_yield_s = float(max_yield_s)
        self.device_bytes = 0  # bytes that were not already cached
        self.passes_done = 0
        self._thread = threading.Thread(target=self._run, name="solar-page-cache", daemon=True)
        self._thread.start()

    def start_pass(self) -> None:
        """Stream the share once more, from its first row (a pass in progress starts over)."""
        with self._cond:
            self._passes += 1
            self._cond.notify_all()

    def wait_streamed(self, row: int) -> None:
        """Wait until the current pass has streamed ``row`` (its share's last row, for a row past the share), the
        pass has ended, or the warmer is closed.

        A read of rows the stream is about to pass would be a device request of its own, and on a device limited in
        requests per second those requests, not the stream, set the epoch's time: waiting for the stream turns them
        into copies from the page cache.
        """
        target = min(int(row), self.hi - 1)
        with self._cond:
            while not self._closed and self.passes_done < self._passes and self._position <= target:
                self._cond.wait(0.1)

    def close(self) -> None:
        """Stop after the chunk in flight and close the descriptor."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
        self._os.close(self.fd)

    def _run(self) -> None:
        done = 0
        while True:
            with self._cond:
                while not self._closed and self._passes == done:
                    self._cond.wait()
                if self._closed:
                    return
                done, self._position = self._passes, self.lo
            row, paused = self.lo, 0.0
            while row < self.hi:
                with self._cond:
                    if self._closed or self._passes != done:
                        break  # closed, or a new pass asked for: start over
                if paused < self.max_yield_s and self._yield_to():
                    time.sleep(0.002)
                    paused += 0.002
                    continue
                paused = 0.0
                end = min(self.hi, row + self.rows_per_chunk)
                for offset, nbytes in self.regions:
                    self._read(offset + row * nbytes, (end - row) * nbytes)
                row = end
                with self._cond:
                    self._position = row
                    self._cond.notify_all()
            else:
                with self._cond:
                    self.passes_done += 1
                    self._cond.notify_all()

    def _read(self, offset: int, length: int) -> None:
        os = self._os
        view = memoryview(self._scratch)[:length]
        got = 0
        if hasattr(os, "RWF_NOWAIT"):
            try:
                got = os.preadv(self.fd, [view], offset, os.RWF_NOWAIT)
            except OSError:  # not cached (EAGAIN), or the file system lacks the flag
                got = 0
        while got < length:
            n = os.preadv(self.fd, [view[got:]], offset + got)
            if n == 0:
                return
            self.device_bytes += n
            got += n
