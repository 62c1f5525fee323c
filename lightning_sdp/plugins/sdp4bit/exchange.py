"""The two collectives of SDP4Bit: quantised gradient reduce-scatter and quantised weight all-gather.

Both work on one flat, zero-padded fp32 buffer of ``P = world_size * S`` values in which rank ``r = n * L + j``
(node ``n``, local index ``j``) owns the shard ``[k * S, (k + 1) * S)`` with ``k = j * N + n`` (local-major: the
shards a node's rank ``j`` reduces are contiguous, see :func:`~lightning_sdp.plugins.sdp4bit.topology.shard_index`)
and ``S`` is a whole number of quantisation groups and Hadamard blocks.

Gradient reduce-scatter (TLq-HS, Jia et al. 2024, Sec. 3.2), on a grid of ``N`` nodes x ``L`` ranks per node:

1. quantise the whole buffer (after the block Hadamard transform for ``tlq_hs``) to ``intra_bits``;
2. all-to-all inside the node: local peer ``j`` receives the codes of every shard ``j * N + n``;
3. dequantise the ``L`` contributions, sum them, re-quantise the node's partial sums to ``inter_bits``;
4. all-to-all between the ranks with the same local index: rank ``n * L + j`` receives its own shard from every
   node;
5. dequantise the ``N`` contributions, sum, apply ``H`` once and divide by the block size.

A level of size 1 is skipped (one node: 8-bit only; one rank per node: 4-bit only). ``"none"`` runs the same
two-level routing in fp32 (a hierarchical reduce-scatter).

Weight all-gather (qWD, Sec. 3.1): rank ``r`` quantises ``master_shard - model[shard r]`` (the model weights are the
reconstructed copy every rank holds), all ranks all-gather the codes and add the decoded differences to their
model weights, so all ranks stay bit-identical and the quantisation error is corrected at the next step.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sdp.kernels import quantization as ref
from lightning_sdp.kernels.quantization import QuantFormat, Rounding, RoundingSource
from lightning_sdp.plugins.sdp4bit.collectives import all_gather_rows, all_to_all, reduce_rows
from lightning_sdp.plugins.sdp4bit.formats import WEIGHT_MODES, GradientFormat, WeightFormat
from lightning_sdp.plugins.sdp4bit.topology import Topology, in_shard_order


@dataclass
class CollectiveStats:
    """Bytes and values one collective sent to other ranks (this rank's view).

    Attributes:
        bytes: payload + scale bytes sent to other ranks.
        elements: number of values those bytes represent.
        calls: number of collective calls.
    """

    bytes: int = 0
    elements: int = 0
    calls: int = 0

    @property
    def bits_per_element(self) -> float:
        """Bits on the wire per value (codes + scales); 0 when nothing was sent."""
        return 8.0 * self.bytes / self.elements if self.elements else 0.0

    def add(self, nbytes: float, elements: float) -> None:
        """Account one collective call."""
        self.bytes += int(nbytes)
        self.elements += int(elements)
        self.calls += 1


@dataclass
class CommStats:
    """Per-collective accounting of one optimizer step (``last``) and of the whole run (``total``)."""

    last: dict[str, CollectiveStats] = field(default_factory=dict)
    total: dict[str, CollectiveStats] = field(default_factory=dict)
    steps: int = 0
    codec_seconds: float = 0.0
    codec_seconds_total: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        # picklable for "spawn" start methods: the lock is per process
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def add_codec_time(self, seconds: float) -> None:
        """Account ``seconds`` spent quantising / dequantising (thread-safe: worker threads call it)."""
        with self._lock:
            self.codec_seconds += seconds
            self.codec_seconds_total += seconds

    def record(self, name: str, nbytes: float, elements: float) -> None:
        """Account ``nbytes`` sent for ``elements`` values by collective ``name`` in the current step."""
        with self._lock:
            self.last.setdefault(name, CollectiveStats()).add(nbytes, elements)
            self.total.setdefault(name, CollectiveStats()).add(nbytes, elements)

    def merge(self, other: CommStats) -> None:
        """Add what ``other`` recorded in its current step to this step (and to the run's total).

        A weight all-gather that runs past its optimizer step (overlapped with the next forward) records into its
        own ``CommStats``; the strategy merges it when it waits for the gather, so the bytes count in that step.
        """
        with self._lock:
            for name, stats in other.last.items():
                for into in (self.last, self.total):
                    mine = into.setdefault(name, CollectiveStats())
                    mine.bytes += stats.bytes
                    mine.elements += stats.elements
                    mine.calls += stats.calls

    def new_step(self) -> None:
        """Start accounting a new step."""
        self.last = {}
        self.codec_seconds = 0.0
        self.steps += 1

    def bits_per_element(self, name: str, total: bool = False) -> float:
        """Bits per value of collective ``name`` (``"weight"``, ``"grad_intra"``, ``"grad_inter"``).

        ``"weight"`` also sums the two stages of the hierarchical all-gather (``"weight_inter"``,
        ``"weight_intra"``).
        """
        entries = self.total if total else self.last
        parts = [v for k, v in entries.items() if k == name or (name == "weight" and k.startswith("weight_"))]
        elements = sum(v.elements for v in parts)
        return 8.0 * sum(v.bytes for v in parts) / elements if elements else 0.0

    @property
    def bytes_per_step(self) -> int:
        """Bytes this rank sent in the last step, all collectives together."""
        return sum(s.bytes for s in self.last.values())

    def metrics(self, codec: bool) -> dict[str, float]:
        """The last step's ``sdp4bit/*`` scalars: bits per element of each collective, bytes, and (``codec``) the
        quantise/dequantise milliseconds."""
        out = {
            "sdp4bit/weight_bits_per_element": self.bits_per_element("weight"),
            "sdp4bit/grad_bits_per_element_intra": self.bits_per_element("grad_intra"),
            "sdp4bit/grad_bits_per_element_inter": self.bits_per_element("grad_inter"),
            "sdp4bit/bytes_per_step": float(self.bytes_per_step),
        }
        if codec:
            out["sdp4bit/codec_ms"] = 1e3 * self.codec_seconds
        return out

    def as_dict(self) -> dict[str, Any]:
        """Plain-dict summary (JSON friendly)."""
        return {
            "steps": self.steps,
            "bytes_per_step": self.bytes_per_step,
            "codec_seconds": self.codec_seconds,
            "last": {k: {**vars(v), "bits_per_element": v.bits_per_element} for k, v in self.last.items()},
            "total": {k: {**vars(v), "bits_per_element": v.bits_per_element} for k, v in self.total.items()},
        }


def derive_seed(*words: int) -> int:
    """A 31-bit seed that depends on every one of ``words`` and on their number, via ``numpy.random.SeedSequence``.

    The one seed mixer of SDP4Bit: ``SeedSequence`` hashes its entropy so that nearby inputs (step 7 and step 8,
    rank 0 and rank 1) give unrelated streams, which a linear formula of the inputs does not guarantee. Each word
    enters as one 64-bit value (negative ones modulo ``2**64``) and the number of words enters too, so ``(1, 2)``
    and ``(1, 2, 0)`` differ. 31 bits: a seed both ``torch.Generator.manual_seed`` and Triton's ``tl.rand`` take.

    Args:
        words: integers the seed must depend on, e.g. ``(seed, step, rank)``.
    """
    entropy = np.array([len(words), *(int(w) % 2**64 for w in words)], dtype=np.uint64)
    state = np.random.SeedSequence(entropy.view(np.uint32)).generate_state(1, np.uint32)
    return int(state[0]) >> 1


# Domain tags: what a derived seed is for, so that the streams of a buffer and of a kernel call never coincide.
_CHILD, _KERNEL_CALL = 0, 1


class RoundingRNG:
    """Reproducible randomness for stochastic rounding: reseeded from ``(seed, step, rank)`` every step.

    The torch path draws from a ``torch.Generator``; the Triton path takes one integer seed per kernel call. Both
    depend only on the step counter, so a resumed run draws the same numbers as an uninterrupted one. Every seed
    comes from :func:`derive_seed`.

    Args:
        seed: user seed.
        rank: global rank.
        device: device of the generator.
    """

    def __init__(self, seed: int, rank: int, device: torch.device) -> None:
        self.seed = int(seed)
        self.rank = int(rank)
        self.generator = torch.Generator(device=device)
        self._words: tuple[int, ...] = (self.seed, 0, self.rank)
        self._calls = 0

    def _start(self, words: tuple[int, ...]) -> None:
        self._words = words
        self.generator.manual_seed(derive_seed(*words))
        self._calls = 0

    def reset(self, step: int) -> None:
        """Reseed for optimizer step ``step``."""
        self._start((self.seed, int(step), self.rank))

    def next_seed(self) -> int:
        """A fresh 31-bit seed for one Triton kernel call."""
        self._calls += 1
        return derive_seed(*self._words, _KERNEL_CALL, self._calls)

    def child(self, key: int) -> RoundingRNG:
        """An independent stream for buffer ``key`` of the current step (its own generator and seed counter).

        Each bucket's exchange draws from its own child, so the numbers it draws do not depend on the order in
        which buckets are processed (overlapped, pipelined or one after the other: bit-identical results).
        """
        out = RoundingRNG(self.seed, self.rank, self.generator.device)
        out._start((*self._words, _CHILD, int(key)))
        return out

    def source(self, rounding: Rounding, for_kernel: bool = False) -> RoundingSource:
        """The :class:`RoundingSource` of one quantisation: this generator, or a fresh seed for a Triton kernel."""
        if for_kernel:
            return RoundingSource(rounding, seed=self.next_seed() if rounding == "stochastic" else 0)
        return RoundingSource(rounding, generator=self.generator)


class TorchOps:
    """Quantisation steps through the plain-torch reference kernels (CPU, and CUDA without Triton)."""

    name = "torch"

    def encode(
        self,
        x: Tensor,
        bits: int,
        group: int,
        rounding: Rounding,
        rng: RoundingRNG,
        reference: Tensor | None = None,
        hadamard: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(subtract) (Hadamard) quantise (pack)."""
        fmt, source = QuantFormat(bits, group), rng.source(rounding)
        if reference is not None:
            return ref.quantize_difference(x, reference, fmt, source)
        if hadamard is not None:
            return ref.hadamard_quantize(x, fmt, hadamard, source)
        return ref.encode(x, fmt, source)

    def dequantize_sum_requantize(
        self,
        payloads: Tensor,
        scales: Tensor,
        bits_in: int,
        bits_out: int,
        group: int,
        rounding: Rounding,
        rng: RoundingRNG,
    ) -> tuple[Tensor, Tensor]:
        """Decode ``K`` rows, sum, encode again."""
        return ref.dequantize_sum_requantize(
            payloads, scales, QuantFormat(bits_in, group), QuantFormat(bits_out, group), rng.source(rounding)
        )

    def dequantize_sum_hadamard(
        self, payloads: Tensor, scales: Tensor, bits: int, group: int, hadamard: int | None
    ) -> Tensor:
        """Decode ``K`` rows, sum (, inverse Hadamard)."""
        return ref.dequantize_sum_hadamard(payloads, scales, QuantFormat(bits, group), hadamard)

    def dequantize_add_(self, target: Tensor, payload: Tensor, scales: Tensor, bits: int, group: int) -> None:
        """``target += decode(payload)``."""
        ref.dequantize_add_(target, payload, scales, QuantFormat(bits, group))


class TimedOps(TorchOps):
    """Wraps a :class:`TorchOps` and adds the wall time of every kernel call to ``stats.codec_seconds``.

    Meant for CPU tensors (the timing of asynchronous CUDA kernels would measure only their launch).

    Args:
        ops: the kernels to time.
        stats: where the time goes.
    """

    def __init__(self, ops: TorchOps, stats: CommStats) -> None:
        self.ops, self.stats, self.name = ops, stats, ops.name

    def _timed(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.stats.add_codec_time(time.perf_counter() - start)

    def encode(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        return self._timed(self.ops.encode, *args, **kwargs)

    def dequantize_sum_requantize(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        return self._timed(self.ops.dequantize_sum_requantize, *args, **kwargs)

    def dequantize_sum_hadamard(self, *args: Any, **kwargs: Any) -> Tensor:
        return self._timed(self.ops.dequantize_sum_hadamard, *args, **kwargs)

    def dequantize_add_(self, *args: Any, **kwargs: Any) -> None:
        self._timed(self.ops.dequantize_add_, *args, **kwargs)


class FusedOps(TorchOps):
    """The same steps through fused kernels that take the reference's arguments (one pass over memory each).

    Args:
        kernels: the kernel module (:mod:`~lightning_sdp.kernels.triton_quant` or
            :mod:`~lightning_sdp.kernels.numba_quant`).
        name: what the backend is called in logs.
    """

    def __init__(self, kernels: Any, name: str) -> None:
        self._k, self.name = kernels, name

    def encode(
        self,
        x: Tensor,
        bits: int,
        group: int,
        rounding: Rounding,
        rng: RoundingRNG,
        reference: Tensor | None = None,
        hadamard: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        source = rng.source(rounding, for_kernel=True)
        return self._k.encode(x, QuantFormat(bits, group), source, reference=reference, hadamard_size=hadamard)

    def dequantize_sum_requantize(
        self,
        payloads: Tensor,
        scales: Tensor,
        bits_in: int,
        bits_out: int,
        group: int,
        rounding: Rounding,
        rng: RoundingRNG,
    ) -> tuple[Tensor, Tensor]:
        formats = QuantFormat(bits_in, group), QuantFormat(bits_out, group)
        return self._k.dequantize_sum_requantize(payloads, scales, *formats, rng.source(rounding, for_kernel=True))

    def dequantize_sum_hadamard(
        self, payloads: Tensor, scales: Tensor, bits: int, group: int, hadamard: int | None
    ) -> Tensor:
        return self._k.dequantize_sum_hadamard(payloads, scales, QuantFormat(bits, group), hadamard)

    def dequantize_add_(self, target: Tensor, payload: Tensor, scales: Tensor, bits: int, group: int) -> None:
        self._k.dequantize_add_(target, payload, scales, QuantFormat(bits, group))


class TritonOps(FusedOps):
    """The fused Triton kernels (CUDA; CPU tensors under ``TRITON_INTERPRET=1``)."""

    def __init__(self) -> None:
        from lightning_sdp.kernels import triton_quant

        super().__init__(triton_quant, "triton")


class NumbaOps(FusedOps):
    """The fused, multi-threaded numba kernels (CPU), stochastic rounding from a counter-based stream."""

    def __init__(self) -> None:
        from lightning_sdp.kernels import numba_quant

        super().__init__(numba_quant, "numba")


def select_ops(backend: str, device: torch.device, *group_sizes: int) -> TorchOps:
    """The codec of ``kernel_backend=backend`` for tensors on ``device``: Triton, numba or the torch reference.

    ``"auto"`` takes the Triton kernels for CUDA tensors (when installed and every group size is a power of two),
    the numba kernels for CPU tensors (when installed), else the reference. A named backend that cannot run raises.

    Args:
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"numba"``.
        device: where the buffers live.
        group_sizes: the quantisation group sizes in use.
    """
    from lightning_sdp._imports import _NUMBA_AVAILABLE, _TRITON_AVAILABLE

    if backend == "torch":
        return TorchOps()
    if backend == "numba":
        if device.type != "cpu":
            raise ValueError(f"kernel_backend='numba' runs on CPU tensors, not {device}; use 'auto' or 'triton'.")
        return NumbaOps()  # raises with the install hint when numba is missing
    pow2 = all(size & (size - 1) == 0 for size in group_sizes)
    if backend == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "kernel_backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)."
            )
        if not pow2:
            raise ValueError(f"kernel_backend='triton' needs power-of-two group sizes, got {list(group_sizes)}.")
        return TritonOps()
    if device.type == "cuda" and _TRITON_AVAILABLE and pow2:
        return TritonOps()
    if device.type == "cpu" and _NUMBA_AVAILABLE:
        return NumbaOps()
    return TorchOps()


@dataclass
class Codec:
    """How one buffer's exchange quantises, and where it accounts what it sends.

    Attributes:
        ops: the kernels (torch reference, Triton or numba).
        rounding: ``"stochastic"`` or ``"nearest"``.
        rng: the rounding randomness of this buffer (a :meth:`RoundingRNG.child` per bucket).
        stats: accounting, updated in place (``None``: not accounted).
    """

    ops: TorchOps
    rounding: Rounding
    rng: RoundingRNG
    stats: CommStats | None = None


def _sent_fraction(k: int) -> float:
    return (k - 1) / k


def first_level_bits(topo: Topology, fmt: GradientFormat) -> int:
    """Bits of the codes each rank sends first (intra-node bits, or inter-node bits with one rank per node)."""
    bits = fmt.intra_bits if topo.intra_size > 1 else fmt.inter_bits
    if bits is None:
        raise ValueError("first_level_bits needs a quantised gradient format.")
    return bits


def encode_gradients(
    flat: Tensor, topo: Topology, fmt: GradientFormat, group_size: int, codec: Codec
) -> tuple[Tensor, Tensor]:
    """The local first step of :func:`reduce_scatter_gradients`: (Hadamard) quantise the whole buffer.

    Its scales (``absmax / qmax`` of each group of the values actually quantised) tell whether the exchange can
    overflow, before anything is sent. Pass the result to :func:`reduce_scatter_gradients` as ``encoded``.

    Args:
        flat: fp32 buffer of ``world_size * S`` values (already divided by the world size).
        topo: process topology.
        fmt: a quantised gradient format.
        group_size: quantisation group.
        codec: kernels and rounding (its ``stats`` are not used: nothing is sent).

    Returns:
        ``(payload, scales)`` of the first level.
    """
    s = flat.numel() // topo.world_size
    if flat.numel() % topo.world_size or s % group_size or (fmt.hadamard and s % fmt.hadamard):
        raise ValueError(
            f"The gradient buffer ({flat.numel()} values) is not a whole number of shards of whole groups of "
            f"{group_size} for {topo.world_size} ranks; pad the buffer."
        )
    bits = first_level_bits(topo, fmt)
    return codec.ops.encode(flat, bits, group_size, codec.rounding, codec.rng, hadamard=fmt.hadamard)


def max_safe_scale(bits: int, world_size: int, hadamard: int | None) -> float:
    """Largest first-level scale for which the exchange cannot overflow fp32.

    A decoded value is at most ``qmax * scale`` (the group's absmax); the sums of the exchange add one such value
    per rank, and the inverse Hadamard transform adds up to ``hadamard`` of them before dividing. A factor 2 covers
    rounding. Gradients this large (about ``1e36 / world_size`` after the transform) are a diverged run.
    """
    return torch.finfo(torch.float32).max / (2.0 * world_size * ref.qmax(bits) * (hadamard or 1))


def _pack(payload: Tensor, scales: Tensor) -> Tensor:
    """One ``uint8`` row per destination: its codes then its fp32 scales as bytes (one collective instead of two)."""
    return torch.cat((payload, scales.contiguous().view(torch.uint8).view(scales.shape[0], -1)), dim=1)


def _unpack(rows: Tensor, payload_bytes: int) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`_pack`: ``(payload (K, payload_bytes), scales (K, groups) fp32)``."""
    return rows[:, :payload_bytes], rows[:, payload_bytes:].contiguous().view(torch.float32)


class GradientExchange:
    """One buffer's reduce-scatter, cut at the boundary between the two levels so buckets can be pipelined.

    :meth:`first` quantises (after the Hadamard transform) and runs everything that uses the intra-node group
    (8-bit all-to-all, dequantise + sum + re-quantise); :meth:`second` runs what uses the inter-node group (4-bit
    all-to-all, dequantise + sum + inverse Hadamard). Run on two threads, bucket ``k``'s inter-node all-to-all
    overlaps bucket ``k + 1``'s intra-node one, as the paper pipelines them. Codes and scales travel in one
    collective per level. ``first()`` then ``second()`` on one thread is :func:`reduce_scatter_gradients`.

    Args:
        flat: fp32 buffer of ``world_size * S`` values, identical layout on every rank (already divided by W).
        topo: process topology.
        fmt: bit widths / transform (see :func:`~lightning_sdp.plugins.sdp4bit.formats.gradient_format`).
        group_size: quantisation group (``S`` must be a multiple of it when quantising).
        codec: kernels, rounding and accounting of this buffer.
        encoded: the result of :func:`encode_gradients` on ``flat`` when the caller already computed it.
    """

    def __init__(
        self,
        flat: Tensor,
        topo: Topology,
        fmt: GradientFormat,
        group_size: int,
        codec: Codec,
        encoded: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        w = topo.world_size
        if flat.numel() % w:
            raise ValueError(f"The gradient buffer ({flat.numel()}) is not divisible by the world size ({w}).")
        self.s = flat.numel() // w
        if fmt.quantized and w > 1 and (self.s % group_size or (fmt.hadamard and self.s % fmt.hadamard)):
            raise ValueError(
                f"The shard size {self.s} is not a whole number of groups of {group_size}; pad the buffer."
            )
        self.flat, self.topo, self.fmt, self.group_size = flat, topo, fmt, group_size
        self.codec, self.ops, self.stats = codec, codec.ops, codec.stats
        self.encoded = encoded
        self._partial: Any = None
        self._result: Tensor | None = None

    def encode(self) -> tuple[Tensor, Tensor] | None:
        """Quantise the whole buffer for the first level (once); ``None`` when nothing is quantised."""
        if not self.fmt.quantized or self.topo.world_size == 1:
            return None
        if self.encoded is None:
            self.encoded = encode_gradients(self.flat, self.topo, self.fmt, self.group_size, self.codec)
        return self.encoded

    def first(self) -> None:
        """Quantise and run the intra-node level (nothing to send with one rank per node)."""
        topo, fmt, s = self.topo, self.fmt, self.s
        n_inter, n_intra = topo.inter_size, topo.intra_size
        if topo.world_size == 1:
            self._result = self.flat.clone()
            return
        if not fmt.quantized:
            self._first_fp32()
            return
        payload, scales = self.encode()  # type: ignore[misc]
        if n_intra == 1:
            self._partial = (payload, scales, first_level_bits(topo, fmt))
            return
        bits = first_level_bits(topo, fmt)
        fmt_first = QuantFormat(bits, self.group_size)
        nbytes, ngroups = fmt_first.payload_bytes(s), fmt_first.num_groups(s, "shard")
        # Chunk j goes to local peer j: the shards {j * N + n} it owns lie side by side (local-major ownership).
        send_p = payload.view(n_intra, n_inter * nbytes)
        send_s = scales.view(n_intra, n_inter * ngroups)
        send = _pack(send_p, send_s)
        recv = torch.empty_like(send)
        all_to_all(recv, send, topo.intra_group)
        if self.stats is not None:
            frac = _sent_fraction(n_intra)
            self.stats.record("grad_intra", frac * (send_p.numel() + 4 * send_s.numel()), frac * n_inter * n_intra * s)
        recv_p, recv_s = _unpack(recv, send_p.shape[1])
        if n_inter == 1:
            self._result = self.ops.dequantize_sum_hadamard(recv_p, recv_s, bits, self.group_size, fmt.hadamard)
            return
        assert fmt.inter_bits is not None
        # The node's partial sums of shards {local * N + n}, re-quantised for the inter-node level.
        codec = self.codec
        payload, scales = self.ops.dequantize_sum_requantize(
            recv_p, recv_s, bits, fmt.inter_bits, self.group_size, codec.rounding, codec.rng
        )
        self._partial = (payload, scales, fmt.inter_bits)

    def second(self) -> Tensor:
        """Run the inter-node level and return this rank's reduced shard (fp32, ``S`` values)."""
        if self._result is not None:
            return self._result
        topo, fmt, s = self.topo, self.fmt, self.s
        n_inter = topo.inter_size
        if not fmt.quantized:
            return self._second_fp32()
        payload, scales, bits = self._partial
        send_p, send_s = payload.view(n_inter, -1), scales.view(n_inter, -1)
        send = _pack(send_p, send_s)
        recv = torch.empty_like(send)
        all_to_all(recv, send, topo.inter_group if topo.intra_size > 1 else topo.world_group)
        if self.stats is not None:
            frac = _sent_fraction(n_inter)
            self.stats.record("grad_inter", frac * (send_p.numel() + 4 * send_s.numel()), frac * n_inter * s)
        recv_p, recv_s = _unpack(recv, send_p.shape[1])
        self._partial = None
        return self.ops.dequantize_sum_hadamard(recv_p, recv_s, bits, self.group_size, fmt.hadamard)

    def _first_fp32(self) -> None:
        topo, s = self.topo, self.s
        n_inter, n_intra = topo.inter_size, topo.intra_size
        data = self.flat.float()
        if n_intra > 1:
            send = data.view(n_intra, n_inter * s)
            if self.stats is not None:
                frac = _sent_fraction(n_intra)
                self.stats.record("grad_intra", frac * 4 * send.numel(), frac * send.numel())
            data = reduce_rows(send, topo.intra_group)
        if n_inter == 1:
            self._result = data
        else:
            self._partial = data

    def _second_fp32(self) -> Tensor:
        topo, s = self.topo, self.s
        n_inter = topo.inter_size
        send = self._partial.view(n_inter, s)
        if self.stats is not None:
            frac = _sent_fraction(n_inter)
            self.stats.record("grad_inter", frac * 4 * send.numel(), frac * send.numel())
        self._partial = None
        return reduce_rows(send, topo.inter_group if topo.intra_size > 1 else topo.world_group)


def record_allreduce(stats: CommStats, numel: int, world: int) -> None:
    """Count an fp32 ring all-reduce of ``numel`` values: each rank sends ``2 (W - 1) / W`` of them."""
    sent = 2 * _sent_fraction(world) * numel
    stats.record("grad_allreduce", 4 * sent, sent)


class AllReduceExchange:
    """DDP's exchange of one bucket: an fp32 all-reduce of the whole buffer, so every rank gets every sum.

    The same interface as :class:`GradientExchange` (``encode``, ``first`` on the first worker thread, ``second``);
    used while ``"auto"`` replicates the optimizer (see :mod:`~lightning_sdp.plugins.sdp4bit.replication`).

    Args:
        flat: fp32 buffer of the bucket's gradients (already divided by the world size), summed in place.
        group: process group of all ranks (the strategy's own, as the collectives run on a worker thread).
        stats: accounting, updated in place.
    """

    def __init__(self, flat: Tensor, group: Any, stats: CommStats | None = None) -> None:
        self.flat, self.group, self.stats = flat, group, stats

    def encode(self) -> None:
        """Nothing is quantised."""
        return None

    def first(self) -> None:
        """All-reduce the buffer (a ring sends ``2 (W - 1) / W`` of its bytes from every rank)."""
        dist.all_reduce(self.flat, group=self.group)
        if self.stats is not None:
            record_allreduce(self.stats, self.flat.numel(), dist.get_world_size(self.group))

    def second(self) -> Tensor:
        """The summed buffer."""
        return self.flat


def reduce_scatter_gradients(
    flat: Tensor,
    topo: Topology,
    fmt: GradientFormat,
    group_size: int,
    codec: Codec,
    encoded: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Sum ``flat`` over all ranks and return this rank's shard (``flat`` should already be divided by W).

    Args:
        flat: fp32 buffer of ``world_size * S`` values, identical layout on every rank.
        topo: process topology.
        fmt: bit widths / transform (see :func:`~lightning_sdp.plugins.sdp4bit.formats.gradient_format`).
        group_size: quantisation group (``S`` must be a multiple of it when quantising).
        codec: kernels, rounding and accounting.
        encoded: the result of :func:`encode_gradients` on ``flat`` when the caller already computed it.

    Returns:
        The reduced shard ``[k * S, (k + 1) * S)`` for ``k = topo.shard`` (local-major) as a new fp32 tensor.
    """
    exchange = GradientExchange(flat, topo, fmt, group_size, codec, encoded)
    exchange.first()
    return exchange.second()


class WeightExchange:
    """One buffer's weight all-gather, cut in two stages so buckets can be pipelined.

    :meth:`send` quantises this rank's shard (the difference to the reconstructed weights for ``"qwd"``) and
    all-gathers codes and scales in one collective; :meth:`apply` decodes every rank's codes into the model
    buffer. With the two stages on two threads, bucket ``k``'s decoding overlaps bucket ``k + 1``'s all-gather.

    Args:
        model_flat: the model weights every rank holds (flat, model dtype, ``world_size * S`` values).
        master_shard: this rank's exact fp32 shard (``S`` values).
        topo: process topology.
        fmt: mode (``"qwd"``: quantised differences, ``"qw"``: quantised weights, ``"none"``), bits and group size.
        codec: kernels, rounding and accounting of this buffer.
        group: process group of all ranks (default: the default group).
    """

    def __init__(
        self,
        model_flat: Tensor,
        master_shard: Tensor,
        topo: Topology,
        fmt: WeightFormat,
        codec: Codec,
        group: Any = None,
    ) -> None:
        w, s = topo.world_size, master_shard.numel()
        mode, group_size = fmt.mode, fmt.group_size
        if model_flat.numel() != w * s:
            raise ValueError(f"model buffer ({model_flat.numel()}) != world size ({w}) x shard ({s}).")
        if mode not in WEIGHT_MODES:
            raise ValueError(f"weight_compression must be one of {WEIGHT_MODES}, got {mode!r}.")
        if mode != "none" and w > 1 and s % group_size:
            raise ValueError(f"The shard size {s} is not a whole number of weight groups of {group_size}.")
        self.model_flat, self.master, self.topo, self.mode = model_flat, master_shard, topo, mode
        self.bits, self.group_size, self.codec, self.ops = fmt.bits, group_size, codec, codec.ops
        self.stats, self.group = codec.stats, group
        self.redone = False  # the codes had a non-finite scale: sent again uncompressed
        self._gathered: Tensor | None = None
        self._nbytes = 0

    def _hierarchical(self) -> bool:
        topo = self.topo
        own_group = self.group is None or self.group is topo.world_group
        return own_group and topo.weight_inter_group is not None and topo.weight_intra_group is not None

    def _gather(self, out: Tensor, row: Tensor, elements: int) -> None:
        """All-gather ``row`` of every rank into ``out`` (shard order) and account the bytes this rank sends.

        With several nodes of several processes it runs in two stages: across nodes among the ranks with this
        local index, then inside the node. Each shard then crosses to every other node once, instead of riding a
        ring over every rank (whose node-crossing edges carry all ``W - 1`` shards of a rank). With local-major
        ownership the first stage gathers a contiguous block of shards and the second lands the blocks in order.
        """
        topo, n = self.topo, row.numel()
        nbytes = n * row.element_size()
        nodes, local = topo.inter_size, topo.intra_size
        if not self._hierarchical():
            if nodes > 1 and local > 1:  # a ring over the ranks (rank order): put the rows in shard order
                by_rank = torch.empty_like(out)
                all_gather_rows(by_rank, row, self.group)
                out.view(local, nodes, n).copy_(in_shard_order(by_rank, topo.world_size, local))
            else:
                all_gather_rows(out, row, self.group)
            if self.stats is not None:
                self.stats.record("weight", (topo.world_size - 1) * nbytes, (topo.world_size - 1) * elements)
            return
        across = torch.empty(nodes * n, dtype=row.dtype, device=row.device)
        all_gather_rows(across, row, topo.weight_inter_group)
        all_gather_rows(out, across, topo.weight_intra_group)
        if self.stats is not None:
            self.stats.record("weight_inter", (nodes - 1) * nbytes, (nodes - 1) * elements)
            self.stats.record("weight_intra", (local - 1) * nodes * nbytes, (local - 1) * nodes * elements)

    def send(self) -> None:
        """Quantise this rank's shard and all-gather every rank's codes (the whole exchange for ``"none"``)."""
        w, s, topo = self.topo.world_size, self.master.numel(), self.topo
        if w == 1:
            return
        if self.mode == "none":
            self._gather(self.model_flat, self.master.to(self.model_flat.dtype), s)
            return
        lo = topo.shard * s
        reference = self.model_flat[lo : lo + s] if self.mode == "qwd" else None
        codec = self.codec
        payload, scales = self.ops.encode(
            self.master, self.bits, self.group_size, codec.rounding, codec.rng, reference=reference
        )
        row = _pack(payload.view(1, -1), scales.view(1, -1))
        gathered = torch.empty(w, row.shape[1], dtype=row.dtype, device=row.device)
        self._gather(gathered.view(-1), row.view(-1), s)
        self._gathered, self._nbytes = gathered, payload.numel()
        if not bool(torch.isfinite(_unpack(gathered, self._nbytes)[1]).all()):
            self._redo_uncompressed()  # every rank sees the same scales: the same decision, no extra collective

    def _redo_uncompressed(self) -> None:
        """The divergence guard: a rank's codes have a non-finite scale, so the weights travel uncompressed instead;
        when the master weights themselves are non-finite, raise and leave the model's weights as they were."""
        full = torch.empty_like(self.model_flat)
        self._gather(full, self.master.to(self.model_flat.dtype), self.master.numel())
        if not bool(torch.isfinite(full).all()):
            raise FloatingPointError(
                "SDP4BitStrategy: the optimizer step made master weights non-finite (NaN/Inf); the model keeps its "
                "last finite weights. Lower the learning rate, clip the gradients (`gradient_clip_val`) or check "
                "the loss for a division by zero."
            )
        self.model_flat.copy_(full)
        self._gathered, self.redone = None, True

    def apply(self) -> None:
        """Decode every rank's codes into the model buffer (``w += decode(d)``; ``w = decode(w)`` for ``"qw"``)."""
        if self.topo.world_size == 1:
            self.model_flat.copy_(self.master)
            return
        if self._gathered is None:
            return
        payloads, scales = _unpack(self._gathered, self._nbytes)
        if self.mode == "qw":
            self.model_flat.zero_()
        self.ops.dequantize_add_(self.model_flat, payloads.reshape(-1), scales.reshape(-1), self.bits, self.group_size)
        self._gathered = None


def all_gather_weights(
    model_flat: Tensor, master_shard: Tensor, topo: Topology, fmt: WeightFormat, codec: Codec, group: Any = None
) -> None:
    """Bring every rank's full model copy ``model_flat`` up to date with the master shards (in place).

    Args:
        model_flat: the model weights every rank holds (flat, model dtype, ``world_size * S`` values).
        master_shard: this rank's exact fp32 shard (``S`` values).
        topo: process topology.
        fmt: mode (``"qwd"``, ``"qw"`` or ``"none"``), bits and group size of the weight codes.
        codec: kernels, rounding and accounting.
        group: process group of all ranks (default: the default group).
    """
    exchange = WeightExchange(model_flat, master_shard, topo, fmt, codec, group)
    exchange.send()
    exchange.apply()


def padded_shard_size(numel: int, world_size: int, alignment: int) -> int:
    """Smallest shard size ``S`` (a multiple of ``alignment``) with ``world_size * S >= numel``."""
    if alignment < 1:
        raise ValueError(f"alignment must be positive, got {alignment}.")
    per_rank = math.ceil(numel / world_size) if numel else 1
    return max(alignment, math.ceil(per_rank / alignment) * alignment)
