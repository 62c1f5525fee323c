"""Per-rank sample buffers with the eviction rules compared in SOLAR (Sun et al., arXiv 2211.00224).

A buffer here only *decides* (which sample ids are held, which one goes out); the bytes live in the loader's
store. The schedule drives one buffer per rank with the sample ids of every step, so that all ranks compute the
same decisions without exchanging anything.

Policies:
    ``"belady"``: evict the buffered sample whose next use is farthest in the future (Belady's MIN), and bypass
        (do not insert) an incoming sample whose next use is farther than every buffered one. A heap with lazy
        deletion gives O(log C) per access.
    ``"lru"``: least recently used goes first; every miss is inserted.
    ``"fifo"``: first inserted goes first; hits do not change the order; every miss is inserted.
    ``"solar"``: our earlier reading of the artifact's rule: FIFO, except that a sample that was just consumed (a
        hit in this step) moves to the front of the eviction queue. Kept for comparison; it misreads the artifact.
    ``"artifact_fifo"``: the rule of the SOLAR artifact (``hipdac-lab/SC24-SOLAR``, ``Cosmoflow/io_solar.py``,
        ``CosDataset.getItemBalancing``), transcribed: insertion-ordered FIFO where hits do not reorder; a miss is
        inserted first and, when that overflows the capacity, the victim is the oldest buffered sample that is in
        the step's *load set* (other than the incoming one), else the oldest. The load set of step ``t`` of epoch
        ``e > 0`` is, for the first ``C // G`` steps only, the step's global-batch samples that are not among the
        last ``C`` samples of epoch ``e - 1`` (``idx_to_load``); samples in it are read into a side buffer and are
        not inserted. In later steps and in epoch 0 the load set is empty (plain FIFO).
"""

from __future__ import annotations

import heapq
import re
from collections import OrderedDict

EVICTION_POLICIES = ("belady", "lru", "fifo", "solar", "artifact_fifo")

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(size: int | str, sample_nbytes: int) -> int:
    """Turn a buffer size given in samples (int) or bytes (str such as ``"8GB"``, ``"512MiB"``) into samples.

    Args:
        size: an ``int`` number of samples, or a string with a byte unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).
            A bare number in a string counts samples as well.
        sample_nbytes: bytes of one sample (input plus targets), used to convert a byte size.

    Returns:
        The capacity in whole samples (bytes are rounded down).
    """
    if isinstance(size, bool):
        raise TypeError(f"buffer_size must be an int (samples) or a string with a byte unit, got {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"buffer_size must be >= 0 samples, got {size}")
        return size
    if not isinstance(size, str):
        raise TypeError(f"buffer_size must be an int (samples) or a string such as '8GB', got {type(size).__name__}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", size)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot parse buffer_size {size!r}: use an int number of samples or a number with one of the units "
            f"{sorted(u for u in _UNITS if u)} (e.g. '8GB', '512MiB')"
        )
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit == "":
        return int(value)
    if sample_nbytes <= 0:
        raise ValueError("sample_nbytes must be positive to convert a byte buffer size into samples")
    return int(value * _UNITS[unit]) // sample_nbytes


class Buffer:
    """Base class: a set of sample ids of bounded size with an eviction rule.

    Args:
        capacity: the most samples held at once; 0 disables the buffer (every ``offer`` is refused).
    """

    policy = ""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"buffer capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)

    def __contains__(self, sample: int) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def contents(self) -> set[int]:
        """The ids held now."""
        raise NotImplementedError

    def hit(self, sample: int, next_use: int) -> None:
        """Record a use of a buffered sample, whose following use is at ``next_use``."""
        raise NotImplementedError

    def offer(self, sample: int, next_use: int) -> tuple[bool, int | None]:
        """Offer a sample just read from storage. Returns ``(inserted, evicted id or None)``."""
        raise NotImplementedError


