"""Marshalling between a :class:`SimpleXModule` and HEAT's numba kernel (:mod:`lightning_sdp.kernels.cf_numba`).

The kernel takes raw numpy views of the module's tensors (updated in place), the capped histories in CSR form,
the sampler state buffers and the scalar settings; this module checks them, builds the call, and turns a sample that
read a non-finite value into an error that names the row. numba is imported only when a fused step runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

if TYPE_CHECKING:
    from lightning_sdp.kernels.cf_numba import Batch, StepFailure, StepSettings, StepState, Tables
    from lightning_sdp.models.simplex.module import SimpleXModule

MAX_CHUNKS = 64  # the fused kernel keeps sampler state for at most this many threads

_EMPTY_F32 = np.zeros(0, dtype=np.float32)


def _as_float32_array(t: Tensor | None, placeholder_shape: tuple[int, ...]) -> np.ndarray:
    if t is None:
        return np.zeros(placeholder_shape, dtype=np.float32)
    return t.data.numpy()


def model_tables(model: SimpleXModule) -> Tables:
    """The model's parameters as the kernel's :class:`~lightning_sdp.kernels.cf_numba.Tables` (views, not copies)."""
    from lightning_sdp.kernels import cf_numba

    user_emb, item_emb = model.tables()
    params = [user_emb.weight, item_emb.weight, model.aggregator, *model.attention_parameters()]
    if any(p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous() for p in params):
        raise RuntimeError(
            "SimpleXModule(backend='fused') needs contiguous float32 tables on the CPU; train with "
            "Trainer(accelerator='heat' or 'cpu', precision='32-true')."
        )
    return cf_numba.Tables(
        user_emb.weight.data.numpy(),
        item_emb.weight.data.numpy(),
        model.aggregator.data.numpy(),
        _as_float32_array(model.attention_weight, (1, 1)),
        _as_float32_array(model.attention_bias, (1,)),
        _as_float32_array(model.attention_query, (0,)),
    )


def step_settings(model: SimpleXModule, lr: float, aggregator_lr: float | None, chunks: int) -> StepSettings:
    """The kernel's scalar settings for one step of ``model`` at rate ``lr``."""
    from lightning_sdp.kernels import cf_numba

    c = model.config
    return cf_numba.StepSettings(
        aggregator=cf_numba.AGGREGATORS[c.aggregator],
        num_negatives=int(c.num_negatives),
        g=float(c.g),
        margin=float(c.margin),
        negative_weight=float(c.negative_weight),
        dropout=float(c.dropout),
        lr=float(lr),
        v_lr=float(lr * c.aggregator_lr_scale if aggregator_lr is None else aggregator_lr),
        weight_decay=float(c.weight_decay),
        v_weight_decay=float(c.aggregator_weight_decay),
        adagrad_eps=float(c.adagrad_eps),
        tile_refresh=int(c.tile_refresh) if c.sampler == "tile" else 0,
        v_sync=int(c.v_sync),
        num_chunks=chunks,
        exclude_positive=bool(c.negatives_exclude_positive),
        history_grad=bool(c.history_grad),
        loss=cf_numba.LOSSES[c.loss_name],
        temperature=float(c.temperature),
        grad_clip=0.0 if c.grad_clip_value is None else float(c.grad_clip_value),
        clip_mode=cf_numba.CLIP_MODES[c.grad_clip_mode],
    )


def step_state(model: SimpleXModule, losses: np.ndarray, row_sums: tuple[Tensor, Tensor] | None) -> StepState:
    """The model's sampler buffers, optimiser accumulators and clipping buffers as the kernel's state."""
    from lightning_sdp.kernels import cf_numba

    if row_sums is None:
        user_sums = item_sums = _EMPTY_F32
    else:
        user_sums, item_sums = (s.numpy() for s in row_sums)
        shapes_ok = user_sums.shape == (model.num_users,) and item_sums.shape == (model.num_items,)
        if not shapes_ok or user_sums.dtype != np.float32 or item_sums.dtype != np.float32:
            raise ValueError(
                f"SimpleXModule: row_sums must be float32 of shapes ({model.num_users},) and ({model.num_items},), "
                f"got {user_sums.shape} {user_sums.dtype} and {item_sums.shape} {item_sums.dtype}."
            )
    user_buffer, item_buffer = (b.numpy() for b in model.clip_buffers())
    return cf_numba.StepState(
        model.sampler_rng.numpy(),
        model.sampler_tiles.numpy(),
        model.sampler_tile_left.numpy(),
        losses,
        user_sums,
        item_sums,
        user_buffer,
        item_buffer,
    )


