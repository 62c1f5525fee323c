"""HEAT accelerator: a multi-core CPU accelerator for fused collaborative-filtering kernels.

Zhang et al., "HEAT: A Highly Efficient and Affordable Training System for Collaborative Filtering Based
Recommendation on CPUs" (ICS 2023, arXiv 2304.07334). The accelerator owns the CPU threads: it sets torch's and
numba's thread counts (and optionally the CPU affinity) for the run and restores them afterwards. The kernels
themselves live in :mod:`lightning_sdp.kernels.cf_numba` and are driven by
:class:`~lightning_sdp.models.SimpleXModule` (``backend="fused"``).

Usage::

    Trainer(accelerator="heat", devices=1)                        # OMP_NUM_THREADS if set, else every usable core
    Trainer(accelerator="heat", devices=2, strategy="ddp")        # each of the 2 processes gets half the cores
    Trainer(accelerator=HEATAccelerator(num_threads=8, cpu_affinity=list(range(8))), devices=1)
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch
from lightning.fabric.utilities import rank_zero_warn
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.precision import MixedPrecision, Precision, TransformerEnginePrecision
from typing_extensions import override

from lightning_sdp._imports import _NUMBA_AVAILABLE
from lightning_sdp._registry import register_class_aliases

_log = logging.getLogger(__name__)


def available_cores() -> int:
    """Cores this process may run on (its affinity mask), else ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _read_proc_stat() -> dict[str, tuple[int, int]]:
    """``{"cpuN": (busy_jiffies, total_jiffies)}`` from ``/proc/stat`` (Linux), empty elsewhere."""
    out: dict[str, tuple[int, int]] = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *vals = line.split()
                nums = [int(v) for v in vals]
                idle = nums[3] + (nums[4] if len(nums) > 4 else 0)
                out[name] = (sum(nums) - idle, sum(nums))
    except OSError:
        pass
    return out


