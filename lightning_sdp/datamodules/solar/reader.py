"""Coalesced HDF5 reads: sort a step's misses, read runs of consecutive indices with one hyperslab each.

h5py is imported lazily. A reader opens its file on first use in each process (h5py handles survive neither
``fork`` nor pickling), with HDF5's chunk cache off (``rdcc_nbytes=0``) because the SOLAR buffer is the cache.
Contiguous datasets are read with positional reads (:class:`PositionalFile`) at their file offsets.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GAP_PIECE_BYTES = 2**20
"""The most bytes one I/O thread holds of a run read through gaps (the block layer splits longer reads into requests
of about this size anyway)."""
MAPPED_MIN_BYTES = 128 * 2**10
"""Arrays of read rows at least this large get their own memory map (glibc's default threshold for the same)."""


def mapped_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array in its own anonymous memory map when it is large, so that its pages go back to the OS
    the moment it is freed.

    glibc raises its mmap threshold to the size of each large block freed, and serves later blocks of that size from
    its heaps, which keep freed pages: window after window of read rows, the process held about one window more than
    the loader does, memory a cgroup charges like any other.

    Args:
        shape: the array's shape.
        dtype: its element type.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < MAPPED_MIN_BYTES:
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).reshape(shape)


def coalesce_runs(sorted_ids: np.ndarray, max_gap: int = 0) -> list[tuple[int, int]]:
    """Half-open runs ``[a, b)`` covering sorted, unique ids; ids at most ``max_gap`` apart share a run.

    Args:
        sorted_ids: strictly increasing sample ids.
        max_gap: largest number of *unrequested* ids inside a run (0: only consecutive ids merge).
    """
    ids = np.asarray(sorted_ids, dtype=np.int64)
    if ids.size == 0:
        return []
    if max_gap < 0:
        raise ValueError(f"max_gap must be >= 0, got {max_gap}")
    breaks = np.flatnonzero(np.diff(ids) > max_gap + 1)
    starts = np.concatenate(([ids[0]], ids[breaks + 1]))
    stops = np.concatenate((ids[breaks], [ids[-1]])) + 1
    return list(zip(starts.tolist(), stops.tolist(), strict=True))


def read_coalesced(dset: Any, ids: Sequence[int] | np.ndarray, max_gap: int = 0) -> tuple[np.ndarray, int, int]:
    """Read rows ``ids`` (any order, repeats allowed) of an array-like with one slice read per run.

    Args:
        dset: an h5py dataset (or any array supporting ``dset[a:b]`` and ``shape``/``dtype``).
        ids: requested row ids, returned in this order.
        max_gap: merge runs separated by at most this many unrequested rows (reads them and drops them).

    Returns:
        ``(rows, bytes_read, requests)``: the rows in request order, bytes transferred, slice reads issued.
    """
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return np.empty((0, *dset.shape[1:]), dtype=dset.dtype), 0, 0
    n = dset.shape[0]
    if ids.min() < 0 or ids.max() >= n:
        bad = ids[(ids < 0) | (ids >= n)][0]
        raise IndexError(f"sample id {int(bad)} is outside the dataset's {n} rows")
    uniq, inverse = np.unique(ids, return_inverse=True)
    rows = np.empty((len(uniq), *dset.shape[1:]), dtype=dset.dtype)
    nbytes = 0
    row_bytes = int(np.prod(dset.shape[1:], dtype=np.int64)) * dset.dtype.itemsize
    runs = coalesce_runs(uniq, max_gap)
    for a, b in runs:
        block = np.asarray(dset[a:b])
        nbytes += (b - a) * row_bytes
        lo, hi = np.searchsorted(uniq, [a, b])
        rows[lo:hi] = block[uniq[lo:hi] - a]
    if _in_order(ids, uniq):  # asked in ascending order without repeats: no reordered copy
        return rows, nbytes, len(runs)
    return rows[inverse.reshape(-1)], nbytes, len(runs)


def _in_order(ids: np.ndarray, uniq: np.ndarray) -> bool:
    """Whether ``ids`` are their own ``np.unique``: ascending, no repeats."""
    return len(ids) == len(uniq) and bool(np.array_equal(ids, uniq))


