"""Samplers whose order depends only on ``(seed, epoch)``, so a resumed run sees the same batches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of ``range(n)`` used for ``epoch`` (a NumPy generator seeded by ``[seed, epoch]``)."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(int(n))


class EpochSeededSampler(Sampler[int]):
    """One index at a time, in a permutation drawn from ``(seed, epoch)``.

    Lightning calls :meth:`set_epoch` at the start of every epoch (as for ``DistributedSampler``).

    Args:
        n: dataset length.
        seed: base seed.
        shuffle: ``False`` yields ``0 .. n-1`` in order.
    """

    def __init__(self, n: int, seed: int = 0, shuffle: bool = True) -> None:
        self.n, self.seed, self.shuffle, self.epoch = int(n), int(seed), bool(shuffle), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _order(self) -> np.ndarray:
        return epoch_permutation(self.n, self.seed, self.epoch) if self.shuffle else np.arange(self.n)

    def __iter__(self) -> Iterator[int]:
        return iter(self._order().tolist())

    def __len__(self) -> int:
        return self.n


class EpochSeededBatchSampler(EpochSeededSampler):
    """Index arrays of one batch each, from the same ``(seed, epoch)`` permutation (the last batch may be short).

    Used with ``DataLoader(dataset, sampler=..., batch_size=None)`` and a dataset indexed by arrays, which avoids
    collating one sample at a time.

    Args:
        n: dataset length.
        batch_size: indices per batch.
        seed: base seed.
        shuffle: ``False`` keeps the natural order.
    """

    def __init__(self, n: int, batch_size: int, seed: int = 0, shuffle: bool = True) -> None:
        super().__init__(n, seed, shuffle)
        if batch_size < 1:
            raise ValueError(f"EpochSeededBatchSampler: batch_size must be >= 1, got {batch_size}.")
        self.batch_size = int(batch_size)

    def __iter__(self) -> Iterator[np.ndarray]:  # type: ignore[override]
        order = self._order()
        for start in range(0, self.n, self.batch_size):
            yield order[start : start + self.batch_size]

    def __len__(self) -> int:
        return (self.n + self.batch_size - 1) // self.batch_size


__all__ = ["EpochSeededBatchSampler", "EpochSeededSampler", "epoch_permutation"]