def _batch(
    model: SimpleXModule,
    users: Tensor,
    items: Tensor,
    weights: Tensor | None,
    negatives: Tensor | None,
    dropout_masks: Tensor | None,
) -> Batch:
    """The kernel's :class:`~lightning_sdp.kernels.cf_numba.Batch` of checked, contiguous arrays."""
    from lightning_sdp.kernels import cf_numba

    n, d = len(users), model.config.dim
    parts = cf_numba.Batch(np.ascontiguousarray(users.numpy(), np.int64), np.ascontiguousarray(items.numpy(), np.int64))
    if weights is not None:
        if weights.shape != (n,):
            raise ValueError(f"SimpleXModule: weights must be (B,) with B={n}, got {tuple(weights.shape)}.")
        parts = parts._replace(weights=np.ascontiguousarray(weights.numpy(), np.float32))
    if negatives is not None:
        if negatives.ndim != 2 or negatives.shape[0] != n or negatives.numel() == 0:
            raise ValueError(f"SimpleXModule: negatives must be (B, n) with B={n}, got {tuple(negatives.shape)}.")
        parts = parts._replace(negatives=np.ascontiguousarray(negatives.numpy(), np.int64))
    if dropout_masks is not None:
        if dropout_masks.shape != (n, d):
            raise ValueError(
                f"SimpleXModule: dropout_masks must be (B, dim) = ({n}, {d}), got {tuple(dropout_masks.shape)}."
            )
        parts = parts._replace(masks=np.ascontiguousarray(dropout_masks.numpy(), np.float32))
    return parts


