"""The options of :class:`~lightning_sdp.plugins.sdp4bit.SDP4BitStrategy`, checked once when they are set."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from lightning_sdp._options import check_options
from lightning_sdp.kernels.quantization import Rounding
from lightning_sdp.plugins.sdp4bit.formats import (
    GradientCompression,
    GradientFormat,
    WeightCompression,
    WeightFormat,
    WeightMode,
    gradient_format,
)

# Every param group is padded to a whole number of groups per rank: a huge group pads a small model to gigabytes.
MAX_GROUP_SIZE = 2**16
# The Hadamard transform builds a dense n x n matrix.
MAX_HADAMARD_SIZE = 1024


@dataclass(frozen=True)
class SDP4BitConfig:
    """What SDP4Bit compresses and how it overlaps; the arguments of :class:`SDP4BitStrategy` of the same names.

    Construction checks every value once (:func:`~lightning_sdp._options.check_options` from the annotations, then
    the ranges): a wrong type raises ``TypeError``, a wrong value ``ValueError``, each naming the argument and what to
    pass instead. :attr:`weight_candidates`, :attr:`gradient_candidates`, :attr:`weight_format`,
    :attr:`gradient_format` and :attr:`alignment` are derived from the options.
    """

    weight_compression: WeightCompression = "auto"
    gradient_compression: GradientCompression = "auto"
    weight_bits: int = 4
    weight_group_size: int = 2048
    gradient_intra_bits: int = 8
    gradient_inter_bits: int = 4
    gradient_group_size: int = 128
    hadamard_size: int = 32
    rounding: Rounding = "stochastic"
    intra_node_size: int | None = None
    nonfinite_gradients: Literal["raise", "skip"] = "raise"
    seed: int = 0
    kernel_backend: Literal["auto", "torch", "triton", "numba"] = "auto"
    track_drift: bool = True
    allow_any_optimizer: bool = False
    bucket_size_mb: float | Literal["auto"] | None = 4.0
    overlap: bool = True
    overlap_param_gather: bool = False
    log_metrics: bool = True
    auto_trial_steps: int = 3
    auto_recheck_every_n_steps: int = 1000
    optimizer_state: Literal["auto", "shard"] = "auto"
    gradients_in_hooks: bool = True

    def __post_init__(self) -> None:
        check_options(self, "SDP4BitStrategy")
        for name in ("weight_bits", "gradient_intra_bits", "gradient_inter_bits"):
            if getattr(self, name) not in (4, 8):
                raise ValueError(f"{name} must be 4 or 8, got {getattr(self, name)}.")
        for name in ("weight_group_size", "gradient_group_size"):
            _check_group_size(name, getattr(self, name))
        _check_hadamard_size(self.hadamard_size)
        if self.auto_trial_steps < 1:
            raise ValueError(f"auto_trial_steps must be at least 1, got {self.auto_trial_steps}.")
        if self.auto_recheck_every_n_steps < 0:
            raise ValueError(
                f"auto_recheck_every_n_steps must be >= 0 (0: choose once), got {self.auto_recheck_every_n_steps}."
            )
        if self.gradient_compression in ("tlq_hs", "auto") and self.gradient_group_size % self.hadamard_size:
            raise ValueError(
                f"gradient_group_size ({self.gradient_group_size}) must be a multiple of hadamard_size "
                f"({self.hadamard_size}) so that every quantisation group holds whole Hadamard blocks."
            )
        if self.intra_node_size is not None and self.intra_node_size < 1:
            raise ValueError(f"intra_node_size must be positive, got {self.intra_node_size}.")
        self._check_bucket_size()

    def _check_bucket_size(self) -> None:
        size = self.bucket_size_mb
        if isinstance(size, (int, float)) and not (math.isfinite(size) and size > 0):
            raise ValueError(
                f"bucket_size_mb must be a positive number of MiB, None for one bucket per param group, or 'auto' "
                f"(chosen at set-up from the measured link), got {size!r}."
            )

    @property
    def auto(self) -> bool:
        """Whether either compression is ``"auto"`` (chosen while training from what the strategy measures)."""
        return "auto" in (self.weight_compression, self.gradient_compression)

    @property
    def weight_candidates(self) -> list[WeightFormat]:
        """The weight formats the all-gather may use, most compressed first.

        One for a fixed mode; for ``"auto"``: ``weight_bits`` qWD, then uncompressed (``"qw"`` sends as many bytes
        as qWD and loses more, so it is never chosen).
        """
        modes: list[WeightMode] = ["qwd", "none"] if self.weight_compression == "auto" else [self.weight_compression]
        return [WeightFormat(mode, self.weight_bits, self.weight_group_size) for mode in modes]

    @property
    def gradient_candidates(self) -> list[GradientFormat]:
        """The gradient formats the reduce-scatter may use, most compressed first.

        One for a fixed mode; for ``"auto"``: TLq-HS with the configured bits (8-bit intra / 4-bit inter by
        default), TLq-HS with the intra-node bits at both levels, then fp32.
        """
        if self.gradient_compression != "auto":
            return [self.gradient_format]
        intra, inter, hadamard = self.gradient_intra_bits, self.gradient_inter_bits, self.hadamard_size
        out = [GradientFormat(intra, inter, hadamard), GradientFormat(intra, intra, hadamard)]
        return [*dict.fromkeys(out), GradientFormat(None, None, None)]

    @property
    def weight_format(self) -> WeightFormat:
        """Mode, bits and group size of the weight all-gather (with ``"auto"``: the first candidate, qWD)."""
        return self.weight_candidates[0]

    @property
    def gradient_format(self) -> GradientFormat:
        """Bit widths and Hadamard block of the gradient reduce-scatter (``"ulq"``: 4 bits at every level; with
        ``"auto"``: the first candidate, TLq-HS)."""
        if self.gradient_compression == "auto":
            return self.gradient_candidates[0]
        return gradient_format(
            self.gradient_compression, self.gradient_intra_bits, self.gradient_inter_bits, self.hadamard_size
        )

    @property
    def alignment(self) -> int:
        """Every shard is a multiple of this many values (groups, Hadamard blocks, int4 byte pairs) for every
        candidate format, so ``"auto"`` can switch formats without re-sharding."""
        sizes = [2]
        if any(w.quantized for w in self.weight_candidates):
            sizes.append(self.weight_group_size)
        for grads in self.gradient_candidates:
            if grads.quantized:
                sizes.append(self.gradient_group_size)
            if grads.hadamard:
                sizes.append(grads.hadamard)
        return math.lcm(*sizes)

    @property
    def bucket_numel(self) -> int | None:
        """fp32 values per bucket (``None``: one bucket per param group, or chosen at set-up for ``"auto"``)."""
        if self.bucket_size_mb is None or self.bucket_size_mb == "auto":
            return None
        return max(1, int(self.bucket_size_mb * 2**20) // 4)


def _check_group_size(name: str, size: int) -> None:
    if size < 2 or size % 2:
        raise ValueError(f"{name} must be a positive even number (two 4-bit codes per byte), got {size}.")
    if size > MAX_GROUP_SIZE:
        raise ValueError(
            f"{name} must be at most {MAX_GROUP_SIZE}, got {size}: every param group is padded to a whole number of "
            "groups per rank, so a huge group pads a small model to gigabytes, and one fp32 scale per huge group "
            "quantises coarsely. The paper uses 2048 (weights) and 128 (gradients)."
        )


def _check_hadamard_size(size: int) -> None:
    if size < 1 or size & (size - 1):
        raise ValueError(f"hadamard_size must be a power of two, got {size}.")
    if size > MAX_HADAMARD_SIZE:
        raise ValueError(
            f"hadamard_size must be at most {MAX_HADAMARD_SIZE}, got {size} (the transform builds a dense n x n "
            "matrix; the paper uses 32)."
        )
