"""Peak memory of one training step: the device allocator's peak (CUDA, Gaudi) or the process's peak resident set.

On CUDA and HPU the allocator keeps a peak that can be reset (``reset_peak_memory_stats``); on the CPU the kernel
keeps the process's peak resident set size (``VmHWM`` in ``/proc/self/status``), which writing ``5`` to
``/proc/self/clear_refs`` resets (Linux). Elsewhere the peak is unknown (``None``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")

SOURCES = {
    "cuda": "CUDA allocator peak (torch.cuda.max_memory_allocated)",
    "hpu": "HPU allocator peak (torch.hpu.max_memory_allocated)",
    "cpu": "process peak resident set (VmHWM), which includes the profiler's own memory",
}


@dataclass
class StepMemory:
    """Peak memory of each profiled step.

    Attributes:
        source: what was measured: ``cuda``, ``hpu`` or ``cpu`` (see :data:`SOURCES`).
        peak_bytes: the peak of each step, in bytes.
    """

    source: str
    peak_bytes: list[int]

    @property
    def max_bytes(self) -> int:
        """The largest step peak."""
        return max(self.peak_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "peak_bytes": list(self.peak_bytes)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepMemory:
        return cls(source=str(data["source"]), peak_bytes=[int(b) for b in data["peak_bytes"]])


class PeakMemoryMeter:
    """Reset the peak at a step's start (:meth:`start`) and read it at its end (:meth:`stop`).

    Args:
        device: the training device (``trainer.strategy.root_device``).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.source: str | None = device.type if device.type in SOURCES else None
        if self.source == "cpu" and not _cpu_peak_resettable():
            self.source = None

    def start(self) -> None:
        """Reset the peak (a no-op where it is unknown)."""
        if self.source == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.source == "hpu":
            torch.hpu.reset_peak_memory_stats(self.device)  # type: ignore[attr-defined]
        elif self.source == "cpu":
            _CLEAR_REFS.write_text("5")

    def stop(self) -> int | None:
        """The peak since :meth:`start`, in bytes (``None`` where unknown)."""
        if self.source == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.source == "hpu":
            return int(torch.hpu.max_memory_allocated(self.device))  # type: ignore[attr-defined]
        if self.source == "cpu":
            return _peak_rss_bytes()
        return None


def _peak_rss_bytes() -> int | None:
    """``VmHWM`` of this process in bytes, or ``None`` when ``/proc`` does not give it."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cpu_peak_resettable() -> bool:
    """Whether the process's peak resident set can be read and reset here (Linux ``/proc``)."""
    if _peak_rss_bytes() is None:
        return False
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True