def fused_step(
    model: SimpleXModule,
    users: Tensor,
    items: Tensor,
    lr: float,
    *,
    weights: Tensor | None = None,
    negatives: Tensor | None = None,
    dropout_masks: Tensor | None = None,
    num_threads: int | None = None,
    aggregator_lr: float | None = None,
    row_sums: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Run the fused kernel on a batch of positives of ``model`` (see :meth:`SimpleXModule.fused_step`)."""
    from lightning_sdp.kernels import cf_numba  # numba is imported only here

    tables = model_tables(model)
    history = model.histories()
    model.check_ids(users, items)
    if num_threads is None:
        import numba

        num_threads = numba.get_num_threads()
    chunks = max(1, min(int(num_threads), MAX_CHUNKS, len(users)))
    batch = _batch(model, users, items, weights, negatives, dropout_masks)
    losses = np.empty(len(users), dtype=np.float32)
    failure = cf_numba.fused_sgd_step(
        tables,
        batch,
        cf_numba.History(history.indptr, history.indices),
        step_state(model, losses, row_sums),
        step_settings(model, lr, aggregator_lr, chunks),
    )
    if failure is not None:
        raise FloatingPointError(describe_failure(model, failure, batch))
    return torch.from_numpy(losses)


def describe_failure(model: SimpleXModule, failure: StepFailure, batch: Batch) -> str:
    """What went wrong in a step that stopped at a non-finite value, naming the row it read."""
    from lightning_sdp.kernels import cf_numba

    user, item = int(batch.users[failure.sample]), int(batch.items[failure.sample])
    sample = f"the positive (user {user}, item {item}) at position {failure.sample} of the batch"
    if failure.what == cf_numba.FAILED_POSITIVE:
        culprit = f"item row {failure.row} (its positive)"
    elif failure.what == cf_numba.FAILED_NEGATIVE:
        culprit = f"item row {failure.row} (one of its negatives)"
    else:
        culprit = model.describe_bad_user_vector(user)
    return (
        f"SimpleXModule: {sample} read a NaN or infinite value from {culprit} at step {model.global_step}; the "
        "step stopped before that sample changed anything (earlier samples of the batch were applied). A row goes "
        "bad when it is set so or when the updates diverge: lower lr, or check the values you loaded."
    )


@dataclass(frozen=True)
class Preparation:
    """What :func:`prepare_kernels` did: the seconds it took and whether it compiled or loaded the kernel.

    Attributes:
        seconds: wall time of the preparation.
        compiled: specialisations compiled (a first run on this machine, or after the kernel's code changed).
        loaded: specialisations loaded from the disk cache.
        cache_dir: where numba keeps them.
        finished_at: ``time.monotonic()`` when it ended (the clock of Lightning's ``Timer``).
    """

    seconds: float
    compiled: int
    loaded: int
    cache_dir: str
    finished_at: float


_PREPARED: set[tuple[bool, bool]] = set()  # the specialisations already made ready in this process


def _specialisation(model: SimpleXModule) -> tuple[bool, bool]:
    """What selects a specialisation of the kernel: the plain-CCL form or not, and the row projection."""
    c = model.config
    plain = c.loss_name == "ccl" and c.grad_clip_value is None
    return plain, c.row_norm is not None


def prepare_kernels(model: SimpleXModule) -> Preparation | None:
    """Compile (or load from the disk cache) the kernels ``model``'s training will call, before training starts.

    numba compiles a kernel on its first call, tens of seconds for the fused step; called from the fused backend's
    ``setup``, this happens before Lightning's ``Trainer`` starts the clock that ``max_time`` counts (its ``Timer``
    starts at ``on_train_start``), so a time budget buys training, not compilation. It runs one step on a tiny copy of
    the model's settings (the same argument types, so the same specialisation) and says, once per process, what it
    did and how long it took. Returns ``None`` when this process already prepared the same specialisation.
    """
    key = _specialisation(model)
    if key in _PREPARED:
        return None
    from lightning_sdp.kernels import cf_numba

    rank_zero_info(
        "SimpleXModule: preparing HEAT's fused kernel before training starts: numba compiles it once per "
        f"configuration (tens of seconds) and caches it in {cf_numba.cache_dir()}."
    )
    before = cf_numba.compile_counts()
    start = time.perf_counter()
    _tiny_step(model)
    if model.config.row_norm is not None:
        cf_numba.project_rows(np.ones((2, model.config.dim), np.float32), 1.0)
    seconds = time.perf_counter() - start
    after = cf_numba.compile_counts()
    done = Preparation(seconds, after[0] - before[0], after[1] - before[1], cf_numba.cache_dir(), time.monotonic())
    _PREPARED.add(key)
    if done.compiled:
        how = "compiled (once: later runs load it from the cache)"
    elif done.loaded:
        how = "loaded from the cache"
    else:
        how = "already in memory"
    rank_zero_info(f"SimpleXModule: the fused kernel was {how} in {done.seconds:.1f} s.")
    return done


def _tiny_step(model: SimpleXModule) -> None:
    """One fused step on a 2-user, 3-item copy of ``model``'s settings: the argument types of a real step."""
    from lightning_sdp.kernels import cf_numba

    c, d = model.config, model.config.dim
    rng = np.random.default_rng(0)
    tables = cf_numba.Tables(
        rng.normal(size=(2, d)).astype(np.float32),
        rng.normal(size=(3, d)).astype(np.float32),
        np.eye(d, dtype=np.float32),
        *(np.ascontiguousarray(a.copy()) for a in model_tables(model)[3:]),
    )
    batch = cf_numba.Batch(np.array([0], np.int64), np.array([0], np.int64))
    history = cf_numba.History(np.array([0, 1, 1], np.int64), np.array([1], np.int64))
    width = model.sampler_tiles.shape[1]
    adagrad = c.optimizer_name == "rowwise_adagrad"
    buffered = c.grad_clip_mode == "row_buffer"
    state = cf_numba.StepState(
        np.arange(1, 2, dtype=np.int64),
        np.zeros((1, width), np.int64),
        np.zeros(1, np.int64),
        np.zeros(1, np.float32),
        np.zeros(2 if adagrad else 0, np.float32),
        np.zeros(3 if adagrad else 0, np.float32),
        np.zeros((2, d) if buffered else (0, 0), np.float32),
        np.zeros((3, d) if buffered else (0, 0), np.float32),
    )
    settings = step_settings(model, 0.0, 0.0, 1)
    cf_numba.fused_sgd_step(tables, batch, history, state, settings)


def project_rows(table: Tensor, norm: float) -> None:
    """Rescale every row of ``table`` to L2 norm ``norm`` in place with the kernel's threaded pass."""
    from lightning_sdp.kernels import cf_numba

    cf_numba.project_rows(table.detach().numpy(), float(norm))
