"""Real, loader-independent slow storage for benchmarks: a loop-device file system throttled by a cgroup.

:class:`ThrottledStorage` (a context manager) creates a sparse image file, attaches it to a loop device, formats it
ext4, mounts it, and creates a cgroup (v1 ``blkio`` + ``memory``, or v2 ``io`` + ``memory``: see
:mod:`benchmarks.tools.cgroups`) limiting reads of the loop device's ``MAJ:MIN`` in bytes and requests per second.
Commands started with :meth:`ThrottledStorage.run` (and their children) read the mounted files at the limited rate,
whatever loader they use; the controlling process stays outside the group so that it can always clean up. Inside, a
command gets a :class:`ThrottleGroup` from :meth:`ThrottleGroup.from_env`. :meth:`ThrottleGroup.drop_caches` empties
the page cache (``echo 3 > /proc/sys/vm/drop_caches`` plus ``posix_fadvise(DONTNEED)`` on every file of the mount)
so each epoch reads from the device again; :meth:`ThrottleGroup.device_read_bytes` and
:meth:`ThrottleGroup.device_read_requests` read what the device served the group; :meth:`ThrottleGroup.cap_memory`
caps the group's memory, page cache included. Everything is undone on exit, on exceptions and on SIGINT/SIGTERM
(unmount, detach, remove the group and the image); what a SIGKILLed run left, the next run removes
(:func:`reap_stale`).

Needs root, ``losetup``, ``mkfs.ext4``, ``mount`` and a cgroup hierarchy with an io (v2) or blkio (v1)
controller. Without them it raises :class:`PermissionError` (the CLI prints the reason and exits 2). The in-process
doubles of :mod:`benchmarks.tools.storage` are for tests and machines without root.

CLI::

    python -m benchmarks.tools.device --bps 40MB --iops 400 --size 512MiB \\
        --copy data.h5 -- python my_bench.py /mnt/point/data.h5

The command sees ``SOLAR_THROTTLED_MOUNT`` (the mount point), ``SOLAR_THROTTLED_CGROUP`` (the io/blkio group folder),
``SOLAR_THROTTLED_MEMCG`` (the memory group folder), ``SOLAR_THROTTLED_CGROUP_VERSION`` and
``SOLAR_THROTTLED_MAJMIN``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.tools.cgroups import V1_BLKIO, V1_MEMORY, V2_ROOT, Cgroups, available_version

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_bytes(text: str | int) -> int:
    """``"40MB"`` -> 40_000_000, ``"512MiB"`` -> 536_870_912, ints unchanged."""
    if isinstance(text, int):
        return text
    s = text.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :].strip()
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot parse byte size {text!r}; use e.g. 40MB, 512MiB")
    return int(float(num) * _UNITS[unit])


def _sh(*cmd: str) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


def check_root() -> None:
    """Raise ``PermissionError`` with what is needed when this process cannot build the throttled device."""
    if os.geteuid() != 0:
        raise PermissionError(
            "throttled storage needs root (loop device, mount, cgroup); run the benchmark as root, or use "
            "the in-process throttle (benchmarks.tools.storage.ThrottledReader, as benchmarks/solar_loading.py does) "
            "instead"
        )
    if available_version() is None:
        raise PermissionError(
            "no cgroup hierarchy with an io (v2) or blkio (v1) controller; throttled storage needs one"
        )
    for tool in ("losetup", "mkfs.ext4", "mount", "umount", "blockdev"):
        if shutil.which(tool) is None:
            raise PermissionError(f"{tool} is not installed; throttled storage needs it")


class ThrottleGroup:
    """The cgroup of a throttled device as seen from a process running inside it (see :meth:`from_env`).

    Args:
        blkio: the v1 blkio group folder, or the v2 group folder.
        memcg: the v1 memory group folder (the v2 group folder), or ``None``.
        majmin: the device's ``MAJ:MIN``.
        mount: the mount point.
        version: the cgroup version, 1 or 2. Default 1.
    """

    def __init__(self, blkio: Path, memcg: Path | None, majmin: str, mount: Path, version: int = 1) -> None:
        self.cgroups = Cgroups(Path(blkio), Path(memcg) if memcg else None, version)
        self.majmin, self.mount = majmin, Path(mount)

    @classmethod
    def from_env(cls) -> ThrottleGroup | None:
        """The group :meth:`ThrottledStorage.run` started this process in, or ``None`` outside one."""
        env = os.environ
        if "SOLAR_THROTTLED_CGROUP" not in env:
            return None
        memcg = env.get("SOLAR_THROTTLED_MEMCG") or None
        return cls(
            Path(env["SOLAR_THROTTLED_CGROUP"]),
            Path(memcg) if memcg else None,
            env["SOLAR_THROTTLED_MAJMIN"],
            Path(env["SOLAR_THROTTLED_MOUNT"]),
            int(env.get("SOLAR_THROTTLED_CGROUP_VERSION", "1")),
        )

    def device_read_bytes(self) -> int:
        """Bytes the throttled device has served to this group's processes (cumulative)."""
        return self.cgroups.device_reads(self.majmin)[0]

    def device_read_requests(self) -> int:
        """Read requests the device has served to this group's processes (cumulative)."""
        return self.cgroups.device_reads(self.majmin)[1]

    def drop_caches(self) -> None:
        """Empty the page cache of the mount's files (``drop_caches`` plus ``POSIX_FADV_DONTNEED`` per file)."""
        drop_caches(self.mount)

    def limit_memory(self, headroom: int | None) -> None:
        """Cap the group's memory (anonymous + page cache) at its current use plus ``headroom`` bytes.

        This is how "the data is larger than memory" is made true for a small file: the page cache can then hold
        at most about ``headroom`` bytes of the file, the same for every loader (a loader's own buffer counts
        against the same headroom). ``None`` lifts the cap. A process that needs more than the cap is OOM-killed,
        which is why the controlling process stays outside the group.
        """
        self.cap_memory(None if headroom is None else self.cgroups.memory_usage() + int(headroom))

    def cap_memory(self, limit: int | None) -> None:
        """Cap the group's memory, anonymous and page cache together, at ``limit`` bytes (``None``: no cap)."""
        self.cgroups.set_memory_limit(limit)

    def memory_usage(self) -> int:
        """Bytes charged to the group now (anonymous memory plus page cache); 0 without a memory controller."""
        return self.cgroups.memory_usage() if self.cgroups.memory_dir is not None else 0

    def memory_peak(self) -> int:
        """Most bytes charged to the group at once (see :meth:`Cgroups.reset_memory_peak`)."""
        return self.cgroups.memory_peak()

    def oom_kills(self) -> int:
        """Processes of the group killed for exceeding the memory cap (cumulative)."""
        return self.cgroups.oom_kills()


