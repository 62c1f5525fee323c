"""The two ways a :class:`SimpleXModule` trains: plain PyTorch (the reference) and HEAT's fused kernel.

Each backend is one object that owns what differs between them: whether Lightning optimises automatically, what a
training step does, how rows are projected and what the set-up must check. The module holds one and never
switches on the backend's name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, cast

import numpy as np
import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT
from typing_extensions import override

from lightning_sdp.kernels import cf_reference as ref
from lightning_sdp.models.simplex import kernel

if TYPE_CHECKING:
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from torch.optim.lr_scheduler import LambdaLR

    from lightning_sdp.models.simplex.module import SimpleXModule


class SimpleXBackend(ABC):
    """What differs between the training paths of :class:`SimpleXModule`."""

    name: ClassVar[str]
    automatic_optimization: ClassVar[bool]

    def setup(self, model: SimpleXModule, world_size: int) -> None:  # noqa: B027 (optional hook)
        """Check that this backend can run in this set-up (called from the module's ``setup``)."""

    @abstractmethod
    def training_step(
        self, model: SimpleXModule, users: Tensor, items: Tensor, weights: Tensor | None = None
    ) -> Tensor | None:
        """Train on a batch of positives (each positive's loss times its weight, if given); return the loss for
        Lightning's optimiser or ``None`` if already applied."""

    @abstractmethod
    def project_rows(self, table: Tensor, norm: float) -> None:
        """Rescale every row of ``table`` to L2 norm ``norm`` in place."""


class ReferenceBackend(SimpleXBackend):
    """Plain PyTorch: gather, aggregate, normalise, ``bmm``, autograd; Lightning's optimiser applies the update."""

    name = "reference"
    automatic_optimization = True

    @override
    def training_step(
        self, model: SimpleXModule, users: Tensor, items: Tensor, weights: Tensor | None = None
    ) -> Tensor:
        config = model.config
        model.check_ids(users, items)
        negatives = ref.sample_negatives(
            items, config.num_negatives, model.num_items, model.generator, config.negatives_exclude_positive
        )
        masks = None
        if config.dropout > 0:  # drawn after the negatives, so runs without dropout keep their random stream
            keep = torch.rand(len(users), config.dim, generator=model.generator) >= config.dropout
            masks = keep.to(torch.float32) / (1.0 - config.dropout)
        objective, per_sample = model.reference_loss(users, items, negatives, dropout_mask=masks, weights=weights)
        if not bool(torch.isfinite(per_sample).all()):  # before backward: no update spreads the bad value
            raise FloatingPointError(_describe_bad_sample(model, users, items, negatives, per_sample))
        if config.grad_clip_mode == "row_buffer":  # every row the batch touches steps through its buffer
            self._touch(model, users, items, negatives)
        model.log("train/loss", per_sample.mean().detach(), prog_bar=True)
        return objective

    @staticmethod
    def _touch(model: SimpleXModule, users: Tensor, items: Tensor, negatives: Tensor) -> None:
        """Tell the row-buffer optimiser which user and item rows this batch touches."""
        opt = cast("LightningOptimizer", model.optimizers()).optimizer
        assert isinstance(opt, ref.RowBufferSGD)  # SimpleXConfig allows row buffers with SGD only
        user_emb, item_emb = model.tables()
        touched = [items, negatives.reshape(-1)]
        if model.config.uses_history and model.config.history_grad:  # else the history rows are only read
            history = model.histories()
            rows = [history.indices[history.indptr[u] : history.indptr[u + 1]] for u in users.tolist()]
            touched.append(torch.from_numpy(np.concatenate(rows)))
        opt.touch(user_emb.weight, users.unique())
        opt.touch(item_emb.weight, torch.cat(touched).unique())

    @override
    def project_rows(self, table: Tensor, norm: float) -> None:
        ref.project_rows(table, norm)


def _describe_bad_sample(
    model: SimpleXModule, users: Tensor, items: Tensor, negatives: Tensor, per_sample: Tensor
) -> str:
    """Which row the first sample with a non-finite loss read a NaN or infinity from (the reference's check)."""
    at = int(torch.nonzero(~torch.isfinite(per_sample))[0])
    user, item = int(users[at]), int(items[at])
    table = model.tables()[1].weight.detach()
    if not bool(torch.isfinite(table[item]).all()):
        culprit = f"item row {item} (its positive)"
    else:
        bad = [int(j) for j in negatives[at] if not bool(torch.isfinite(table[j]).all())]
        culprit = f"item row {bad[0]} (one of its negatives)" if bad else model.describe_bad_user_vector(user)
    return (
        f"SimpleXModule: the positive (user {user}, item {item}) at position {at} of the batch has a NaN or infinite "
        f"loss at step {model.global_step}, read from {culprit}; the step was not applied. A row goes bad when it "
        "is set so or when the updates diverge: lower lr, or check the values you loaded."
    )


class LearningRates(torch.optim.Optimizer):
    """The fused backend's optimiser: it carries the learning rates (so Lightning's schedulers and checkpoints work)
    and its ``step`` does nothing, since the kernel already updated the rows; calling it only advances Lightning's
    step counter. (An SGD step over parameters without gradients cost a share of a short fused step.)"""

    def __init__(self, params: ParamsT, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        return None if closure is None else closure()


class FusedBackend(SimpleXBackend):
    """HEAT's numba kernel: per-sample forward and backward, in-place lock-free updates (manual optimisation)."""

    name = "fused"
    automatic_optimization = False

    @override
    def setup(self, model: SimpleXModule, world_size: int) -> None:
        if world_size > 1:
            # the fused kernel updates rows in place, outside autograd, so no DDP hook would ever sync them
            raise ValueError(
                f"SimpleXModule(backend='fused') does not synchronise its tables across processes, but this run "
                f"has {world_size} of them: use devices=1 (HEAT's threads already use every core of a node) or "
                "backend='reference' for DDP."
            )
        from lightning_sdp._imports import require

        require("numba", feature="SimpleXModule(backend='fused')")
        # compiled here, before the Trainer's Timer starts at on_train_start: max_time buys training, not compilation
        model.kernel_preparation = kernel.prepare_kernels(model) or model.kernel_preparation

    @override
    def training_step(self, model: SimpleXModule, users: Tensor, items: Tensor, weights: Tensor | None = None) -> None:
        # configure_optimizers returns one optimizer, so Lightning hands back one (not a list)
        opt = cast("LightningOptimizer", model.optimizers())
        lr = opt.param_groups[0]["lr"]
        row_sums = None
        if model.config.optimizer_name == "rowwise_adagrad":
            inner = cast(ref.RowWiseAdagrad, opt.optimizer)
            user_emb, item_emb = model.tables()
            row_sums = (inner.row_sums(user_emb.weight), inner.row_sums(item_emb.weight))
        losses = model.fused_step(
            users, items, lr, weights=weights, aggregator_lr=opt.param_groups[1]["lr"], row_sums=row_sums
        )
        loss = float(losses.mean())
        if not np.isfinite(loss):
            raise FloatingPointError(
                f"SimpleXModule: the fused kernel produced a non-finite loss at step {model.global_step}; "
                f"lower lr (now {lr}) or raise init_std."
            )
        opt.step()  # no gradients: only advances Lightning's step counter (the kernel already updated the rows)
        # manual optimisation: Lightning leaves stepping step-wise schedulers to the module; configure_optimizers
        # only builds LambdaLR (never ReduceLROnPlateau, whose step needs a metric)
        schedules = cast("LambdaLR | list[LambdaLR] | None", model.lr_schedulers()) or []
        for schedule in schedules if isinstance(schedules, list) else [schedules]:
            schedule.step()
        # logged by the module on Lightning's logging steps (model.on_train_batch_end): self.log per step would cost
        # about a quarter of the fused path's throughput
        model.log_window.add_loss(loss, len(users), lr)
        return None

    @override
    def project_rows(self, table: Tensor, norm: float) -> None:
        kernel.project_rows(table, norm)  # one threaded pass per table instead of torch's two passes per batch


BACKENDS: dict[str, type[SimpleXBackend]] = {"reference": ReferenceBackend, "fused": FusedBackend}


def make_backend(name: str) -> SimpleXBackend:
    """The backend object called ``name`` (``"reference"`` or ``"fused"``)."""
    if name not in BACKENDS:
        raise ValueError(f"SimpleXModule: backend must be 'fused' or 'reference', got {name!r}.")
    return BACKENDS[name]()
