"""Sizing full-ranking evaluation batches from the item count, so evaluation never outgrows memory.

Full ranking scores every item for every user of a batch: a float32 score matrix plus two bool matrices (the items
not to rank, the relevant items), about :data:`BYTES_PER_SCORE` bytes per (user, item), as
:class:`~lightning_sdp.metrics.RecallAtK` / :class:`~lightning_sdp.metrics.NDCGAtK` and the SimpleX module build them.
"""

from __future__ import annotations

import logging

_log = logging.getLogger(__name__)

BYTES_PER_SCORE = 6  # float32 score + bool "known" mask + bool target, per (user, item) of an evaluation batch
MIB = 2**20


def available_memory_bytes() -> int | None:
    """Memory the system can still give without swapping (psutil, else ``/proc/meminfo``), or ``None`` if unknown."""
    try:
        import psutil
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().available)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def eval_batch_bytes(batch_size: int, num_items: int) -> int:
    """Bytes of the score and mask matrices of one evaluation batch of ``batch_size`` users."""
    return BYTES_PER_SCORE * int(batch_size) * int(num_items)


def auto_eval_batch_size(num_items: int, memory_mib: float = 256.0, available: int | None = None) -> int:
    """The largest evaluation batch whose score and mask matrices stay under ``memory_mib`` MiB.

    The cap is also held to half of ``available`` memory (when known), so a small machine gets a smaller batch.

    Args:
        num_items: items ranked per user.
        memory_mib: memory cap of one batch's matrices in MiB. Default 256.
        available: available memory in bytes; ``None`` reads it from the system.

    Raises:
        ValueError: when not even one user fits (``num_items`` too large for the memory).
    """
    if memory_mib <= 0:
        raise ValueError(f"eval_memory_mib must be positive, got {memory_mib}.")
    cap = int(memory_mib * MIB)
    if available is None:
        available = available_memory_bytes()
    if available is not None:
        cap = min(cap, available // 2)
    per_user = eval_batch_bytes(1, num_items)
    if per_user > cap:
        raise ValueError(
            f"InteractionsDataModule: ranking {num_items} items needs {per_user / MIB:.1f} MiB per evaluated user "
            f"({BYTES_PER_SCORE} B x items), more than the evaluation memory cap of {cap / MIB:.1f} MiB "
            f"(eval_memory_mib={memory_mib}"
            + (f", half of the {available / MIB:.0f} MiB available" if available is not None else "")
            + "); raise eval_memory_mib or free memory."
        )
    return max(1, cap // per_user)


def check_eval_batch_size(batch_size: int, num_items: int, available: int | None = None) -> None:
    """Refuse an explicit evaluation batch whose matrices would not fit in the available memory.

    Args:
        batch_size: users per evaluation batch.
        num_items: items ranked per user.
        available: available memory in bytes; ``None`` reads it from the system (no check when unknown).

    Raises:
        ValueError: saying how much the batch needs, how much is available, and which batch size fits.
    """
    if available is None:
        available = available_memory_bytes()
    if available is None:
        _log.warning("InteractionsDataModule: available memory unknown; eval_batch_size=%d is not checked.", batch_size)
        return
    need = eval_batch_bytes(batch_size, num_items)
    if need > available:
        fits = max(1, available // 2 // eval_batch_bytes(1, num_items))
        raise ValueError(
            f"InteractionsDataModule: eval_batch_size={batch_size} ranks {num_items} items for {batch_size} users at "
            f"once, which needs about {need / MIB:.0f} MiB ({BYTES_PER_SCORE} B x users x items) but only "
            f"{available / MIB:.0f} MiB are available; set eval_batch_size <= {fits} or eval_batch_size='auto'."
        )


__all__ = [
    "BYTES_PER_SCORE",
    "auto_eval_batch_size",
    "available_memory_bytes",
    "check_eval_batch_size",
    "eval_batch_bytes",
]