def drop_caches(mount: Path) -> None:
    """Empty the page cache: ``sync``, ``echo 3 > /proc/sys/vm/drop_caches`` and ``POSIX_FADV_DONTNEED`` on every
    file under ``mount``."""
    os.sync()
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("3")
    for root, _, files in os.walk(mount):
        for fname in files:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(root, fname), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(text: str) -> int | None:
    """The pid a group name (``<name>_<pid>``) or an ``owner`` file names, or ``None``."""
    tail = text.strip().rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else None


def reap_stale(
    name: str = "solar_bench",
    tmp_dir: Path | None = None,
    cgroup_roots: Sequence[Path] = (V1_BLKIO, V1_MEMORY, V2_ROOT),
) -> list[str]:
    """Remove what a killed :class:`ThrottledStorage` left (its owner process is gone): its cgroups (their
    processes killed first), its mount, loop device and image. A run that is SIGKILLed cannot clean up after itself;
    the next one does. Returns what was removed."""
    removed = []
    for root in cgroup_roots:
        for group in sorted(root.glob(f"{name}_*")) if root.is_dir() else []:
            owner = _owner(group.name)
            if owner is None or _alive(owner) or not group.is_dir():
                continue
            procs = group / "cgroup.procs"
            for pid in procs.read_text().split() if procs.exists() else []:
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
            for _ in range(50):
                try:
                    group.rmdir()
                    removed.append(str(group))
                    break
                except OSError:
                    time.sleep(0.1)
    for workdir in sorted(Path(tmp_dir or tempfile.gettempdir()).glob("throttled_*")):
        owner_file = workdir / "owner"
        owner = _owner(owner_file.read_text()) if owner_file.exists() else None
        if owner is None or _alive(owner):
            continue
        mount = workdir / "mnt"
        if os.path.ismount(mount):
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)
        image = workdir / "disk.img"
        if image.exists() and shutil.which("losetup"):
            listed = subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True).stdout
            for loop in (line.split(":", 1)[0] for line in listed.splitlines() if line.strip()):
                subprocess.run(["losetup", "-d", loop], capture_output=True)
        shutil.rmtree(workdir, ignore_errors=True)
        removed.append(str(workdir))
    return removed


