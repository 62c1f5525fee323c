"""Storage doubles for the SOLAR benchmarks: an emulated slow device inside the process, and the per-sample baseline.

- :class:`StorageThrottle` and :class:`ThrottledFile`: every read request through the file costs
  ``latency + bytes / bandwidth`` (a sleep) and is counted; ``StorageThrottle()`` only counts.
- :class:`ThrottledReader`: SOLAR's :class:`~lightning_sdp.datamodules.solar.reader.HDF5Reader` whose reads (h5py's
  metadata reads and the positional reads) go through a :class:`ThrottledFile`.
- :class:`PerSampleHDF5Dataset`: what a plain PyTorch project does with an HDF5 training set, one ``dset[i]`` per
  key per ``__getitem__`` (optionally through a :class:`ThrottledFile`).
- :func:`drop_page_cache`: forget one file's cached pages (``POSIX_FADV_DONTNEED``).

A real throttled device (loop device + blkio cgroup) is :mod:`benchmarks.tools.device`; these doubles are for
machines without root and for tests.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_sdp.datamodules.solar.reader import HDF5Reader


@dataclass(frozen=True)
class StorageThrottle:
    """Emulated shared storage: every request costs ``latency_s + bytes / bandwidth_bytes_per_s``.

    Args:
        latency_s: seconds per request (e.g. 0.002 for a busy parallel file system).
        bandwidth_bytes_per_s: bytes per second of one client; ``0`` means unlimited.
    """

    latency_s: float = 0.0
    bandwidth_bytes_per_s: float = 0.0

    def cost(self, nbytes: int) -> float:
        """Seconds one request of ``nbytes`` takes."""
        bw = self.bandwidth_bytes_per_s
        return self.latency_s + (nbytes / bw if bw > 0 else 0.0)


class ThrottledFile(io.RawIOBase):
    """A read-only file object for ``h5py.File(fileobj)`` (and positional reads) that sleeps per request and counts
    bytes and requests.

    Args:
        path: file to open.
        throttle: the per-request cost; ``None`` only counts.
        readahead: keep the kernel's readahead for this descriptor (default); ``False`` advises
            ``POSIX_FADV_RANDOM``.
    """

    def __init__(
        self, path: str | os.PathLike, throttle: StorageThrottle | None = None, readahead: bool = True
    ) -> None:
        super().__init__()
        self.fd = os.open(os.fspath(path), os.O_RDONLY)
        if not readahead and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.throttle = throttle
        self.pos = 0
        self.bytes_read = 0
        self.requests = 0
        self.size = os.fstat(self.fd).st_size
        self._lock = threading.Lock()

    def _charge(self, nbytes: int, start: float) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.requests += 1
        if self.throttle is not None:
            left = self.throttle.cost(nbytes) - (time.perf_counter() - start)
            if left > 0:
                time.sleep(left)

    def pread_into(self, buffer: Any, offset: int) -> int:
        """Fill ``buffer`` from ``offset`` as one request (thread-safe; the throttle sleeps without the GIL)."""
        view = memoryview(buffer).cast("B")
        start, done = time.perf_counter(), 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"unexpected end of file at byte {offset + done} (file is {self.size} bytes)")
            done += n
        self._charge(done, start)
        return done

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self.pos = offset
        elif whence == io.SEEK_CUR:
            self.pos += offset
        else:
            self.pos = self.size + offset
        return self.pos

    def readinto(self, b: Any) -> int:
        start = time.perf_counter()
        n = os.preadv(self.fd, [memoryview(b).cast("B")], self.pos)
        self.pos += n
        self._charge(n, start)
        return n

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
        super().close()


def drop_page_cache(path_or_fd: str | os.PathLike | int) -> None:
    """Evict a file from the OS page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (no-op where missing)."""
    if not hasattr(os, "posix_fadvise"):
        return
    if isinstance(path_or_fd, int):
        os.posix_fadvise(path_or_fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return
    fd = os.open(os.fspath(path_or_fd), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class ThrottledReader(HDF5Reader):
    """An :class:`~lightning_sdp.datamodules.solar.reader.HDF5Reader` on an emulated device: h5py and the positional
    reads share one :class:`ThrottledFile` per process, so every request is costed and counted.

    Args:
        *args: as for ``HDF5Reader``.
        throttle: the per-request cost (``StorageThrottle()`` only counts).
        **kwargs: as for ``HDF5Reader``.
    """

    def __init__(self, *args: Any, throttle: StorageThrottle, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.throttle = throttle
        self.fileobj: ThrottledFile | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "fileobj": None}

    def _open_h5(self) -> Any:
        import h5py

        self.fileobj = ThrottledFile(self.path, self.throttle, readahead=self.readahead)
        return h5py.File(self.fileobj, "r", rdcc_nbytes=self.rdcc_nbytes)

    def _open_positional(self) -> Any:
        self._handle()  # opens the throttled file object
        return self.fileobj


class PerSampleHDF5Dataset(Dataset):
    """``__getitem__(i)`` reads row ``i`` of the input and every target dataset with plain h5py indexing.

    Items are ``(input, target)``: the targets are joined along their first per-sample axis, so that after the
    default collate a batch holds the same tensors as a ``SolarDataModule`` dict batch's ``input`` and ``target``
    (one target keeps its own shape). The file is opened lazily in the process that reads (each DataLoader worker
    opens its own handle) and is never pickled.

    Args:
        path: the HDF5 file.
        input_key: dataset holding the inputs (first axis = samples).
        target_keys: datasets holding the targets, in order.
        throttle: read through a :class:`ThrottledFile` with this cost (``StorageThrottle()`` costs nothing and
            only counts: :attr:`bytes_read`, :attr:`requests`). Default None (plain file, not counted).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        input_key: str,
        target_keys: Sequence[str],
        throttle: StorageThrottle | None = None,
    ) -> None:
        import h5py

        self.path, self.input_key, self.target_keys = os.fspath(path), input_key, list(target_keys)
        if not self.target_keys:
            raise ValueError("target_keys must name at least one dataset")
        self.throttle = throttle
        with h5py.File(self.path, "r") as f:
            missing = [k for k in (input_key, *self.target_keys) if k not in f]
            if missing:
                raise KeyError(f"{self.path!r} has no dataset {missing}; it holds {sorted(f)}")
            self.num_samples = int(f[input_key].shape[0])
        self._file: Any = None
        self._fileobj: ThrottledFile | None = None

    @property
    def bytes_read(self) -> int:
        """Bytes read through the file in this process (h5py's metadata reads included); 0 without a throttle."""
        return self._fileobj.bytes_read if self._fileobj is not None else 0

    @property
    def requests(self) -> int:
        """Read requests issued to the file in this process (h5py's metadata reads included); 0 without a throttle."""
        return self._fileobj.requests if self._fileobj is not None else 0

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._file is None:
            import h5py

            if self.throttle is not None:
                self._fileobj = ThrottledFile(self.path, self.throttle)
            self._file = h5py.File(self._fileobj if self._fileobj is not None else self.path, "r")
        x = torch.from_numpy(self._file[self.input_key][i])
        targets = [torch.from_numpy(self._file[k][i]) for k in self.target_keys]
        return x, targets[0] if len(targets) == 1 else torch.cat(targets, dim=0)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_file"] = state["_fileobj"] = None  # open handles cannot travel to a worker; each opens its own
        return state
