"""The settings of :class:`~lightning_sdp.models.simplex.SimpleXModule`, validated once and with defaults resolved."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, NoReturn

import numpy as np

from lightning_sdp._options import check_options
from lightning_sdp.models.simplex.auto import SOFTMAX_GRAD_CLIP, InteractionStats, auto_settings

Aggregator = Literal["mean", "user_attention", "self_attention"]
Backend = Literal["fused", "reference"]
Optimizer = Literal["auto", "adam", "sgd", "rowwise_adagrad"]
Loss = Literal["ccl", "softmax"]
Auto = Literal["auto"]
ClipMode = Literal["sample", "row_buffer"]

_DEFAULT_LR = {"adam": 1e-4, "sgd": 0.05, "rowwise_adagrad": 0.1}


@dataclass(frozen=True)
class SimpleXConfig:
    """Every argument of :class:`~lightning_sdp.models.simplex.SimpleXModule` (see its docstring for each one).

    Construction checks every argument against its annotation (:func:`lightning_sdp._options.check_options`: a
    ``TypeError`` for a wrong type, a ``ValueError`` for a choice it does not offer), then the ranges and
    combinations (a ``ValueError`` that names the argument); :attr:`optimizer_name`,
    :attr:`learning_rate` and :attr:`initial_std` resolve the ``"auto"`` / ``None`` defaults, which depend on the
    backend.
    """

    num_users: int | None = None
    num_items: int | None = None
    dim: int = 64
    g: float = 1.0
    aggregator: Aggregator = "mean"
    margin: float = 0.9
    negative_weight: float = 150.0
    num_negatives: int = 64
    max_history: int = 100
    backend: Backend = "fused"
    optimizer: Optimizer = "auto"
    lr: float | None = None
    adagrad_eps: float = 1e-8
    lr_schedule: Literal["constant", "linear"] = "constant"
    row_norm: float | None = None
    weight_decay: float = 0.0
    init_std: float | None = None
    init: Literal["normal", "svd"] = "normal"
    sampler: Literal["uniform", "tile"] = "uniform"
    tile_size: int = 512
    tile_refresh: int = 2048
    v_sync: int = 32
    aggregator_lr_scale: float = 1.0
    aggregator_weight_decay: float = 0.0
    dropout: float = 0.0
    k: int = 20
    seed: int = 0
    loss: Loss | Auto = "auto"
    temperature: float = 0.07
    grad_clip: float | Auto | None = "auto"
    grad_clip_mode: ClipMode = "sample"
    negatives_exclude_positive: bool = True
    history_grad: bool = True

    def __post_init__(self) -> None:
        check_options(self, "SimpleXModule")  # types and Literal choices: TypeError / ValueError naming the option
        self._check_combinations()
        self._check_sizes()
        self._check_rates()

    def _fail(self, message: str) -> NoReturn:
        raise ValueError(f"SimpleXModule: {message}")

    def _check_combinations(self) -> None:
        """The combinations of choices the backends cannot run."""
        if self.backend == "fused" and self.optimizer_name == "adam":
            self._fail(
                "the fused backend updates rows in place per sample; use optimizer='sgd' or 'rowwise_adagrad' "
                "(Adam's per-coordinate state is not kept by the kernel)."
            )
        if self.sampler == "tile" and self.backend != "fused":
            self._fail("the tile sampler is part of the fused kernel; use backend='fused'.")
        clip = self.grad_clip
        if self.grad_clip_mode == "row_buffer" and (clip == "auto" or clip is None or self.optimizer_name != "sgd"):
            self._fail(
                "grad_clip_mode='row_buffer' (HEAT's running gradient buffers) clips those buffers: it needs a numeric "
                f"grad_clip and optimizer='sgd', got grad_clip={clip!r}, optimizer={self.optimizer!r}."
            )
        if not self.history_grad and self.aggregator != "mean":
            self._fail(
                "history_grad=False (HEAT's code: the history rows only feed the aggregator) is a rule of the mean "
                f"aggregator; use aggregator='mean' or history_grad=True, got aggregator={self.aggregator!r}."
            )
        if self.grad_clip_value is not None and self.uses_history and self.aggregator != "mean":
            # the attention keys pass gradient to the item rows summed over a batch, not sample by sample
            self._fail(
                f"grad_clip clips per-sample gradients, which the {self.aggregator!r} aggregator does not form; use "
                "aggregator='mean' (or g=1) with grad_clip, or grad_clip=None."
            )

    def _check_sizes(self) -> None:
        """Dimensions, counts and the sampler's tile."""
        if self.dim <= 0 or self.num_negatives <= 0 or self.max_history < 0 or self.k <= 0:
            self._fail(
                f"dim, num_negatives and k must be positive and max_history >= 0; got dim={self.dim}, "
                f"num_negatives={self.num_negatives}, max_history={self.max_history}, k={self.k}."
            )
        if self.sampler == "tile" and (self.tile_size <= 0 or self.tile_refresh <= 0):
            self._fail(f"tile_size and tile_refresh must be positive, got {self.tile_size}, {self.tile_refresh}.")
        if self.v_sync <= 0:
            self._fail(f"v_sync must be positive, got {self.v_sync}.")

    def _check_rates(self) -> None:
        """The gate, norms, rates, decays and dropout."""
        if not 0.0 <= self.g <= 1.0:
            self._fail(f"the gate g must be in [0, 1], got {self.g}.")
        if self.row_norm is not None and not self.row_norm > 0:
            self._fail(f"row_norm must be positive or None, got {self.row_norm}.")
        if self.adagrad_eps <= 0:
            self._fail(f"adagrad_eps must be positive, got {self.adagrad_eps}.")
        if self.aggregator_lr_scale < 0:
            self._fail(f"aggregator_lr_scale must be >= 0, got {self.aggregator_lr_scale}.")
        if self.aggregator_weight_decay < 0:
            self._fail(f"aggregator_weight_decay must be >= 0, got {self.aggregator_weight_decay}.")
        if not 0.0 <= self.dropout < 1.0:
            self._fail(f"dropout must be in [0, 1), got {self.dropout}.")
        with np.errstate(divide="ignore", over="ignore"):
            inverse = np.float32(1.0) / np.float32(self.temperature)
        if not (self.temperature > 0 and np.isfinite(self.temperature) and np.isfinite(inverse)):
            self._fail(
                f"temperature must be a positive number whose inverse is finite in float32 (the kernels divide by it), "
                f"got {self.temperature}; use e.g. 0.07 (HEAT's), between about 1e-38 and 1e38."
            )
        if self.grad_clip_value is not None and not self.grad_clip_value > 0:
            self._fail(f"grad_clip must be positive, None (no clipping) or 'auto', got {self.grad_clip}.")

    @property
    def loss_name(self) -> str:
        """The loss trained: ``"auto"`` not yet resolved from the data (see :meth:`with_data`) trains CCL."""
        return "ccl" if self.loss == "auto" else self.loss

    @property
    def grad_clip_value(self) -> float | None:
        """The clipping bound applied: ``"auto"`` not yet resolved from the data clips nothing."""
        return None if self.grad_clip == "auto" else self.grad_clip

    @property
    def auto_fields(self) -> tuple[str, ...]:
        """The arguments still ``"auto"``, resolved from the training interactions by :meth:`with_data`."""
        return tuple(name for name in ("loss", "grad_clip") if getattr(self, name) == "auto")

    def with_data(self, stats: InteractionStats | None) -> SimpleXConfig:
        """This config with its ``"auto"`` arguments chosen for the training data (:func:`.auto.auto_settings`).

        ``grad_clip="auto"`` follows the loss that is trained (the chosen one, or the one given), and never clips
        under an attention aggregator with ``g < 1``, which forms no per-sample gradients to clip.
        """
        chosen = auto_settings(stats)
        loss = chosen["loss"] if self.loss == "auto" else self.loss
        grad_clip = self.grad_clip
        if grad_clip == "auto":
            attention = self.uses_history and self.aggregator != "mean"
            grad_clip = SOFTMAX_GRAD_CLIP if loss == "softmax" and not attention else None
        return replace(self, loss=loss, grad_clip=grad_clip)

    @property
    def optimizer_name(self) -> str:
        """The optimiser actually used: ``"auto"`` is Adam for the reference backend and SGD for the fused one."""
        if self.optimizer != "auto":
            return self.optimizer
        return "adam" if self.backend == "reference" else "sgd"

    @property
    def learning_rate(self) -> float:
        """``lr``, or the optimiser's default (Adam 1e-4 as in SimpleX, SGD 0.05, row-wise Adagrad 0.1)."""
        return self.lr if self.lr is not None else _DEFAULT_LR[self.optimizer_name]

    @property
    def initial_std(self) -> float:
        """``init_std``, or 1e-4 for Adam (the SimpleX setting) and 0.1 for the per-sample optimisers."""
        if self.init_std is not None:
            return self.init_std
        return 1e-4 if self.optimizer_name == "adam" else 0.1

    @property
    def uses_history(self) -> bool:
        """Whether the user vector aggregates the history (``g < 1``, SimpleX) or is the user row (MF-CCL)."""
        return self.g < 1.0

    def to_dict(self) -> dict[str, Any]:
        """The arguments as a plain dict (for ``save_hyperparameters`` and logs)."""
        return asdict(self)
