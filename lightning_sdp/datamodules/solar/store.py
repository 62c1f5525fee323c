"""The bytes of a rank's buffered samples: one slot per sample in preallocated blocks.

A :class:`~lightning_sdp.datamodules.solar.buffer.Buffer` decides which samples are held; the loader keeps their
bytes here. One tensor allocation per buffered sample would leave the heap full of small freed blocks as the buffer
turns over (a sample out, another in, every step), and the process's resident memory would then grow past what the
buffer holds, which a memory cgroup charges like any other allocation. Slots in a few large blocks keep the store's
memory at its highest occupancy times the sample's bytes: the blocks' pages are committed when a slot is first
written, and freed slots are reused before untouched ones.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping

import numpy as np
import torch

MIN_BLOCK_SAMPLES = 64
"""Slots added at once when the store outgrows its planned capacity (or has none)."""


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype (the one ``torch.from_numpy`` gives)."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


class SampleStore:
    """Buffered samples by id, each in a slot of per-key blocks.

    Args:
        shapes: per-sample shape of each key.
        dtypes: numpy dtype of each key.
        capacity: slots of the first block (the plan's buffer size); the store grows by blocks of at least
            :data:`MIN_BLOCK_SAMPLES` beyond it, so it never refuses a sample.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, np.dtype], capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"store capacity must be >= 0, got {capacity}")
        self._shapes = {k: tuple(v) for k, v in shapes.items()}
        self._dtypes = {k: torch_dtype(dtypes[k]) for k in shapes}
        self.capacity = int(capacity)
        self._blocks: list[dict[str, torch.Tensor]] = []
        self._block_starts: list[int] = []
        self._slots: dict[int, int] = {}
        self._free: list[int] = []  # a stack: the most recently freed (already committed) slot is reused first
        self._next_unused = 0
        self._allocated = 0

    def __contains__(self, sample: object) -> bool:
        return sample in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[int]:
        return iter(self._slots)

    @property
    def allocated_samples(self) -> int:
        """Slots allocated (committed only where written)."""
        return self._allocated

    def put(self, sample: int, rows: Mapping[str, torch.Tensor]) -> None:
        """Copy one sample's rows (one tensor per key, the per-sample shape) into its slot."""
        slot = self._slots.get(sample)
        if slot is None:
            slot = self._take_slot()
            self._slots[sample] = slot
        block, row = self._locate(slot)
        for key, value in rows.items():
            block[key][row].copy_(value)

    def get(self, sample: int, key: str) -> torch.Tensor:
        """A view of one key of a held sample (valid until the sample leaves the store)."""
        block, row = self._locate(self._slots[sample])
        return block[key][row]

    def pop(self, sample: int) -> None:
        """Drop a sample if held; its slot is reused by the next :meth:`put`."""
        slot = self._slots.pop(sample, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        """Drop every sample and give the blocks' memory back."""
        self._slots.clear()
        self._free.clear()
        self._blocks.clear()
        self._block_starts.clear()
        self._next_unused = self._allocated = 0

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        if self._next_unused == self._allocated:
            self._grow()
        slot = self._next_unused
        self._next_unused += 1
        return slot

    def _grow(self) -> None:
        rows = self.capacity if not self._blocks and self.capacity > 0 else max(MIN_BLOCK_SAMPLES, self._allocated // 4)
        self._blocks.append({k: torch.empty((rows, *s), dtype=self._dtypes[k]) for k, s in self._shapes.items()})
        self._block_starts.append(self._allocated)
        self._allocated += rows

    def _locate(self, slot: int) -> tuple[dict[str, torch.Tensor], int]:
        i = bisect.bisect_right(self._block_starts, slot) - 1
        return self._blocks[i], slot - self._block_starts[i]
