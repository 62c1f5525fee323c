"""A fair arena for data loaders: the same throttled device and the same memory, enforced by the kernel.

Every training run is a child process (its DDP ranks and loader workers are its children) inside the cgroup of a
:class:`~benchmarks.tools.device.ThrottledStorage`: reads of the device are limited in bytes and requests per
second and counted by the cgroup, and the group's memory, **page cache included**, is capped at

    cap = baseline + budget

where ``baseline`` is the peak *pinned* memory of the same processes training on zeros instead of data (a ``null``
loader with as many worker processes, measured once per rank count and worker count): anonymous and shared memory,
mapped files (the loaded libraries) and kernel memory, but not the page cache no process maps, which the kernel drops
under the cap (the libraries' files read at import, the validation file). So a loader's data, in its buffers or in
the page cache, gets ``budget`` bytes and no more; ``budget`` is the loaders' shared memory budget. A loader that keeps more than the
budget in buffers, prefetched batches or page cache has it reclaimed (page cache) or is OOM-killed (its own memory),
and the run reports the kill. The page cache is dropped before every run. Conversions (``litdata.optimize``,
WebDataset shards) run in the group too, reading the source from the device: their time and device reads are
reported so that they can be charged to the loader that needs them.

Needs root (see :func:`benchmarks.tools.device.check_root`); without it :class:`Arena` raises
``PermissionError`` and the benchmarks print the reason and exit 2. The storage's context manager removes the groups,
the mount and the loop device on exit, on errors and on signals.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.tools.device import ThrottledStorage

SMOKE_SLACK = 64 * 2**20
"""Bytes every capped run of a benchmark's ``--quick`` form gets beyond baseline + budget alike: a smoke run's budget
(a few MiB) is smaller than a process's run-to-run memory noise."""
SMOKE_SLACK_NOTE = f" + {SMOKE_SLACK // 2**20} MiB for every run alike (smoke run: its budget is below memory noise)"
"""What a ``--quick`` page says about :data:`SMOKE_SLACK`."""


