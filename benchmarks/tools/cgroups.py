"""The cgroup files the throttled-storage arena uses, for cgroup v1 (``blkio`` + ``memory``) and v2 (``io`` +
``memory`` in one group).

Both versions charge the page cache to the group whose process read the pages, so a memory limit bounds what a
loader keeps in its own buffers *and* in the page cache. Only paths and counters are handled here; creating the loop
device and mounting it is :mod:`benchmarks.tools.device`.

=========================  ==================================  ======================================
what                       v1                                  v2
=========================  ==================================  ======================================
read limits                ``blkio.throttle.read_{bps,iops}``   ``io.max`` (``rbps=... riops=...``)
device reads               ``blkio.throttle.io_service*``       ``io.stat`` (``rbytes=... rios=...``)
memory limit               ``memory.limit_in_bytes``            ``memory.max``
memory now / peak          ``memory.(max_)usage_in_bytes``      ``memory.current`` / ``memory.peak``
page cache, mapped, shm    ``memory.stat`` (``total_*``)         ``memory.stat``
OOM kills                  ``memory.oom_control`` (oom_kill)    ``memory.events`` (oom_kill)
=========================  ==================================  ======================================
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

V1_BLKIO = Path("/sys/fs/cgroup/blkio")
V1_MEMORY = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


def available_version(v1_blkio: Path = V1_BLKIO, v1_memory: Path = V1_MEMORY, v2_root: Path = V2_ROOT) -> int | None:
    """2 where the unified hierarchy offers ``io`` and ``memory``, else 1 where v1 has ``blkio`` (and ``memory``),
    else ``None``."""
    with contextlib.suppress(OSError):
        if {"io", "memory"} <= set((v2_root / "cgroup.controllers").read_text().split()):
            return 2
    if (v1_blkio / "blkio.throttle.read_bps_device").exists():
        return 1
    return None


def _keyed(text: str, device: str, keys: tuple[str, ...]) -> list[int]:
    """Values of ``keys`` on the line of ``device`` in an ``io.stat``-style file (0 where absent)."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == device:
            fields = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
            return [int(fields.get(k, 0)) for k in keys]
    return [0 for _ in keys]


def _v1_reads(text: str, device: str) -> int:
    """The ``Read`` value of ``device`` in a v1 ``blkio.throttle.io_service*`` file."""
    total = 0
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == device and parts[1] == "Read":
            total += int(parts[2])
    return total