class ThrottledStorage:
    """A throttled loop-device file system; use as ``with ThrottledStorage(...) as st:``.

    Args:
        size: image size in bytes (or ``"512MiB"``). Default 512 MiB.
        read_bps: read bandwidth limit in bytes/s (or ``"40MB"``); 0 = none. Default 40 MB/s.
        read_iops: read requests per second; 0 = none. Default 400.
        readahead_kb: the loop device's readahead in KiB (``read_ahead_kb``); ``None`` keeps the kernel's value.
        workdir: where the image and the mount point go. Default a new temporary folder.
        name: cgroup name prefix. Default ``"solar_bench"``.
    """

    def __init__(
        self,
        size: int | str = "512MiB",
        read_bps: int | str = "40MB",
        read_iops: int = 400,
        readahead_kb: int | None = None,
        workdir: str | os.PathLike | None = None,
        name: str = "solar_bench",
    ) -> None:
        self.size = parse_bytes(size)
        self.read_bps = parse_bytes(read_bps)
        self.read_iops = int(read_iops)
        self.readahead_kb = readahead_kb
        self._workdir_arg = workdir
        self.name = name
        self.workdir: Path | None = None
        self.image: Path | None = None
        self.mount: Path | None = None
        self.loop: str | None = None
        self.majmin: str | None = None
        self.cgroups: Cgroups | None = None
        self._old_handlers: dict[int, Any] = {}
        self._own_workdir = False

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> ThrottledStorage:
        check_root()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._create()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()

    def _on_signal(self, signum: int, frame: Any) -> None:
        # A Ctrl-C reaches the whole process group, sometimes twice (``timeout`` forwards it too): a second signal
        # must not interrupt this clean-up half way.
        for sig in self._old_handlers:
            signal.signal(sig, signal.SIG_IGN)
        self.cleanup()
        raise SystemExit(128 + signum)

    def _create(self) -> None:
        for leftover in reap_stale(self.name):
            print(f"ThrottledStorage: removed {leftover}, left by a run that was killed", file=sys.stderr)
        if self._workdir_arg is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="throttled_"))
            (self.workdir / "owner").write_text(str(os.getpid()))  # lets a later run reap it if this one is killed
            self._own_workdir = True
        else:
            self.workdir = Path(self._workdir_arg)
            self.workdir.mkdir(parents=True, exist_ok=True)
        self.image = self.workdir / "disk.img"
        self.mount = self.workdir / "mnt"
        self.mount.mkdir(exist_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(self.size)
        self.loop = _sh("losetup", "--find", "--show", str(self.image)).strip()
        _sh("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", self.loop)
        _sh("mount", "-o", "noatime", self.loop, str(self.mount))
        dev = os.stat(self.loop).st_rdev
        self.majmin = f"{os.major(dev)}:{os.minor(dev)}"
        if self.readahead_kb is not None:
            self._queue_file("read_ahead_kb").write_text(str(int(self.readahead_kb)))
        self.cgroups = Cgroups.create(f"{self.name}_{os.getpid()}")
        self.set_limits(self.read_bps, self.read_iops)

    def set_limits(self, read_bps: int, read_iops: int) -> None:
        """Change the limits (0 removes one)."""
        assert self.cgroups is not None and self.majmin is not None
        self.read_bps, self.read_iops = int(read_bps), int(read_iops)
        self.cgroups.set_read_limits(self.majmin, self.read_bps, self.read_iops)

    def _queue_file(self, name: str) -> Path:
        assert self.loop is not None
        return Path("/sys/block") / Path(self.loop).name / "queue" / name

    def cleanup(self) -> None:
        """Move our processes out, remove the cgroups, unmount, detach and delete the image (idempotent)."""
        if self.cgroups is not None:
            self.cgroups.remove()
            self.cgroups = None
        self._unmount_and_detach()
        self._remove_files()
        for sig, handler in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        self._old_handlers = {}

    def _unmount_and_detach(self) -> None:
        """Unmount (lazily after 5 s of a busy mount) and detach the loop device."""
        if self.mount is not None and os.path.ismount(self.mount):
            for _ in range(20):
                if subprocess.run(["umount", str(self.mount)], capture_output=True).returncode == 0:
                    break
                time.sleep(0.25)
            else:
                subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)
        if self.loop is not None:
            subprocess.run(["losetup", "-d", self.loop], capture_output=True)
            self.loop = None

    def _remove_files(self) -> None:
        """Delete the working folder if this object made it, else only the image in it."""
        if self.workdir is None:
            return
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        elif self.image is not None:
            with contextlib.suppress(OSError):
                self.image.unlink()
        self.workdir = None

    # ------------------------------------------------------------------ use
    @property
    def group(self) -> ThrottleGroup:
        """Counters, cache dropping and the memory cap of the group (usable from this, the controlling, process)."""
        assert self.cgroups is not None and self.majmin is not None and self.mount is not None
        cg = self.cgroups
        return ThrottleGroup(cg.io_dir, cg.memory_dir, self.majmin, self.mount, cg.version)

    def copy_in(self, src: str | os.PathLike, name: str | None = None) -> Path:
        """Copy a file onto the throttled file system (unthrottled: the controlling process is not in the group)."""
        assert self.mount is not None
        dst = self.mount / (name or Path(src).name)
        shutil.copyfile(src, dst)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())
        return dst

    def drop_caches(self) -> None:
        """See :meth:`ThrottleGroup.drop_caches`."""
        self.group.drop_caches()

    def device_read_bytes(self) -> int:
        """See :meth:`ThrottleGroup.device_read_bytes`."""
        return self.group.device_read_bytes()

    def device_read_requests(self) -> int:
        """See :meth:`ThrottleGroup.device_read_requests`."""
        return self.group.device_read_requests()

    def facts(self) -> dict[str, Any]:
        """Limits and device settings, for results files."""
        queue = {}
        for key in ("read_ahead_kb", "max_sectors_kb", "scheduler", "rotational"):
            with contextlib.suppress(OSError, AssertionError):
                queue[key] = self._queue_file(key).read_text().strip()
        return {
            "loop_device": self.loop,
            "maj_min": self.majmin,
            "read_bps": self.read_bps,
            "read_iops": self.read_iops,
            "read_ahead_kb": int(queue["read_ahead_kb"]) if "read_ahead_kb" in queue else None,
            "max_sectors_kb": int(queue["max_sectors_kb"]) if "max_sectors_kb" in queue else None,
            "scheduler": queue.get("scheduler"),
            "image_bytes": self.size,
            "filesystem": "ext4 on loop",
            "cgroup_version": self.cgroups.version if self.cgroups is not None else None,
            "kernel": os.uname().release,
        }

    def env(self) -> dict[str, str]:
        """The environment variables :meth:`ThrottleGroup.from_env` reads."""
        assert self.cgroups is not None
        return {
            "SOLAR_THROTTLED_MOUNT": str(self.mount),
            "SOLAR_THROTTLED_CGROUP": str(self.cgroups.io_dir),
            "SOLAR_THROTTLED_MEMCG": str(self.cgroups.memory_dir or ""),
            "SOLAR_THROTTLED_CGROUP_VERSION": str(self.cgroups.version),
            "SOLAR_THROTTLED_MAJMIN": str(self.majmin),
        }

    def group_join(self) -> None:
        """Put the calling process into the groups (use as ``preexec_fn`` of a child; never in the controller)."""
        assert self.cgroups is not None
        self.cgroups.join(os.getpid())

    def run(self, cmd: Sequence[str], env: dict[str, str] | None = None) -> int:
        """Run ``cmd`` inside the group (its children too) and return its exit status."""
        assert self.cgroups is not None and self.mount is not None
        full_env = {**os.environ, **(env or {})}
        full_env.update(self.env())
        proc = subprocess.Popen(list(cmd), env=full_env, preexec_fn=self.group_join)
        try:
            return proc.wait()
        except BaseException:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
            raise


