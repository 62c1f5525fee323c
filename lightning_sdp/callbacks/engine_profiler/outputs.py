"""EngineProfiler's output files: the folder check at setup, the checked trace export, and the closing message.

Reports are JSON written atomically (:func:`~lightning_sdp.profiling.files.write_text_atomic`). The Chrome trace
is exported by torch; :func:`export_trace` checks what torch wrote before the report names the file, because a
failed export can otherwise leave an empty or truncated ``.gz`` under the final name.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import Any

from lightning_sdp.profiling.files import default_file_mode


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
        fd, probe = tempfile.mkstemp(dir=path, prefix=".engine_profiler_probe_")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise OSError(
            f"EngineProfiler: cannot write to {what} {str(path)!r} ({type(err).__name__}: {err.strerror or err}). "
            "Pass `dirpath=` a folder this process can create and write, or fix the folder's permissions."
        ) from err


def export_trace(prof: Any, path: Path) -> Path:
    """Write the profiler's Chrome trace to ``path`` (gzip) and check that it reads back.

    torch writes the trace as plain JSON to a temporary file in the same folder, which is then compressed in large
    blocks at a fast level into a second temporary file (torch's own ``.gz`` export compresses line by line, in
    many small writes); that one is renamed to ``path`` only once it is non-empty and decompresses to what torch
    wrote. Temporary files are removed whatever happens, and so is an earlier file at ``path``, so that a file of
    that name is always this export's.

    Args:
        prof: a stopped ``torch.profiler.profile``.
        path: the ``.pt.trace.json.gz`` file to write; its folder must exist.

    Returns:
        ``path``.

    Raises:
        TraceExportError: torch's export raised or wrote nothing readable, or compressing failed; the message says
            which and why.
    """
    raw = _mkstemp_closed(path, ".json.tmp")
    packed = _mkstemp_closed(path, ".gz.tmp")
    try:
        try:
            prof.export_chrome_trace(raw)
        except Exception as err:
            raise TraceExportError(f"torch's export_chrome_trace failed ({type(err).__name__}: {err})") from err
        head = _check_json_start(Path(raw))
        try:
            with open(raw, "rb") as src, gzip.open(packed, "wb", compresslevel=1) as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
            with gzip.open(packed, "rb") as check:
                readback = check.read(len(head))
        except (OSError, EOFError) as err:
            raise TraceExportError(f"compressing the trace failed ({type(err).__name__}: {err})") from err
        if readback != head:
            raise TraceExportError("the compressed trace does not read back as the trace torch wrote")
        os.chmod(packed, default_file_mode())
        os.replace(packed, path)
    except BaseException:
        with suppress(OSError):
            path.unlink(missing_ok=True)
        raise
    finally:
        for tmp in (raw, packed):
            with suppress(OSError):
                Path(tmp).unlink(missing_ok=True)
    return path


def _mkstemp_closed(path: Path, suffix: str) -> str:
    """A new, empty temporary file beside ``path`` (hidden, unpredictable name); returns its path."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    except OSError as err:
        raise TraceExportError(f"cannot create a file in {path.parent} ({type(err).__name__}: {err})") from err
    os.close(fd)
    return tmp


def _check_json_start(raw: Path, size: int = 64) -> bytes:
    """The first bytes of torch's plain trace; raise unless the file is there, non-empty and starts as JSON."""
    try:
        with open(raw, "rb") as fh:
            head = fh.read(size)
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