def _env_local_world_size() -> int:
    """Processes on this machine as launchers such as torchrun announce them (``LOCAL_WORLD_SIZE``), else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def env_num_threads() -> int | None:
    """Threads per process that ``OMP_NUM_THREADS`` asks for, ``None`` when it is unset or empty.

    OpenMP reads a list (``"8,2"``) as threads per nesting level; the first entry is the count of the outer level.

    Raises:
        ValueError: when the variable is set to something that is not a positive integer.
    """
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    first = value.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise ValueError(
            f"OMP_NUM_THREADS={value!r} is not a positive integer; set it to the threads each process should use "
            "(e.g. OMP_NUM_THREADS=8), unset it, or pass HEATAccelerator(num_threads=...)."
        )
    return int(first)


def set_cpu_threads(n: int) -> int:
    """Use ``n`` threads in numba's kernels (when the ``cpu`` extra is installed) and in torch.

    numba's count is set first: starting its OpenMP pool resets torch's count to every core.

    Returns:
        The threads numba uses: ``n`` capped by ``NUMBA_NUM_THREADS`` (``n`` without numba).
    """
    used = n
    if _NUMBA_AVAILABLE:
        import numba

        used = min(n, numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
        numba.set_num_threads(used)
    torch.set_num_threads(n)
    return used


def _check_cpu_precision(plugin: Precision) -> None:
    """Refuse a precision plugin that computes on a GPU: HEAT runs on the CPU.

    Lightning builds ``MixedPrecision(..., "cuda")`` for ``precision="16-mixed"`` / ``"bf16-mixed"`` whenever the
    accelerator is not the built-in ``"cpu"`` / ``"mps"``, so a custom CPU accelerator has to be given the CPU plugin
    explicitly.
    """
    if isinstance(plugin, MixedPrecision) and plugin.device != "cpu":
        raise ValueError(
            f"HEATAccelerator runs on the CPU, but the Trainer's precision plugin autocasts on {plugin.device!r} "
            f"(Lightning builds a CUDA plugin for precision={plugin.precision!r} with a custom accelerator). Pass "
            "`plugins=[MixedPrecision('bf16-mixed', 'cpu')]` (from lightning.pytorch.plugins.precision) instead of "
            "`precision=...` for CPU bf16 autocast (fp16 autocast is slow on CPUs), or keep the default "
            "precision='32-true', which the fused kernel needs."
        )
    if isinstance(plugin, TransformerEnginePrecision):
        raise ValueError(
            "HEATAccelerator runs on the CPU; Transformer Engine precision needs a CUDA GPU. Use precision='32-true' "
            "or `plugins=[MixedPrecision('bf16-mixed', 'cpu')]`."
        )


class HEATAccelerator(CPUAccelerator):
    """CPU accelerator that owns the thread pools used by HEAT's fused kernels (alias ``"heat"``).

    ``setup_device`` sets ``torch.set_num_threads`` and ``numba.set_num_threads`` (when numba, the ``cpu`` extra,
    is installed) to the run's thread count and pins the process to ``cpu_affinity`` if given; ``teardown``
    restores all three. The thread count of each process is, in this order: ``num_threads``; else the
    ``OMP_NUM_THREADS`` environment variable, used as it is (it counts the threads of one process, as OpenMP and
    torch read it, so it is not divided again; Lightning's DDP launchers set it to ``cores // N`` when you have not);
    else the cores split among the N local processes under DDP (``devices=N`` on one machine), ``max(1, cores //
    N)`` each (``setup`` learns N from the Trainer).
    numba's thread pool is started before torch's count is set, since its OpenMP start-up resets torch's count
    to every core, and ``setup`` sets both counts again after the model's and datamodule's ``setup`` hooks (which
    may import or start other thread pools), so training steps run with the run's count.
    ``get_device_stats`` reports the thread counts and the per-core use since the previous call.

    Only :class:`~lightning_sdp.models.SimpleXModule` (``backend="fused"``) runs HEAT's kernels; any other
    LightningModule gets the thread settings and nothing else, which ``setup`` says once in a warning.

    Precision: the default ``"32-true"`` is what the fused kernel needs. For ``precision="bf16-mixed"`` /
    ``"16-mixed"`` with a custom accelerator Lightning builds a *CUDA* autocast plugin; ``setup`` refuses it (and
    any other precision plugin that runs on a GPU) with the plugin to pass instead:
    ``plugins=[MixedPrecision("bf16-mixed", "cpu")]`` for CPU bf16 autocast. The accelerator never replaces the
    precision plugin the Trainer holds.

    Args:
        num_threads: threads for torch and the kernels in each process. ``None`` uses ``OMP_NUM_THREADS`` when it is
            set (a per-process count, not divided among processes; a value that is not a positive integer raises a
            ``ValueError`` at set-up), else splits the cores this process may use (``cpu_affinity``, else its
            affinity mask) evenly among the local processes. An explicit value wins over ``OMP_NUM_THREADS``.
            Default ``None``.
        cpu_affinity: CPU ids to pin the process to during the run (Linux), or ``None`` to leave it. Default ``None``.
    """

    def __init__(self, num_threads: int | None = None, cpu_affinity: list[int] | None = None) -> None:
        super().__init__()
        if num_threads is not None and num_threads <= 0:
            raise ValueError(f"HEATAccelerator: num_threads must be positive, got {num_threads}.")
        if cpu_affinity is not None:
            if not hasattr(os, "sched_setaffinity"):
                raise ValueError("HEATAccelerator: cpu_affinity needs os.sched_setaffinity (Linux).")
            allowed = os.sched_getaffinity(0)
            bad = sorted(set(cpu_affinity) - allowed)
            if not cpu_affinity or bad:
                raise ValueError(
                    f"HEATAccelerator: cpu_affinity {cpu_affinity} is empty or names CPUs this process may not use "
                    f"({bad}); allowed: {sorted(allowed)}."
                )
        self.num_threads = num_threads
        self.cpu_affinity = list(cpu_affinity) if cpu_affinity is not None else None
        self._saved: dict[str, Any] | None = None
        self._last_stat: dict[str, tuple[int, int]] = {}
        self._warned_numba_limit = False
        self._warned_not_simplex = False
        # local processes sharing the cores; ``setup`` sets it from the Trainer (torchrun's variable until then)
        self._local_world_size = _env_local_world_size()

    def resolved_threads(self) -> int:
        """The thread count of each process: ``num_threads``, else ``OMP_NUM_THREADS``, else the cores split among
        the local processes."""
        if self.num_threads is not None:
            return self.num_threads
        from_env = env_num_threads()
        if from_env is not None:
            return from_env
        cores = len(self.cpu_affinity) if self.cpu_affinity is not None else available_cores()
        return max(1, cores // self._local_world_size)

    def _apply_threads(self) -> None:
        """Set numba's, then torch's thread count (numba's OpenMP pool start-up resets torch to every core)."""
        n = self.resolved_threads()
        used = set_cpu_threads(n)
        if used < n and not self._warned_numba_limit:
            self._warned_numba_limit = True
            _log.warning(
                "HEATAccelerator: numba allows at most %d threads (NUMBA_NUM_THREADS); using %d instead of %d.",
                used,
                used,
                n,
            )

    @override
    def setup_device(self, device: torch.device) -> None:
        super().setup_device(device)
        if self._saved is not None:  # already set up (e.g. fit then test on the same Trainer)
            return
        saved: dict[str, Any] = {"torch": torch.get_num_threads()}
        if _NUMBA_AVAILABLE:
            import numba

            saved["numba"] = numba.get_num_threads()  # starts numba's pool, which may reset torch's count
        if self.cpu_affinity is not None:
            saved["affinity"] = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self.cpu_affinity)
        self._apply_threads()
        self._saved = saved
        self._last_stat = _read_proc_stat()

    @override
    def setup(self, trainer: Trainer) -> None:
        _check_cpu_precision(trainer.strategy.precision_plugin)
        self._local_world_size = max(1, int(trainer.num_devices))
        self._warn_if_nothing_to_accelerate(trainer)
        if self._saved is not None:
            # after the model's and datamodule's setup hooks, which may start other thread pools (numba's OpenMP
            # start-up, a library's import) that reset torch's count: the run's count must hold in every step
            self._apply_threads()

    def _warn_if_nothing_to_accelerate(self, trainer: Trainer) -> None:
        """Say once that a module other than ``SimpleXModule`` gets the thread settings and nothing else."""
        if self._warned_not_simplex:
            return
        model = trainer.lightning_module
        # a SimpleXModule exists only once its module was imported: nothing to import (or pay for) here
        simplex = sys.modules.get("lightning_sdp.models.simplex.module")
        if simplex is not None and isinstance(model, simplex.SimpleXModule):
            return
        self._warned_not_simplex = True
        pinned = " and pins the CPUs (cpu_affinity)" if self.cpu_affinity is not None else ""
        rank_zero_warn(
            f"HEATAccelerator: {type(model).__name__} is not a SimpleXModule, so accelerator='heat' only sets the "
            f"thread count ({self.resolved_threads()} per process){pinned}: nothing else is accelerated. HEAT's fused "
            "kernels run only in lightning_sdp.SimpleXModule(backend='fused'). For other models use "
            "accelerator='cpu' (and OMP_NUM_THREADS or torch.set_num_threads for the threads), or train a "
            "SimpleXModule."
        )

    @override
    def teardown(self) -> None:
        saved, self._saved = self._saved, None
        if saved is None:
            return
        if "numba" in saved:
            import numba

            numba.set_num_threads(saved["numba"])
        torch.set_num_threads(saved["torch"])
        if "affinity" in saved:
            os.sched_setaffinity(0, saved["affinity"])

    @override
    def get_device_stats(self, device: _DEVICE) -> dict[str, Any]:
        stats: dict[str, Any] = {"heat_threads": self.resolved_threads(), "torch_threads": torch.get_num_threads()}
        if _NUMBA_AVAILABLE:
            import numba

            stats["numba_threads"] = numba.get_num_threads()
        now = _read_proc_stat()
        cores = (
            self.cpu_affinity
            if self.cpu_affinity is not None
            else sorted(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else []
        )
        for c in cores:
            key = f"cpu{c}"
            if key in now and key in self._last_stat:
                busy = now[key][0] - self._last_stat[key][0]
                total = now[key][1] - self._last_stat[key][1]
                if total > 0:
                    stats[f"cpu{c}_percent"] = 100.0 * busy / total
        self._last_stat = now
        return stats

    @staticmethod
    @override
    def name() -> str:
        return "heat"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        # Registration goes through lightning_sdp._registry (idempotent, never overrides); nothing to do here.
        pass


# When this module is what first imports lightning.pytorch, the import hook ran before the class existed.
register_class_aliases(HEATAccelerator)

__all__ = ["HEATAccelerator", "available_cores", "env_num_threads"]
