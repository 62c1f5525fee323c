"""Marshalling between a :class:`SimpleXModule` and HEAT's numba kernel (:mod:`lightning_sdp.kernels.cf_numba`).

The kernel takes raw numpy views of the module's tensors (updated in place), the capped histories in CSR form,
the sampler state buffers and scalar settings; this module checks them and builds the call. numba is imported
only when a fused step runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_sdp.models.simplex.module import SimpleXModule

MAX_CHUNKS = 64  # the fused kernel keeps sampler state for at most this many threads

_EMPTY_F32 = np.zeros(0, dtype=np.float32)


def _as_float32_array(t: Tensor | None, placeholder_shape: tuple[int, ...]) -> np.ndarray:
    if t is None:
        return np.zeros(placeholder_shape, dtype=np.float32)
    return t.data.numpy()


def fused_step(
    model: SimpleXModule,
    users: Tensor,
    items: Tensor,
    lr: float,
    negatives: Tensor | None = None,
    num_threads: int | None = None,
    aggregator_lr: float | None = None,
    row_sums: tuple[Tensor, Tensor] | None = None,
    dropout_masks: Tensor | None = None,
) -> Tensor:
    """Run the fused kernel on a batch of positives of ``model`` (see :meth:`SimpleXModule.fused_step`)."""
    from lightning_sdp.kernels import cf_numba  # numba is imported only here

    config = model.config
    user_emb, item_emb = model.tables()
    params = [user_emb.weight, item_emb.weight, model.aggregator]
    params += [p for p in (model.attention_weight, model.attention_bias, model.attention_query) if p is not None]
    if any(p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous() for p in params):
        raise RuntimeError(
            "SimpleXModule(backend='fused') needs contiguous float32 tables on the CPU; train with "
            "Trainer(accelerator='heat' or 'cpu', precision='32-true')."
        )
    history = model.histories()
    model.check_ids(users, items)
    if num_threads is None:
        import numba

        num_threads = numba.get_num_threads()
    chunks = max(1, min(int(num_threads), MAX_CHUNKS, len(users)))
    if negatives is None:
        given = np.zeros((0, 0), dtype=np.int64)
    else:
        if negatives.shape != (len(users), negatives.shape[1]) or negatives.numel() == 0:
            raise ValueError(
                f"SimpleXModule: negatives must be (B, n) with B={len(users)}, got {tuple(negatives.shape)}."
            )
        given = np.ascontiguousarray(negatives.numpy(), dtype=np.int64)
    if dropout_masks is None:
        masks = np.zeros((0, 0), dtype=np.float32)
    else:
        if dropout_masks.shape != (len(users), config.dim):
            raise ValueError(
                f"SimpleXModule: dropout_masks must be (B, dim) = ({len(users)}, {config.dim}), got "
                f"{tuple(dropout_masks.shape)}."
            )
        masks = np.ascontiguousarray(dropout_masks.numpy(), dtype=np.float32)
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
    losses = np.empty(len(users), dtype=np.float32)
    args = (
        user_emb.weight.data.numpy(),
        item_emb.weight.data.numpy(),
        model.aggregator.data.numpy(),
        _as_float32_array(model.attention_weight, (1, 1)),
        _as_float32_array(model.attention_bias, (1,)),
        _as_float32_array(model.attention_query, (0,)),
        cf_numba.AGGREGATORS[config.aggregator],
        np.ascontiguousarray(users.numpy(), dtype=np.int64),
        np.ascontiguousarray(items.numpy(), dtype=np.int64),
        history.indptr,
        history.indices,
        given,
        masks,
        int(config.num_negatives),
        float(config.g),
        float(config.margin),
        float(config.negative_weight),
        float(config.dropout),
        float(lr),
        float(lr * config.aggregator_lr_scale if aggregator_lr is None else aggregator_lr),
        float(config.weight_decay),
        float(config.aggregator_weight_decay),
        user_sums,
        item_sums,
        float(config.adagrad_eps),
        model.sampler_rng.numpy(),
        model.sampler_tiles.numpy(),
        model.sampler_tile_left.numpy(),
        int(config.tile_refresh) if config.sampler == "tile" else 0,
        int(config.v_sync),
        chunks,
        losses,
    )
    if config.loss_name == "ccl" and config.grad_clip_value is None:
        # the loss options are keyword-only and left out for plain CCL: that call keeps the positional form of
        # earlier kernels, which benchmarks load from git and swap in (benchmarks/heat_attention_throughput.py)
        cf_numba.fused_sgd_step(*args)
    else:
        cf_numba.fused_sgd_step(
            *args,
            loss=cf_numba.LOSSES[config.loss_name],
            temperature=float(config.temperature),
            grad_clip=0.0 if config.grad_clip_value is None else float(config.grad_clip_value),
        )
    return torch.from_numpy(losses)


def project_rows(table: Tensor, norm: float) -> None:
    """Rescale every row of ``table`` to L2 norm ``norm`` in place with the kernel's threaded pass."""
    from lightning_sdp.kernels import cf_numba

    cf_numba.project_rows(table.detach().numpy(), float(norm))