def read_per_sample(dset: Any, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Reference path: one read per requested id, in request order."""
    ids = np.asarray(ids, dtype=np.int64)
    out = np.empty((len(ids), *dset.shape[1:]), dtype=dset.dtype)
    for k, i in enumerate(ids.tolist()):
        out[k] = dset[i]
    return out


VALIDATE_MODES = ("warn", "raise", "off")


class PositionalFile:
    """A read-only descriptor for positional reads (``os.preadv``) that counts bytes and requests; thread-safe.

    Args:
        path: file to open.
        readahead: keep the kernel's readahead for this descriptor (default). ``False`` advises
            ``POSIX_FADV_RANDOM``: every read then fetches exactly the bytes asked for, in one request, instead of
            also pulling the device's readahead window (up to megabytes) into the page cache.
    """

    def __init__(self, path: str | os.PathLike, readahead: bool = True) -> None:
        self.fd = os.open(os.fspath(path), os.O_RDONLY)
        if not readahead and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.size = os.fstat(self.fd).st_size
        self.bytes_read = 0
        self.requests = 0
        self._lock = threading.Lock()

    def pread_into(self, buffer: Any, offset: int) -> int:
        """Fill ``buffer`` from ``offset`` as one request; returns the bytes read."""
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"unexpected end of file at byte {offset + done} (file is {self.size} bytes)")
            done += n
        with self._lock:
            self.bytes_read += done
            self.requests += 1
        return done

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class FileChangedError(RuntimeError):
    """The HDF5 file changed (size, modification time or identity) while a reader was using its layout."""


@dataclass(frozen=True)
class FileIdentity:
    """What ``os.stat`` says about a file when it was opened: a changed value means the file was rewritten.

    A reader finds each dataset's file offset once; an HDF5 file rewritten in place (or replaced under the same
    name) has its samples elsewhere, so reading on at the old offsets would give wrong values without an error.

    Args:
        size: bytes.
        mtime_ns: modification time in nanoseconds.
        device: ``st_dev`` of the file system.
        inode: ``st_ino``.
    """

    size: int
    mtime_ns: int
    device: int
    inode: int

    @classmethod
    def of(cls, path: str | os.PathLike) -> FileIdentity:
        """The identity of ``path`` now (one ``os.stat``)."""
        st = os.stat(path)
        return cls(int(st.st_size), int(st.st_mtime_ns), int(st.st_dev), int(st.st_ino))

    def changes(self, now: FileIdentity) -> list[str]:
        """What differs between this identity and ``now``, in words (empty when nothing did)."""
        out = []
        if now.size != self.size:
            out.append(f"size {self.size} -> {now.size} bytes")
        if now.mtime_ns != self.mtime_ns:
            out.append(f"modified {(now.mtime_ns - self.mtime_ns) / 1e9:+.3f} s after it was opened")
        if (now.device, now.inode) != (self.device, self.inode):
            out.append(
                f"replaced by another file (device/inode {self.device}/{self.inode} -> {now.device}/{now.inode})"
            )
        return out

    def check(self, path: str | os.PathLike) -> None:
        """Raise :class:`FileChangedError` when ``path`` is no longer the file this identity describes.

        Raises:
            FileChangedError: the size, modification time, device or inode differ (or the file is gone).
        """
        try:
            now = FileIdentity.of(path)
        except FileNotFoundError as err:
            raise FileChangedError(
                f"SOLAR: {os.fspath(path)!r} was removed while training read it. Put the file back, or create a "
                "new SolarDataModule with its new path; resuming from a checkpoint is fine while the samples are "
                "the same."
            ) from err
        changes = self.changes(now)
        if changes:
            raise FileChangedError(
                f"SOLAR: {os.fspath(path)!r} changed while training read it ({'; '.join(changes)}). Its samples "
                "are read at the offsets found when it was opened, so reading on would give wrong values. Do not "
                "rewrite a file that a run is reading: write new data to another file. To train on the file as it is "
                "now, create a new SolarDataModule (its setup reads the new layout); resuming from a checkpoint "
                "taken on the old content is refused."
            )


def check_h5_path(path: str | os.PathLike, role: str = "HDF5 file") -> None:
    """Raise a clear error unless ``path`` is an existing file (not a directory).

    Args:
        path: the path given for an HDF5 file.
        role: what the file is for, named in the message (e.g. ``"validation file"``).

    Raises:
        IsADirectoryError: ``path`` is a directory (the message lists the HDF5 files in it, if any).
        FileNotFoundError: nothing is at ``path``.
    """
    p = Path(path)
    if p.is_dir():
        found = sorted(q.name for q in p.iterdir() if q.suffix.lower() in (".h5", ".hdf5", ".he5", ".nc"))
        inside = (
            f"; it holds {', '.join(found[:5])}{', ...' if len(found) > 5 else ''}"
            if found
            else "; it holds no .h5/.hdf5 file"
        )
        example = os.fspath(p / (found[0] if found else "train.h5"))
        raise IsADirectoryError(
            f"SOLAR {role} {os.fspath(path)!r} is a directory{inside}. SolarDataModule reads one HDF5 file whose "
            f"datasets hold the samples along their first axis: pass the file's path (e.g. {example!r})."
        )
    if not p.exists():
        raise FileNotFoundError(f"SOLAR {role} {os.fspath(path)!r} does not exist; pass the path of an HDF5 file")


@dataclass(frozen=True)
class DatasetInfo:
    """Length, per-sample shapes and dtypes of the datasets a reader serves."""

    num_samples: int
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, np.dtype]

    @property
    def row_nbytes(self) -> dict[str, int]:
        """Bytes of one sample's row in each dataset."""
        return {k: int(np.prod(s, dtype=np.int64)) * self.dtypes[k].itemsize for k, s in self.shapes.items()}

    @property
    def sample_nbytes(self) -> int:
        """Bytes of one sample over all keys."""
        return sum(self.row_nbytes.values())