@dataclass
class ArenaRun:
    """What one child run cost, from the cgroup's counters.

    Args:
        rc: exit status (``"timeout"`` when it ran out of time).
        seconds: wall seconds of the whole child (start-up included).
        device_mib: MiB the device served the group during the run.
        device_requests: read requests the device served.
        memory_cap_mib: the cap the run had (``None``: uncapped).
        memory_peak_mib: most memory charged to the group at once (page cache included).
        pinned_peak_mib: most pinned memory (all but the unmapped page cache), sampled every 0.1 s.
        oom_kills: processes the kernel killed for exceeding the cap.
        orphans_killed: processes of the run still in the group after it ended (killed before the next run).
        stderr_tail: the end of the child's error output.
    """

    rc: int | str
    seconds: float
    device_mib: float
    device_requests: int
    memory_cap_mib: float | None
    memory_peak_mib: float
    pinned_peak_mib: float
    oom_kills: int
    orphans_killed: int = 0
    stderr_tail: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        """Finished with status 0 and nothing killed."""
        return self.rc == 0 and self.oom_kills == 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (``stderr_tail`` left out)."""
        out = asdict(self)
        out.pop("stderr_tail")
        return out


class Arena:
    """Runs commands in the throttled device's cgroup, each under ``baseline + budget_bytes`` of memory.

    Args:
        storage: an entered :class:`~benchmarks.tools.device.ThrottledStorage`.
        budget_bytes: the memory every loader gets on top of its processes' baseline (all ranks together).
        timeout: seconds a child may run.
        cwd: working folder of the children (the repository root, so ``-m benchmarks...`` resolves).
        slack_bytes: added to every cap alike: room for a process's run-to-run memory noise where the budget is
            smaller than that noise (the smoke runs' budgets of a few MiB). Default 0.
    """

    def __init__(
        self, storage: ThrottledStorage, budget_bytes: int, timeout: float, cwd: Path, slack_bytes: int = 0
    ) -> None:
        self.storage, self.budget_bytes, self.timeout, self.cwd = storage, int(budget_bytes), timeout, cwd
        self.slack_bytes = int(slack_bytes)
        self.group = storage.group
        if self.group.cgroups.memory_dir is None:
            raise PermissionError("the arena needs a memory cgroup controller to cap memory; none is mounted")
        self._baselines: dict[Any, int] = {}

    def run(self, cmd: Sequence[str], cap: int | None) -> ArenaRun:
        """Drop the page cache, then run ``cmd`` in the group with memory ``cap`` bytes (``None``: uncapped)."""
        group = self.group
        group.cap_memory(None)
        self.storage.drop_caches()
        group.cgroups.reset_memory_peak()
        group.cap_memory(cap)
        b0, r0, k0 = group.device_read_bytes(), group.device_read_requests(), group.oom_kills()
        start = time.perf_counter()
        rc, err, pinned = self._watch(cmd)
        seconds = time.perf_counter() - start
        orphans = group.cgroups.kill_all()
        run = ArenaRun(
            rc=rc,
            seconds=seconds,
            device_mib=(group.device_read_bytes() - b0) / 2**20,
            device_requests=group.device_read_requests() - r0,
            memory_cap_mib=None if cap is None else cap / 2**20,
            memory_peak_mib=group.memory_peak() / 2**20,
            pinned_peak_mib=pinned / 2**20,
            oom_kills=group.oom_kills() - k0,
            orphans_killed=orphans,
            stderr_tail=err[-3000:],
        )
        group.cap_memory(None)
        return run

    def _watch(self, cmd: Sequence[str]) -> tuple[int | str, str, int]:
        """Run ``cmd`` in the group to its end or the timeout (then killed); ``(status, error output, pinned peak)``."""
        with tempfile.TemporaryFile("w+") as errors:
            proc = subprocess.Popen(
                list(cmd),
                stdout=subprocess.DEVNULL,
                stderr=errors,
                text=True,
                cwd=self.cwd,
                env={**os.environ, **self.storage.env()},
                preexec_fn=self.storage.group_join,
                start_new_session=True,
            )
            deadline, pinned = time.monotonic() + self.timeout, 0
            rc: int | str | None = None
            while rc is None:
                with contextlib.suppress(OSError, ValueError):
                    pinned = max(pinned, self.group.cgroups.memory_pinned())
                rc = proc.poll()
                if rc is None and time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    rc = "timeout"
                time.sleep(0.1)
            errors.seek(0)
            return rc, errors.read(), pinned

    def baseline(self, key: Any, cmd: Sequence[str]) -> int:
        """Peak pinned bytes of ``cmd`` (a run on zeros), uncapped; measured once per ``key``.

        Raises:
            RuntimeError: the calibration run failed (its error output is in the message).
        """
        if key not in self._baselines:
            run = self.run(cmd, None)
            if not run.ok:
                raise RuntimeError(f"the baseline run {key} failed ({run.rc}):\n{run.stderr_tail}")
            self._baselines[key] = int(run.pinned_peak_mib * 2**20)
        return self._baselines[key]

    def cap(self, key: Any, baseline_cmd: Sequence[str]) -> int:
        """``baseline(key) + budget + slack``: the memory a loader's run gets."""
        return self.baseline(key, baseline_cmd) + self.budget_bytes + self.slack_bytes

    def baselines(self) -> dict[str, float]:
        """The measured baselines in MiB, by key."""
        return {str(k): v / 2**20 for k, v in self._baselines.items()}


def run_json(arena: Arena, cmd: Sequence[str], out: Path, cap: int | None) -> tuple[ArenaRun, Any]:
    """:meth:`Arena.run` of a child that writes its result as JSON to ``out``; ``(run, result or None)``."""
    if out.exists():
        out.unlink()
    run = arena.run(cmd, cap)
    result = json.loads(out.read_text()) if run.ok and out.exists() else None
    return run, result
