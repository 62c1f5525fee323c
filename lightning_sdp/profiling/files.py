"""Writing result files so that a reader never finds a half-written one.

A file is written to a temporary file in the same folder (``tempfile.mkstemp``: an unpredictable name, created
exclusively) and renamed over the target with ``os.replace``, which is atomic on one file system: the target holds
either its old content or the new one, never a part. On failure the temporary file is removed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def default_file_mode() -> int:
    """The mode a plain ``open(path, "w")`` would give a new file under the current umask.

    ``mkstemp`` creates its file readable by the owner only; a result file renamed from it gets this mode instead.
    """
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder, then ``os.replace``).

    Args:
        path: the target file; its folder must exist.
        text: the whole content (UTF-8).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: the folder is not writable, the disk is full...; ``path`` keeps its earlier content (if any) and no
            temporary file is left behind.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
