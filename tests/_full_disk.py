"""A full disk for fault tests: a small tmpfs mounted for one test (root only) and unmounted after it.

``small_disk(folder, kib)`` yields a folder on a file system of ``kib`` KiB, or ``None`` where mounting is not
possible (not root, no ``mount``, no permission in this container): the caller then emulates the full disk by
making the write raise ``ENOSPC``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def small_disk(folder: Path, kib: int) -> Iterator[Path | None]:
    """Mount a ``kib`` KiB tmpfs on ``folder/small_disk`` for the block; ``None`` when it cannot be mounted."""
    mount_point = folder / "small_disk"
    mount_point.mkdir()
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if os.name != "posix" or os.geteuid() != 0 or mount is None or umount is None:
        yield None
        return
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", f"size={kib}k,mode=0755", "tmpfs", str(mount_point)], capture_output=True
    )
    if done.returncode != 0:
        yield None
        return
    try:
        yield mount_point
    finally:
        # a writer that failed may still hold a file open there (torch's trace writer does): detach lazily then
        if subprocess.run([umount, str(mount_point)], capture_output=True).returncode != 0:
            subprocess.run([umount, "-l", str(mount_point)], check=True, capture_output=True)