class _OrderedBuffer(Buffer):
    """LRU, FIFO and the artifact rule share one ordered dict: the first key is evicted first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, sample: int) -> bool:
        return sample in self._order

    def __len__(self) -> int:
        return len(self._order)

    def contents(self) -> set[int]:
        return set(self._order)

    def hit(self, sample: int, next_use: int) -> None:
        pass

    def offer(self, sample: int, next_use: int) -> tuple[bool, int | None]:
        if self.capacity == 0:
            return False, None
        if sample in self._order:
            raise ValueError(f"sample {sample} is already buffered; a buffered sample cannot miss")
        evicted = None
        if len(self._order) >= self.capacity:
            evicted, _ = self._order.popitem(last=False)
        self._order[sample] = None
        return True, evicted


class LRUBuffer(_OrderedBuffer):
    """Least recently used sample is evicted first."""

    policy = "lru"

    def hit(self, sample: int, next_use: int) -> None:
        self._order.move_to_end(sample)


class FIFOBuffer(_OrderedBuffer):
    """First inserted sample is evicted first; hits do not refresh."""

    policy = "fifo"


class ArtifactBuffer(_OrderedBuffer):
    """The artifact-style rule: FIFO, but a sample consumed in this step is the first to go."""

    policy = "solar"

    def hit(self, sample: int, next_use: int) -> None:
        self._order.move_to_end(sample, last=False)


class ArtifactFIFOBuffer(_OrderedBuffer):
    """The SOLAR artifact's eviction rule, transcribed (see the module docstring); the schedule calls
    :meth:`begin_step` with each step's load set before offering its samples."""

    policy = "artifact_fifo"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._load_set: frozenset[int] = frozenset()

    def begin_step(self, load_set: set[int] | frozenset[int]) -> None:
        """Set the load set (``idx_to_load`` of the artifact) of the step about to run."""
        self._load_set = frozenset(load_set)

    def offer(self, sample: int, next_use: int) -> tuple[bool, int | None]:
        if self.capacity == 0 or sample in self._load_set:
            return False, None  # the artifact reads load-set samples into its prefetch buffer, not the cache
        if sample in self._order:
            raise ValueError(f"sample {sample} is already buffered; a buffered sample cannot miss")
        self._order[sample] = None
        if len(self._order) <= self.capacity:
            return True, None
        victim = next((k for k in self._order if k in self._load_set and k != sample), None)
        if victim is None:
            victim = next(iter(self._order))
        del self._order[victim]
        return True, victim


class BeladyBuffer(Buffer):
    """Belady's MIN with bypass: evict the farthest next use; never insert what is needed last.

    The heap holds ``(-next_use, sample, version)``; an entry is stale when ``version`` is not the sample's
    current one, and stale entries are dropped when they reach the top (lazy deletion).
    """

    policy = "belady"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._next: dict[int, int] = {}
        self._version: dict[int, int] = {}
        self._heap: list[tuple[int, int, int]] = []
        self._counter = 0

    def __contains__(self, sample: int) -> bool:
        return sample in self._next

    def __len__(self) -> int:
        return len(self._next)

    def contents(self) -> set[int]:
        return set(self._next)

    def _push(self, sample: int, next_use: int) -> None:
        self._counter += 1
        self._next[sample] = next_use
        self._version[sample] = self._counter
        heapq.heappush(self._heap, (-next_use, sample, self._counter))
        if len(self._heap) > 4 * max(self.capacity, 16):  # keep stale entries bounded
            self._heap = [(-self._next[s], s, self._version[s]) for s in self._next]
            heapq.heapify(self._heap)

    def _farthest(self) -> tuple[int, int]:
        while True:
            neg, sample, version = self._heap[0]
            if self._version.get(sample) == version:
                return sample, -neg
            heapq.heappop(self._heap)

    def hit(self, sample: int, next_use: int) -> None:
        if sample not in self._next:
            raise KeyError(f"sample {sample} is not buffered")
        self._push(sample, next_use)

    def offer(self, sample: int, next_use: int) -> tuple[bool, int | None]:
        if self.capacity == 0:
            return False, None
        if sample in self._next:
            raise ValueError(f"sample {sample} is already buffered; a buffered sample cannot miss")
        if len(self._next) < self.capacity:
            self._push(sample, next_use)
            return True, None
        victim, victim_next = self._farthest()
        if next_use >= victim_next:
            return False, None  # the incoming sample is needed last: bypass
        heapq.heappop(self._heap)
        del self._next[victim]
        del self._version[victim]
        self._push(sample, next_use)
        return True, victim


_POLICIES: dict[str, type[Buffer]] = {
    "belady": BeladyBuffer,
    "lru": LRUBuffer,
    "fifo": FIFOBuffer,
    "solar": ArtifactBuffer,
    "artifact_fifo": ArtifactFIFOBuffer,
}


def make_buffer(policy: str, capacity: int) -> Buffer:
    """Build a buffer for ``policy`` (one of :data:`EVICTION_POLICIES`) holding at most ``capacity`` samples."""
    if policy not in _POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; choose one of {EVICTION_POLICIES}")
    return _POLICIES[policy](capacity)