class Cgroups:
    """One group of processes whose device reads are limited and counted and whose memory is capped.

    Args:
        io_dir: the v1 blkio group, or the v2 group.
        memory_dir: the v1 memory group (``None``: no memory controller), or the v2 group (the same as ``io_dir``).
        version: 1 or 2.
    """

    def __init__(self, io_dir: Path, memory_dir: Path | None, version: int) -> None:
        if version not in (1, 2):
            raise ValueError(f"cgroup version must be 1 or 2, got {version}")
        self.io_dir, self.memory_dir, self.version = Path(io_dir), memory_dir and Path(memory_dir), version

    # ------------------------------------------------------------------ life cycle
    @classmethod
    def create(cls, name: str, version: int | None = None) -> Cgroups:
        """Make the group(s) ``name`` (the io/blkio and memory controllers).

        Raises:
            PermissionError: no cgroup hierarchy with an io/blkio controller, or no right to create groups.
        """
        version = version or available_version()
        if version is None:
            raise PermissionError(
                f"no cgroup hierarchy with an io or blkio controller ({V2_ROOT}/cgroup.controllers lacks io and "
                f"memory; {V1_BLKIO} has no blkio.throttle files)"
            )
        if version == 2:
            control = V2_ROOT / "cgroup.subtree_control"
            enabled = set(control.read_text().split())
            for controller in ("io", "memory"):
                if controller not in enabled:
                    control.write_text(f"+{controller}")
            group = V2_ROOT / name
            group.mkdir(exist_ok=True)
            return cls(group, group, 2)
        io_dir = V1_BLKIO / name
        io_dir.mkdir(exist_ok=True)
        memory_dir = None
        if (V1_MEMORY / "memory.limit_in_bytes").exists():
            memory_dir = V1_MEMORY / name
            memory_dir.mkdir(exist_ok=True)
        return cls(io_dir, memory_dir, 1)

    def join(self, pid: int) -> None:
        """Move process ``pid`` (and so its future children) into the group(s)."""
        (self.io_dir / "cgroup.procs").write_text(str(pid))
        if self.version == 1 and self.memory_dir is not None:
            (self.memory_dir / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        """Processes in the group now."""
        return [int(p) for p in (self.io_dir / "cgroup.procs").read_text().split()]

    def kill_all(self, timeout: float = 10.0) -> int:
        """SIGKILL every process left in the group (a run's orphaned workers) and wait until it is empty; returns
        how many there were."""
        left = self.pids()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(left)

    def remove(self) -> None:
        """Move every process left to the root and remove the group(s) (retried for 5 s; idempotent)."""
        roots = [(self.io_dir, V2_ROOT if self.version == 2 else V1_BLKIO)]
        if self.version == 1 and self.memory_dir is not None:
            roots.append((self.memory_dir, V1_MEMORY))
        for group, root in roots:
            for _ in range(50):
                if not group.exists():
                    break
                try:
                    for pid in (group / "cgroup.procs").read_text().split():
                        with contextlib.suppress(OSError):
                            (root / "cgroup.procs").write_text(pid)
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)

    # ------------------------------------------------------------------ device
    def set_read_limits(self, device: str, read_bps: int, read_iops: int) -> None:
        """Limit reads of ``device`` (``MAJ:MIN``) to bytes and requests per second (0: no limit)."""
        if self.version == 2:
            bps = str(read_bps) if read_bps else "max"
            iops = str(read_iops) if read_iops else "max"
            (self.io_dir / "io.max").write_text(f"{device} rbps={bps} riops={iops}")
            return
        (self.io_dir / "blkio.throttle.read_bps_device").write_text(f"{device} {int(read_bps)}")
        (self.io_dir / "blkio.throttle.read_iops_device").write_text(f"{device} {int(read_iops)}")

    def device_reads(self, device: str) -> tuple[int, int]:
        """``(bytes, requests)`` the group's processes read from ``device`` (cumulative)."""
        if self.version == 2:
            nbytes, requests = _keyed((self.io_dir / "io.stat").read_text(), device, ("rbytes", "rios"))
            return nbytes, requests
        return (
            _v1_reads((self.io_dir / "blkio.throttle.io_service_bytes").read_text(), device),
            _v1_reads((self.io_dir / "blkio.throttle.io_serviced").read_text(), device),
        )

    # ------------------------------------------------------------------ memory
    def _memory(self, v1: str, v2: str) -> Path:
        if self.memory_dir is None:
            raise PermissionError("no memory controller for this group; cannot cap or read its memory")
        return self.memory_dir / (v2 if self.version == 2 else v1)

    def set_memory_limit(self, limit: int | None) -> None:
        """Cap the group's memory, anonymous and page cache together, at ``limit`` bytes (``None``: no cap)."""
        path = self._memory("memory.limit_in_bytes", "memory.max")
        path.write_text(("max" if self.version == 2 else "-1") if limit is None else str(int(limit)))

    def memory_usage(self) -> int:
        """Bytes charged to the group now (anonymous memory plus page cache)."""
        return int(self._memory("memory.usage_in_bytes", "memory.current").read_text())

    def memory_pinned(self) -> int:
        """Bytes charged now that the kernel cannot simply drop: all but the page cache that no process maps
        (anonymous memory, shared memory, mapped files such as loaded libraries, kernel memory)."""
        stat = {}
        for line in self._memory("memory.stat", "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            stat[key] = int(value)
        if self.version == 2:
            unmapped = stat.get("file", 0) - stat.get("file_mapped", 0) - stat.get("shmem", 0)
        else:
            unmapped = stat.get("total_cache", 0) - stat.get("total_mapped_file", 0) - stat.get("total_shmem", 0)
        return self.memory_usage() - max(0, unmapped)

    def memory_peak(self) -> int:
        """Most bytes charged at once since the group was made or :meth:`reset_memory_peak`."""
        return int(self._memory("memory.max_usage_in_bytes", "memory.peak").read_text())

    def reset_memory_peak(self) -> None:
        """Start :meth:`memory_peak` again from the current use (v2 before 6.12 cannot: the peak keeps counting)."""
        with contextlib.suppress(OSError):
            self._memory("memory.max_usage_in_bytes", "memory.peak").write_text("0")

    def oom_kills(self) -> int:
        """Processes of the group the kernel killed for exceeding its memory limit (cumulative)."""
        text = self._memory("memory.oom_control", "memory.events").read_text()
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "oom_kill":
                return int(parts[1])
        return 0