def _open_h5(path: str, fileobj: Any = None, rdcc_nbytes: int = 0) -> Any:
    import h5py

    target = fileobj if fileobj is not None else path
    try:
        return h5py.File(target, "r", rdcc_nbytes=rdcc_nbytes)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise ValueError(
            f"{path!s} is not a readable HDF5 file ({err}); it may be corrupt or truncated. Regenerate or re-copy it."
        ) from err


def check_dtype(path: str, key: str, dtype: np.dtype) -> None:
    """Raise a ``ValueError`` naming file and key unless ``dtype`` is a native-order bool, integer or float type.

    Torch cannot take strings, objects, compound records or byte-swapped arrays; without this check they pass
    ``setup`` and fail during ``fit`` with an error that names neither the file nor the key.
    """
    if dtype.kind not in "biuf" or dtype.fields is not None:
        raise ValueError(
            f"{path!r}:{key} has dtype {dtype} ({dtype.kind!r}); SOLAR reads numeric arrays only (bool, int, "
            "float). Convert the dataset to numbers (e.g. encode labels as integers) and write it again."
        )
    if not dtype.isnative and dtype.itemsize > 1:
        raise ValueError(
            f"{path!r}:{key} is stored {'big' if dtype.byteorder == '>' else 'little'}-endian ({dtype.str}), which "
            "is not this machine's byte order and which torch cannot take. Rewrite it in native order, e.g. "
            f"f.create_dataset({key!r}, data=old[...].astype(old.dtype.newbyteorder('=')))."
        )


def inspect_h5(path: str | os.PathLike, keys: Sequence[str]) -> DatasetInfo:
    """Check that ``path`` is an HDF5 file holding ``keys`` of equal length, and describe them.

    Raises:
        FileNotFoundError: the file does not exist.
        IsADirectoryError: ``path`` is a directory.
        ValueError: corrupt file, missing key, a key that is not a dataset, or lengths that differ.
    """
    path = os.fspath(path)
    check_h5_path(path)
    import h5py

    with _open_h5(path) as f:
        lengths, shapes, dtypes = {}, {}, {}
        for key in keys:
            if key not in f:
                raise ValueError(f"{path!r} has no dataset {key!r}; it holds {sorted(f.keys())}")
            dset = f[key]
            if not isinstance(dset, h5py.Dataset) or dset.ndim < 1:
                raise ValueError(f"{path!r}:{key} is not an array dataset with a sample axis")
            check_dtype(path, key, dset.dtype)
            lengths[key] = dset.shape[0]
            shapes[key] = tuple(dset.shape[1:])
            dtypes[key] = dset.dtype
        if len(set(lengths.values())) > 1:
            raise ValueError(f"datasets in {path!r} have different lengths {lengths}; inputs and targets must match")
    n = next(iter(lengths.values()))
    if n == 0:
        raise ValueError(f"datasets {list(keys)} in {path!r} are empty")
    return DatasetInfo(n, shapes, dtypes)