@contextlib.contextmanager
def throttled(**kwargs: Any) -> Iterator[ThrottledStorage]:
    """``with throttled(read_bps="40MB", read_iops=400) as st:`` (see :class:`ThrottledStorage`)."""
    with ThrottledStorage(**kwargs) as st:
        yield st


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a command on a throttled loop-device file system.")
    parser.add_argument("--size", default="512MiB", help="image size (default 512MiB)")
    parser.add_argument("--bps", default="40MB", help="read bandwidth limit (default 40MB/s; 0 = none)")
    parser.add_argument("--iops", type=int, default=400, help="read requests/s limit (default 400; 0 = none)")
    parser.add_argument("--readahead-kb", type=int, default=None, help="loop device readahead (default: kernel's)")
    parser.add_argument("--copy", nargs="*", default=[], help="files to copy onto the device first")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command to run inside the throttled group")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if not cmd:
        parser.error("give a command after --")
    try:
        with ThrottledStorage(args.size, args.bps, args.iops, args.readahead_kb) as st:
            for src in args.copy:
                st.copy_in(src)
            st.drop_caches()
            print(f"throttled storage: {st.facts()} mounted at {st.mount}", file=sys.stderr, flush=True)
            rc = st.run(cmd)
            print(
                f"device read {st.device_read_bytes() / 2**20:.1f} MiB in {st.device_read_requests()} requests",
                file=sys.stderr,
            )
            return rc
    except PermissionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
