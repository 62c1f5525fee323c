"""What travels on the wire for weights and gradients: the compression modes and their bit widths.

``WeightFormat`` describes the weight all-gather (qWD, Jia et al. 2024, Sec. 3.1), ``GradientFormat`` the gradient
reduce-scatter (TLq-HS, Sec. 3.2). Both are derived once from the strategy's options by :class:`SDP4BitConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

WeightMode = Literal["qwd", "qw", "none"]
WeightCompression = Literal["auto", "qwd", "qw", "none"]
GradientCompression = Literal["auto", "tlq_hs", "tlq", "ulq", "none"]
# the fixed modes; ``"auto"`` chooses among some of them while training (see ``auto``)
WEIGHT_MODES = ("qwd", "qw", "none")
GRADIENT_MODES = ("tlq_hs", "tlq", "ulq", "none")


@dataclass(frozen=True)
class WeightFormat:
    """Codes of the weight all-gather.

    Attributes:
        mode: ``"qwd"`` (quantised differences to the weights every rank already holds), ``"qw"`` (quantised
            weights) or ``"none"`` (the weights in the model dtype).
        bits: bits of the codes (4 or 8; unused for ``"none"``).
        group_size: values per fp32 scale (unused for ``"none"``).
    """

    mode: WeightMode
    bits: int
    group_size: int

    @property
    def quantized(self) -> bool:
        """Whether the weights travel as quantised codes."""
        return self.mode != "none"

    @property
    def differences(self) -> bool:
        """Whether the codes are differences to the reconstructed weights (qWD), so errors do not accumulate."""
        return self.mode == "qwd"

    def describe(self) -> str:
        """The format in words, e.g. ``"4-bit qwd"`` or ``"uncompressed"``."""
        return f"{self.bits}-bit {self.mode}" if self.quantized else "uncompressed"


@dataclass(frozen=True)
class GradientFormat:
    """Bit widths and transform of one gradient mode.

    Attributes:
        intra_bits: bits inside a node (``None``: fp32).
        inter_bits: bits between nodes (``None``: fp32).
        hadamard: Hadamard block size, or ``None``.
    """

    intra_bits: int | None
    inter_bits: int | None
    hadamard: int | None

    @property
    def quantized(self) -> bool:
        """Whether any level is quantised."""
        return self.intra_bits is not None

    def describe(self) -> str:
        """The format in words, e.g. ``"8-bit intra / 4-bit inter, Hadamard 32"`` or ``"fp32"``."""
        if not self.quantized:
            return "fp32"
        hadamard = f", Hadamard {self.hadamard}" if self.hadamard else ""
        return f"{self.intra_bits}-bit intra / {self.inter_bits}-bit inter{hadamard}"


def gradient_format(mode: str, intra_bits: int, inter_bits: int, hadamard_size: int) -> GradientFormat:
    """The :class:`GradientFormat` of ``gradient_compression=mode``.

    ``"ulq"`` uses 4 bits at every level and no transform (the uniform baseline the paper compares against).
    """
    if mode == "tlq_hs":
        return GradientFormat(intra_bits, inter_bits, hadamard_size)
    if mode == "tlq":
        return GradientFormat(intra_bits, inter_bits, None)
    if mode == "ulq":
        return GradientFormat(4, 4, None)
    if mode == "none":
        return GradientFormat(None, None, None)
    raise ValueError(f"gradient_compression must be one of {GRADIENT_MODES}, got {mode!r}.")


@dataclass
class ActiveFormats:
    """The formats the next exchanges use: fixed for fixed modes, switched between optimizer steps by ``"auto"``.

    Every exchange reads them when it is launched and keeps what it read, so a switch never changes an exchange in
    flight. Weight formats can switch at any step: qWD encodes against the weights every rank holds, whatever
    format brought them.

    Attributes:
        weight: the weight all-gather's format.
        gradient: the gradient reduce-scatter's format.
        replicated: DDP's exchange instead (an fp32 all-reduce of the gradients, a replicated optimizer step and no
            weight all-gather; see ``replication``).
    """

    weight: WeightFormat
    gradient: GradientFormat
    replicated: bool = False
