"""Samplers whose order depends only on ``(seed, epoch)``, so a resumed run sees the same batches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import DistributedSampler, Sampler
from typing_extensions import override


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
    collating one sample at a time. A run resumed mid-epoch continues where it stopped: :meth:`resume_at` makes
    the next pass over that epoch start some batches in.

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
        self._resume: tuple[int, int] | None = None

    def resume_at(self, epoch: int, skip: int) -> None:
        """Make the next pass over ``epoch`` skip its first ``skip`` batches (and yield only the rest); sets the epoch.

        The epoch is set here, not only by the Trainer's ``set_epoch``: DataLoader workers draw their first indices as
        soon as the iterator exists, which Lightning creates before it sets the epoch of a resumed run. A pass over
        another epoch cancels the resume.

        Args:
            epoch: the epoch the run stopped in.
            skip: batches of that epoch already trained on (of this sampler's own batches), in ``[0, len(self))``.
        """
        if not 0 <= skip < max(len(self), 1):
            raise ValueError(
                f"{type(self).__name__}: cannot resume {skip} batches into an epoch of {len(self)} batches; the "
                "checkpoint comes from a different data set or batch size."
            )
        self.set_epoch(epoch)
        self._resume = (int(epoch), int(skip)) if skip else None

    def _starts(self) -> list[int]:
        """First position (in the epoch's order) of each batch this sampler yields."""
        return list(range(0, self.n, self.batch_size))

    def __iter__(self) -> Iterator[np.ndarray]:  # type: ignore[override]
        # a generator: the order is drawn at the first batch, after the Trainer's set_epoch
        resume, self._resume = self._resume, None
        skip = resume[1] if resume is not None and resume[0] == self.epoch else 0
        order = self._order()
        for start in self._starts()[skip:]:
            yield order[start : start + self.batch_size]

    def __len__(self) -> int:
        return (self.n + self.batch_size - 1) // self.batch_size


class DistributedEpochSeededBatchSampler(EpochSeededBatchSampler, DistributedSampler):
    """The share of one of ``num_replicas`` processes of :class:`EpochSeededBatchSampler`'s batches.

    Process ``rank`` takes batches ``rank, rank + num_replicas, ...`` of the epoch's order; the list is padded by
    repeating its first batches so that every process runs the same number of steps (as ``DistributedSampler``
    pads). Being a ``DistributedSampler``, Lightning keeps it instead of wrapping the loader's sampler in its own,
    which would re-shuffle the batches with a permutation of its own and make a mid-epoch position depend on it.

    Args:
        n: dataset length.
        batch_size: indices per batch.
        num_replicas: processes sharing the batches.
        rank: this process, in ``[0, num_replicas)``.
        seed: base seed (the same in every process).
        shuffle: ``False`` keeps the natural order.
    """

    def __init__(
        self, n: int, batch_size: int, num_replicas: int, rank: int, seed: int = 0, shuffle: bool = True
    ) -> None:
        # DistributedSampler is a base only to be recognised as one; its __init__ (which sizes a per-sample share of
        # a dataset) is not called, and num_replicas / rank are the attributes of it that are set
        EpochSeededBatchSampler.__init__(self, n, batch_size, seed, shuffle)
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(
                f"DistributedEpochSeededBatchSampler: rank must be in [0, num_replicas), got rank={rank}, "
                f"num_replicas={num_replicas}."
            )
        self.num_replicas, self.rank = int(num_replicas), int(rank)

    @override
    def _starts(self) -> list[int]:
        starts = super()._starts()
        total = len(self) * self.num_replicas
        padded = (starts * -(-total // max(len(starts), 1)))[:total]
        return padded[self.rank :: self.num_replicas]

    @override
    def __len__(self) -> int:
        return -(-super().__len__() // self.num_replicas)


__all__ = ["DistributedEpochSeededBatchSampler", "EpochSeededBatchSampler", "EpochSeededSampler", "epoch_permutation"]