FINGERPRINT_ROWS = 8
"""Rows sampled (evenly, first and last included) by :func:`data_fingerprint`."""
FINGERPRINT_ROW_ELEMENTS = 4096
"""Rows with more elements contribute their first and last lines (of at most half this many elements each)."""


def _row_probe(dset: Any, row: int) -> bytes:
    """Bytes of row ``row``, or of its first and last lines when the row is large (a bounded, cheap read)."""
    shape = tuple(dset.shape[1:])
    if int(np.prod(shape, dtype=np.int64)) <= FINGERPRINT_ROW_ELEMENTS:
        return np.ascontiguousarray(dset[row]).tobytes()
    k = min(shape[-1], FINGERPRINT_ROW_ELEMENTS // 2)
    first_line = (row, *([0] * (len(shape) - 1)), slice(0, k))
    last_line = (row, *(d - 1 for d in shape[:-1]), slice(shape[-1] - k, shape[-1]))
    first, last = dset[first_line], dset[last_line]
    return np.ascontiguousarray(first).tobytes() + np.ascontiguousarray(last).tobytes()


def data_fingerprint(path: str | os.PathLike, keys: Sequence[str]) -> dict[str, Any]:
    """Identify the samples of ``keys`` in an HDF5 file by content, so that a copy matches and other data does not.

    The fingerprint holds the number of samples, each key's per-sample shape and dtype, and a SHA-256 of
    :data:`FINGERPRINT_ROWS` rows sampled evenly (the first and last included; of a large row, its first and last
    lines). It reads a few KiB. It leaves out the path, the modification time and the inode, which change when a file
    is copied, and the file's bytes, which differ between files of the same data written differently. Data that
    differ only in rows it does not sample are not told apart.

    Args:
        path: the HDF5 file.
        keys: the datasets (checked by :func:`inspect_h5`).

    Returns:
        ``{"num_samples", "shapes", "dtypes", "rows_sha256"}`` (JSON-ready).
    """
    info = inspect_h5(path, keys)
    n = info.num_samples
    rows = sorted({int(r) for r in np.linspace(0, n - 1, FINGERPRINT_ROWS).round()})
    digest = hashlib.sha256()
    with _open_h5(os.fspath(path)) as f:
        for key in keys:
            digest.update(f"{key}|{info.dtypes[key].str}|{info.shapes[key]}".encode())
            for r in rows:
                digest.update(_row_probe(f[key], r))
    return {
        "num_samples": n,
        "shapes": {k: list(info.shapes[k]) for k in keys},
        "dtypes": {k: info.dtypes[k].str for k in keys},
        "rows_sha256": digest.hexdigest(),
    }


def _contiguous_offset(f: Any, key: str) -> int | None:
    """Byte offset in ``f``'s file of dataset ``key``'s rows, or ``None`` when positional reads of that file would not
    find them there: a dataset behind an external link (its rows are in the linked file), a virtual, chunked,
    filtered, compact or externally stored one, one not yet written, or one in a non-native byte order."""
    import h5py

    d = f[key]
    if d.id.fileno != f.id.fileno:  # an external link: the offset is the linked file's
        return None
    if d.id.get_create_plist().get_layout() != h5py.h5d.CONTIGUOUS or d.external or not d.dtype.isnative:
        return None
    offset = d.id.get_offset()
    return None if offset is None else int(offset)


class HDF5Reader:
    """Reads samples of several equal-length datasets of one HDF5 file, opening it lazily per process.

    Args:
        path: the HDF5 file.
        keys: dataset names to read (e.g. input and target keys).
        max_gap: merge runs separated by at most this many unrequested rows. Default 0.
        rdcc_nbytes: HDF5 chunk cache bytes; 0 (default) because the SOLAR buffer is the cache.
        coalesce: one slice read per run (default); ``False`` reads sample by sample (the baseline).
        io_threads: with more than 1, the runs of a request are read concurrently by this many threads with
            positional reads at the datasets' file offsets (contiguous, unfiltered layouts only; chunked or
            filtered datasets fall back to h5py hyperslab reads). Since the schedule knows a step's whole read list,
            all its requests can be in flight at once, which hides per-request latency of shared storage.
            Default 1 (one read after another).
        readahead: let the kernel's readahead act on the reads (h5py hyperslab reads when ``io_threads`` is 1).
            Default ``False``: the reads of contiguous datasets are positional reads on a descriptor advised
            ``POSIX_FADV_RANDOM``, so the device serves exactly the planned bytes. With readahead on, a step's
            scattered reads look sequential to the kernel once their neighbours are cached, so it reads windows of
            up to ``read_ahead_kb`` around them; on slow storage with a cold cache that reads the whole file every
            epoch, and the buffer saves no device reads.
        validate: ``"warn"`` (default): check that float rows are finite as they are read and warn (once per key)
            naming the file, key and sample ids of the first non-finite one; ``"raise"``: raise instead;
            ``"off"``: no check. HDF5 checksums (fletcher32) are verified by HDF5 itself on every read of a dataset
            that has them (such datasets are chunked, so they are read through h5py, never by positional reads).
        identity: the file's :class:`FileIdentity` when its layout was checked (e.g. at ``setup``). Default: taken
            now. Every open (in each process) and every :meth:`read` compares the file with it (one ``os.stat``)
            and raises :class:`FileChangedError` when the file was rewritten or replaced.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        keys: Sequence[str],
        max_gap: int = 0,
        rdcc_nbytes: int = 0,
        coalesce: bool = True,
        io_threads: int = 1,
        readahead: bool = False,
        validate: str = "warn",
        identity: FileIdentity | None = None,
    ) -> None:
        if validate not in VALIDATE_MODES:
            raise ValueError(f"validate must be one of {VALIDATE_MODES}, got {validate!r}")
        self.validate = validate
        self._warned: set[str] = set()
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.io_threads = int(io_threads)
        self.path = os.fspath(path)
        self.keys = list(keys)
        self.max_gap = int(max_gap)
        self.rdcc_nbytes = int(rdcc_nbytes)
        self.coalesce = coalesce
        self.readahead = bool(readahead)
        check_h5_path(self.path)
        self.identity = identity if identity is not None else FileIdentity.of(self.path)
        self.info = inspect_h5(self.path, self.keys)
        self.identity.check(self.path)  # the layout just read belongs to the file the identity describes
        self._file: Any = None
        self._pid: int | None = None
        self._raw: PositionalFile | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._layout: dict[str, tuple[int, int]] | None = None
        self.bytes_read = 0
        self.requests = 0
        self.reads_in_flight = 0

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_file=None, _pid=None, _raw=None, _pool=None, _layout=None)
        return state

    def check_unchanged(self) -> None:
        """Raise :class:`FileChangedError` if the file is not the one whose layout this reader uses (``os.stat``)."""
        self.identity.check(self.path)

    def _handle(self) -> Any:
        if self._file is None or self._pid != os.getpid():
            self._file = self._raw = self._pool = self._layout = None  # never close handles inherited through fork
            self.check_unchanged()
            self._file = self._open_h5()
            self._pid = os.getpid()
        return self._file

    def _open_h5(self) -> Any:
        """The h5py file this process reads metadata and non-contiguous datasets through."""
        return _open_h5(self.path, None, self.rdcc_nbytes)

    def _open_positional(self) -> PositionalFile:
        """The descriptor this process's positional reads of contiguous datasets go through."""
        return PositionalFile(self.path, readahead=self.readahead)

    def direct_layout(self) -> dict[str, tuple[int, int]] | None:
        """``{key: (file offset, row bytes)}`` when every key's rows lie in ``path`` itself at one offset, else
        ``None`` (the rows are then read through h5py, which follows links and mappings and applies filters)."""
        f = self._handle()
        if self._layout is None:
            layout: dict[str, tuple[int, int]] = {}
            for key in self.keys:
                offset = _contiguous_offset(f, key)
                if offset is None:
                    return None
                d = f[key]
                layout[key] = (offset, int(np.prod(d.shape[1:], dtype=np.int64)) * d.dtype.itemsize)
            self._layout = layout
        return self._layout

    def _read_direct(self, ids: np.ndarray, layout: dict[str, tuple[int, int]]) -> dict[str, np.ndarray]:
        if self._raw is None:
            self._raw = self._open_positional()
            if self.io_threads > 1:
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="solar-io")
        raw = self._raw
        uniq, inverse = np.unique(ids, return_inverse=True)
        runs = coalesce_runs(uniq, self.max_gap)
        bounds = [tuple(np.searchsorted(uniq, [a, b]).tolist()) for a, b in runs]
        info = self.info
        rows = {k: mapped_empty((len(uniq), *info.shapes[k]), info.dtypes[k]) for k in self.keys}

        def job(key: str, a: int, b: int, lo: int, hi: int) -> int:
            offset, row = layout[key]
            if b - a == hi - lo:  # no gap rows: read straight into place
                return raw.pread_into(rows[key][lo:hi], offset + a * row)
            # a run with gap rows is read in pieces through one scratch block: memory for the rows read and
            # dropped stays at GAP_PIECE_BYTES per I/O thread, however long the run
            piece = min(b - a, max(1, GAP_PIECE_BYTES // row))
            block = mapped_empty((piece, *info.shapes[key]), info.dtypes[key])
            wanted = uniq[lo:hi]
            n = 0
            for start in range(a, b, piece):
                stop = min(start + piece, b)
                n += raw.pread_into(block[: stop - start], offset + start * row)
                i, j = np.searchsorted(wanted, [start, stop])
                rows[key][lo + i : lo + j] = block[wanted[i:j] - start]
            return n

        jobs = [(key, a, b, lo, hi) for key in self.keys for (a, b), (lo, hi) in zip(runs, bounds, strict=True)]
        jobs.sort(key=lambda j: layout[j[0]][0] + j[1] * layout[j[0]][1])  # file order: fewer seeks
        self.reads_in_flight += 1  # a hint for other threads (a page-cache warmer yields to the training reads)
        try:
            if self._pool is None:
                self.bytes_read += sum(job(*j) for j in jobs)
            else:
                futures = [self._pool.submit(job, *j) for j in jobs]
                self.bytes_read += sum(fut.result() for fut in futures)
        finally:
            self.reads_in_flight -= 1
        self.requests += len(jobs)
        if _in_order(ids, uniq):  # asked in ascending order without repeats: no reordered copy
            return rows
        return {k: v[inverse.reshape(-1)] for k, v in rows.items()}

    def read(self, ids: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """Rows ``ids`` of every key, in request order (checked for finiteness unless ``validate="off"``).

        Raises:
            FileChangedError: the file was rewritten or replaced since the reader took its identity.
        """
        self.check_unchanged()
        out = self._read_rows(ids)
        if self.validate != "off":
            self._check_finite(np.asarray(ids, dtype=np.int64), out)
        return out

    def _check_finite(self, ids: np.ndarray, rows: dict[str, np.ndarray]) -> None:
        for key, arr in rows.items():
            if arr.dtype.kind != "f" or key in self._warned or not arr.size:
                continue
            ok = np.isfinite(arr.reshape(len(arr), -1)).all(axis=1)
            if ok.all():
                continue
            bad = ids[~ok][:5].tolist()
            msg = (
                f"{self.path!r}:{key} holds non-finite values (NaN or Inf) in sample(s) {bad}; training on them "
                "gives a NaN loss. Clean or drop these samples (or pass validate='off' to silence this check)."
            )
            if self.validate == "raise":
                raise ValueError(msg)
            self._warned.add(key)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _read_rows(self, ids: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        f = self._handle()
        ids = np.asarray(ids, dtype=np.int64)
        if self.coalesce and (self.io_threads > 1 or not self.readahead) and len(ids):
            layout = self.direct_layout()
            if layout is not None:
                if ids.min() < 0 or ids.max() >= self.info.num_samples:
                    raise IndexError(f"sample ids must be in 0..{self.info.num_samples - 1}")
                return self._read_direct(ids, layout)
        out = {}
        for key in self.keys:
            if self.coalesce:
                rows, nbytes, requests = read_coalesced(f[key], ids, self.max_gap)
            else:
                rows = read_per_sample(f[key], ids)
                nbytes, requests = rows.nbytes, len(rows)
            out[key] = rows
            self.bytes_read += nbytes
            self.requests += requests
        return out

    def close(self) -> None:
        """Close the file if this process opened it."""
        if self._file is not None and self._pid == os.getpid():
            if self._pool is not None:
                self._pool.shutdown()
            self._file.close()
            if self._raw is not None:
                self._raw.close()
        self._file = self._raw = self._pool = self._layout = None
