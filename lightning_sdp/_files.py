"""Files the package writes and reads: whole or not at all, and errors that name the file.

Writing (:func:`atomic_path`, :func:`write_text_atomic`, :func:`write_bytes_atomic`): the content is written into a
fresh private folder beside the target (``tempfile.mkdtemp``: unpredictable name, mode 0700, so nothing can be
planted in it) and renamed over the target with ``os.replace``, which is atomic on one file system: a reader finds
the old content or the new, never a part. The folder, with whatever a writer left in it (torch's trace export
writes its own ``.tmp`` files beside the name it is given), is removed whatever happens, so a failure (a full disk,
an exception, an interrupt) leaves no partial file. New files get the mode ``open()`` would give them (the kernel
applies the process umask when the writer creates the file; the umask is never read or changed), or 0600 for
``private`` ones.

Reading (:func:`naming_the_file`): decoding and parsing errors that do not say which file they come from
(``UnicodeDecodeError``, ``csv.Error``, an ``OSError`` without a file name) are raised again with the file, the line
where known, and what to do.
"""

from __future__ import annotations

import contextlib
import csv
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

__all__ = ["atomic_path", "naming_the_file", "utf8_lines", "write_bytes_atomic", "write_text_atomic"]


@contextlib.contextmanager
def atomic_path(path: str | Path, private: bool = False) -> Iterator[Path]:
    """A temporary path to write ``path``'s new content to; renamed to ``path`` when the block ends without error.

    Args:
        path: the target file; its folder must exist.
        private: give the file mode 0600 (readable by the owner only) instead of ``open()``'s default.

    Yields:
        ``<private temporary folder beside path>/<path's name>``: create the file there (with ``open``, ``torch.save``,
        ``h5py``...). The block must leave a file at that path.

    Raises:
        OSError: the folder is not writable, the disk is full...; the message names ``path``, which keeps its earlier
            content (if any), and nothing else is left behind.
    """
    path = Path(path)
    try:
        folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as err:
        raise _naming(err, path) from err
    try:
        tmp = folder / path.name
        yield tmp
        try:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            if private:
                os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except OSError as err:
            raise _naming(err, path) from err
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def write_bytes_atomic(path: str | Path, data: bytes, private: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_path`); returns ``path`` as a :class:`Path`."""
    path = Path(path)
    with atomic_path(path, private=private) as tmp:
        try:
            tmp.write_bytes(data)
        except OSError as err:
            raise _naming(err, path) from err
    return path


def write_text_atomic(path: str | Path, text: str, private: bool = False) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_path`); returns ``path`` as a :class:`Path`."""
    return write_bytes_atomic(path, text.encode("utf-8"), private=private)


def _naming(err: OSError, path: Path) -> OSError:
    """``err`` with ``path`` as its file name (an ``OSError`` from ``write`` or ``fsync`` names none)."""
    if err.filename is not None or err.errno is None:
        return err
    return type(err)(err.errno, f"{err.strerror} (writing {path})", str(path))


@contextlib.contextmanager
def naming_the_file(path: str | Path, line: Callable[[], int | None] | None = None, hint: str = "") -> Iterator[None]:
    """Raise decoding and parsing errors met while reading ``path`` again as ``ValueError``s naming the file.

    Args:
        path: the file being read.
        line: returns the current line number (for example ``lambda: reader.line_num`` of a ``csv.reader``), or
            ``None`` when unknown.
        hint: what to do, appended to the message (e.g. which option sets the separator).

    Raises:
        ValueError: for a ``UnicodeDecodeError`` (not UTF-8: the byte and its offset) or a ``csv.Error`` (a field
            over csv's size limit, a bad quote...), naming ``path`` and the line.
        OSError: an ``OSError`` without a file name, with ``path`` as its file name.
    """
    path = Path(path)
    try:
        yield
    except UnicodeDecodeError as err:
        bad = err.object[err.start : err.start + 1]
        raise ValueError(
            f"{_where(path, line)}: not UTF-8 (byte {bad!r} at offset {err.start} of the text decoded): the file is in "
            f"another encoding, e.g. latin-1 or cp1252. Convert it to UTF-8 (`iconv -f latin1 -t utf-8`).{_hint(hint)}"
        ) from err
    except csv.Error as err:
        advice = ""
        if "field larger than field limit" in str(err):
            advice = (
                f" A field is longer than csv's limit of {csv.field_size_limit()} characters: usually a wrong "
                "separator or an unclosed quote that runs to the end of the file."
            )
        raise ValueError(f"{_where(path, line)}: cannot parse the file as CSV ({err}).{advice}{_hint(hint)}") from err
    except OSError as err:
        if err.filename is not None or err.errno is None:
            raise
        raise type(err)(err.errno, f"{err.strerror} (reading {path})", str(path)) from err


def utf8_lines(lines: Iterable[bytes], path: str | Path, hint: str = "") -> Iterator[str]:
    """Decode the lines of a file opened in binary mode, naming ``path`` and the exact line of a byte that is not
    UTF-8 (a text-mode file decodes whole chunks ahead of the line being parsed). Feed it to ``csv.reader``."""
    for number, raw in enumerate(lines, 1):
        with naming_the_file(path, line=lambda: number, hint=hint):  # noqa: B023 - used before the next line
            yield raw.decode("utf-8")


def _where(path: Path, line: Callable[[], int | None] | None) -> str:
    number = line() if line is not None else None
    return f"{path}:{number}" if number else str(path)


def _hint(hint: str) -> str:
    return f" {hint}" if hint else ""
