"""EngineProfiler's output files: the folder check at setup, the checked trace export, and the closing message.

Reports are JSON written atomically (:func:`~lightning_sdp._files.write_text_atomic`). The Chrome trace is exported
by torch; :func:`export_trace` checks what torch wrote before the report names the file, because a failed export can
otherwise leave an empty or truncated ``.gz`` under the final name (or torch's own ``.tmp`` files beside it).
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
from pathlib import Path
from typing import Any

from lightning_sdp._files import atomic_path


class TraceExportError(OSError):
    """The profiler's Chrome trace could not be written or does not read back (the message says why)."""


def check_writable(path: Path, given: bool) -> None:
    """Create ``path`` and write a probe file in it; raise a clear ``OSError`` at setup rather than mid-training.

    Args:
        path: the output folder.
        given: whether the user passed it as ``dirpath`` (named so in the message) or it is the default.
    """
    what = "dirpath" if given else "the default output folder (<log_dir>/engine_profiler)"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".engine_profiler_probe_") as probe:
            probe.write(b"probe")
    except OSError as err:
        raise OSError(
            f"EngineProfiler: cannot write to {what} {str(path)!r} ({type(err).__name__}: {err.strerror or err}). "
            "Pass `dirpath=` a folder this process can create and write, or fix the folder's permissions."
        ) from err


def export_trace(prof: Any, path: Path, max_bytes: int | None = None) -> Path:
    """Write the profiler's Chrome trace to ``path`` (gzip) and check that it reads back.

    torch writes the trace as plain JSON into a private temporary folder beside ``path`` (where it may also create
    files of its own), which is compressed in large blocks at a fast level (torch's own ``.gz`` export compresses
    line by line, in many small writes) into a temporary file that is renamed to ``path`` only once it is non-empty,
    within ``max_bytes`` and decompresses to what torch wrote (:func:`~lightning_sdp._files.atomic_path`). The
    temporary folders are removed whatever happens, and so is an earlier file at ``path``, so that a file of that
    name is always this export's.

    Args:
        prof: a stopped ``torch.profiler.profile``.
        path: the ``.pt.trace.json.gz`` file to write; its folder must exist.
        max_bytes: largest compressed trace to keep; ``None``: no bound.

    Returns:
        ``path``.

    Raises:
        TraceExportError: torch's export raised or wrote nothing readable, compressing failed, or the trace is larger
            than ``max_bytes``; the message says which and why.
    """
    try:
        with tempfile.TemporaryDirectory(
            prefix=f".{path.name}.", suffix=".tmp", dir=path.parent, ignore_cleanup_errors=True
        ) as folder:
            raw = Path(folder) / "trace.json"
            try:
                prof.export_chrome_trace(str(raw))
            except Exception as err:
                raise TraceExportError(f"torch's export_chrome_trace failed ({type(err).__name__}: {err})") from err
            head = _check_json_start(raw)
            try:
                with atomic_path(path) as packed:
                    _compress(raw, packed, head, max_bytes)
            except OSError as err:
                if isinstance(err, TraceExportError):
                    raise
                raise TraceExportError(f"compressing the trace failed ({type(err).__name__}: {err})") from err
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def _compress(raw: Path, packed: Path, head: bytes, max_bytes: int | None) -> None:
    """gzip ``raw`` into ``packed``; raise unless the result is within ``max_bytes`` and starts with ``head``."""
    try:
        with open(raw, "rb") as src, gzip.open(packed, "wb", compresslevel=1) as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
        size = packed.stat().st_size
        with gzip.open(packed, "rb") as check:
            readback = check.read(len(head))
    except EOFError as err:
        raise TraceExportError(f"compressing the trace failed ({type(err).__name__}: {err})") from err
    if max_bytes is not None and size > max_bytes:
        raise TraceExportError(
            f"the compressed trace has {size / 2**20:.1f} MiB, over the bound of {max_bytes / 2**20:.1f} MiB "
            "(max_trace_mb); not kept"
        )
    if readback != head:
        raise TraceExportError("the compressed trace does not read back as the trace torch wrote")


def _check_json_start(raw: Path, size: int = 64) -> bytes:
    """The first bytes of torch's plain trace; raise unless the file is there, non-empty and starts as JSON."""
    try:
        with open(raw, "rb") as fh:
            head = fh.read(size)
    except FileNotFoundError as err:
        free = shutil.disk_usage(raw.parent).free
        raise TraceExportError(
            f"torch wrote no trace file ({free / 2**20:.1f} MiB free in {raw.parent.parent}; torch's trace writer "
            "fails without raising, e.g. on a full disk)"
        ) from err
    except OSError as err:
        raise TraceExportError(f"torch's trace cannot be read back ({type(err).__name__}: {err})") from err
    if not head:
        raise TraceExportError("torch wrote an empty trace (0 bytes)")
    if head.lstrip()[:1] not in (b"{", b"["):
        raise TraceExportError(f"torch's trace is not JSON (it starts with {head[:16]!r})")
    return head


def closing_message(folder: Path, files: list[Path], traces: int, world_size: int, ceilings: str | None) -> str:
    """The lines EngineProfiler logs once at the end: where its files are and where the device ceilings came from.

    Args:
        folder: the output folder.
        files: the files rank 0 wrote there (reports, pictures), in the order written.
        traces: how many Chrome traces rank 0 wrote.
        world_size: number of ranks (each rank writes its own ``-rank<R>`` files).
        ceilings: one sentence on the machine ceilings (measured now / read from the cache / not measured), or
            ``None`` to leave it out.
    """
    names = list(dict.fromkeys(p.name for p in files))
    if traces:
        names.append(f"{traces} Chrome trace{'s' if traces > 1 else ''} (*.pt.trace.json.gz)")
    lines = [f"EngineProfiler: files in {folder.resolve()}: {', '.join(names) if names else 'none'}."]
    if world_size > 1:
        lines.append(f"EngineProfiler: each of the {world_size} ranks writes its own -rank<R> files (on its own host).")
    if ceilings:
        lines.append(f"EngineProfiler: {ceilings}")
    return "\n".join(lines)
