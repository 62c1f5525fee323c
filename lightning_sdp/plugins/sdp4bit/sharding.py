"""Flat, padded parameter buckets and in-place sharding of a user optimizer (distributed-optimizer style).

Each optimizer param group becomes one :class:`FlatBucket`: its parameters laid end to end in a flat buffer of
``world_size * S`` values (zero padding at the end), where ``S`` is a whole number of quantisation groups and
Hadamard blocks. The rank that owns shard ``k`` (local-major, :func:`~lightning_sdp.plugins.sdp4bit.topology.
shard_index`) keeps the fp32 master copy of ``[k * S, (k + 1) * S)`` and the optimizer sees only
that shard: ``param_group["params"] = [master_shard]``, so AdamW, SGD, ... and any LR scheduler run unchanged on
``1 / world_size`` of the state. Optimizer state is consolidated to the unsharded layout for checkpoints and cut
again for the world size that loads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_sdp.plugins.sdp4bit.collectives import all_gather_rows
from lightning_sdp.plugins.sdp4bit.exchange import padded_shard_size
from lightning_sdp.plugins.sdp4bit.topology import in_shard_order, shard_index

# Optimizers whose update is element-wise, so that stepping a shard equals stepping the whole tensor. Subclasses of
# these (``class MyAdamW(AdamW)``) are accepted too: they inherit the element-wise update.
SUPPORTED_OPTIMIZERS = tuple("SGD Adam AdamW Adamax NAdam RAdam RMSprop Adagrad Adadelta ASGD Rprop".split())

# Optimizers that can never run on a flat shard, and why.
UNSHARDABLE_OPTIMIZERS = {
    "LBFGS": "it re-evaluates the closure several times per step and runs a line search on whole tensors",
    "SparseAdam": "it needs sparse gradients, and a shard gradient is a dense flat buffer",
    "Adafactor": "it factors the second moment over the rows and columns of each weight matrix, which a flat "
    "shard does not have",
}


def _torch_class(name: str) -> type | None:
    cls = getattr(torch.optim, name, None)
    return cls if isinstance(cls, type) else None


def check_trainable(module: Module, optimizers: list[Optimizer]) -> None:
    """Refuse a ``fit`` that SDP4Bit cannot run: no optimizer (Lightning's stand-in), or nothing to train."""
    from lightning.pytorch.core.optimizer import _MockOptimizer

    if not optimizers or any(isinstance(opt, _MockOptimizer) for opt in optimizers):
        raise ValueError(
            "SDP4BitStrategy needs an optimizer: `configure_optimizers` returned None, so Lightning would train "
            "without one, and SDP4Bit exchanges the gradients and updates the weights inside the optimizer step. "
            "Return an optimizer from `configure_optimizers` (e.g. `torch.optim.AdamW(self.parameters())`), also "
            "with manual optimization, or run a model without one with `trainer.validate`/`test`/`predict`."
        )
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            "SDP4BitStrategy has nothing to train: no parameter of the LightningModule requires a gradient. "
            "Unfreeze at least one parameter before `fit` (or use `trainer.validate`/`test`/`predict` to run a "
            "frozen model)."
        )


def check_optimizer(optimizer: Optimizer, allow_any: bool = False) -> None:
    """Raise a clear error for optimizers that cannot run on a flat shard.

    Args:
        optimizer: the user's optimizer (unwrapped).
        allow_any: accept optimizers that are not (subclasses of) the element-wise ``torch.optim`` ones; the user
            asserts that their update is element-wise. Optimizers in :data:`UNSHARDABLE_OPTIMIZERS` stay refused.
    """
    cls = type(optimizer)
    for name, why in UNSHARDABLE_OPTIMIZERS.items():
        base = _torch_class(name)
        if base is not None and isinstance(optimizer, base):
            raise ValueError(
                f"SDP4BitStrategy cannot shard the optimizer {cls.__module__}.{cls.__qualname__}: {why}. Sharded "
                "data parallelism steps a flat 1-D slice of the parameters, which is only equivalent for element-wise "
                f"optimizers (torch.optim.{', torch.optim.'.join(SUPPORTED_OPTIMIZERS)} and their subclasses). Use "
                "one of those or the 'ddp' strategy."
            )
    for name in SUPPORTED_OPTIMIZERS:
        base = _torch_class(name)
        if base is not None and isinstance(optimizer, base):
            return
    if allow_any:
        return
    raise ValueError(
        f"SDP4BitStrategy cannot shard the optimizer {cls.__module__}.{cls.__qualname__}: sharded data parallelism "
        "steps a flat 1-D slice of the parameters, which is only equivalent for element-wise optimizers "
        f"(torch.optim.{', torch.optim.'.join(SUPPORTED_OPTIMIZERS)} and their subclasses). Optimizers that look at "
        "whole tensors, re-evaluate the closure or use sparse gradients (LBFGS, Adafactor, SparseAdam, Shampoo, "
        "Muon, ...) are not supported; use one of the above or the 'ddp' strategy. If this optimizer's update is "
        "element-wise (e.g. Lion), pass `SDP4BitStrategy(allow_any_optimizer=True)`."
    )


@dataclass(frozen=True)
class ShardLayout:
    """How every param group of a ``fit`` is cut into flat buckets and which shard of each this rank owns.

    Attributes:
        world_size: data-parallel world size.
        rank: this rank.
        alignment: every shard is a multiple of this many values (lcm of the group sizes and the Hadamard size).
        param_alignment: every parameter starts at a multiple of this in the flat buffer (the Hadamard block size
            when gradients are Hadamard-transformed, so that no block mixes two parameters; 1 otherwise).
        intra_size: processes per node, which decides the shard this rank owns (``None``: shard ``rank``).
        bucket_numel: values per bucket (see :func:`split_params`); ``None``: one bucket per param group.
    """

    world_size: int
    rank: int
    alignment: int
    param_alignment: int = 1
    intra_size: int | None = None
    bucket_numel: int | None = None

    @property
    def shard(self) -> int:
        """The index of the shard this rank owns (local-major, see :func:`shard_index`)."""
        return shard_index(self.rank, self.world_size, self.intra_size)


class FlatBucket:
    """One param group flattened: full model copy (every rank), fp32 master shard (this rank), grad buffer.

    The master is this rank's shard ``[lo, lo + shard_size)`` of the flat buffer, or, while :attr:`replicated`
    (``"auto"`` chose DDP's exchange, see :mod:`~lightning_sdp.plugins.sdp4bit.replication`), the whole buffer on
    every rank. Either way each rank accounts for its own shard in sums over ranks (norms, clipping): :meth:`own`.

    Args:
        params: the group's parameters (one dtype and device).
        names: a name per parameter (for error messages).
        layout: world size, rank, alignments and shard ownership.
        group_index: index of the optimizer param group this bucket belongs to (a group may own several buckets).
    """

    def __init__(self, params: list[Tensor], names: list[str], layout: ShardLayout, group_index: int = 0) -> None:
        if not params:
            raise ValueError("An optimizer param group has no parameters.")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                f"SDP4BitStrategy needs every parameter of a param group on one dtype and device; got dtypes "
                f"{sorted(map(str, dtypes))} and devices {sorted(map(str, devices))}."
            )
        self.params = params
        self.names = names
        self.group_index = group_index
        self.numels = [p.numel() for p in params]
        # offsets[i] is where parameter i starts; offsets[-1] is the end of the last one
        self.offsets = []
        end = 0
        align = layout.param_alignment
        for n in self.numels:
            start = -(-end // align) * align
            self.offsets.append(start)
            end = start + n
        self.offsets.append(end)
        self.numel = end
        self.layout = layout
        self.world_size = layout.world_size
        self.rank = layout.rank
        self.shard_size = padded_shard_size(self.numel, layout.world_size, layout.alignment)
        self.padded = layout.world_size * self.shard_size
        self.intra_size = layout.intra_size
        self.lo = layout.shard * self.shard_size
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.model_flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self.grad_flat = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        # every step copies through these two buffers' views: made once
        self._cached_views = {id(flat): self._make_views(flat) for flat in (self.model_flat, self.grad_flat)}
        self.load_from_params()
        self.master = self.model_flat[self.lo : self.lo + self.shard_size].float().clone()
        self.replicated = False
        # the parameters become views of the flat model buffer, so the weight all-gather writes them in place (no
        # copy per step); should something give a parameter other storage, store_to_params copies instead
        for p, view in zip(params, self._cached_views[id(self.model_flat)], strict=True):
            p.data = view

    def views(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views of a flat buffer with this bucket's layout."""
        cached = self._cached_views.get(id(flat))
        return cached if cached is not None and cached[0]._base is flat else self._make_views(flat)

    def _make_views(self, flat: Tensor) -> list[Tensor]:
        return [flat[a : a + n].view_as(p) for a, n, p in zip(self.offsets[:-1], self.numels, self.params, strict=True)]

    def _detached_copies(self) -> tuple[list[Tensor], list[Tensor]]:
        """(parameters, their views of the model buffer) for the parameters that do not alias their view."""
        views = self.views(self.model_flat)
        pairs = [(p.detach(), v) for p, v in zip(self.params, views, strict=True) if p.data_ptr() != v.data_ptr()]
        return [p for p, _ in pairs], [v for _, v in pairs]

    @torch.no_grad()
    def load_from_params(self) -> None:
        """Copy the parameters into the flat model buffer (the padding stays zero)."""
        params, views = self._detached_copies()
        if params:
            torch._foreach_copy_(views, params)

    @torch.no_grad()
    def store_to_params(self) -> None:
        """Copy the flat model buffer into the parameters that do not already live in it."""
        params, views = self._detached_copies()
        if params:
            torch._foreach_copy_(params, views)

    @torch.no_grad()
    def gather_grads(self, divisor: int = 1) -> Tensor:
        """Flat fp32 copy of the parameters' gradients divided by ``divisor`` (missing gradients count as zero).

        One pass per parameter (copy and divide together); the gaps between parameters and the padding are zero
        from construction and nothing writes them.
        """
        for view, p in zip(self.views(self.grad_flat), self.params, strict=True):
            if p.grad is None:
                view.zero_()
            elif divisor == 1:
                view.copy_(p.grad)
            elif p.grad.dtype == torch.float32:
                torch.div(p.grad, divisor, out=view)
            else:
                view.copy_(p.grad).div_(divisor)
        return self.grad_flat

    def has_grad_flags(self) -> Tensor:
        """One value per parameter: 1.0 where this rank holds a gradient, 0.0 where it is ``None``."""
        return torch.tensor([float(p.grad is not None) for p in self.params], dtype=torch.float32)

    @property
    def master_lo(self) -> int:
        """Where the master starts in the flat buffer (its shard's start; 0 while replicated)."""
        return 0 if self.replicated else self.lo

    def own(self, tensor: Tensor) -> Tensor:
        """This rank's shard of a master-shaped tensor (``tensor`` itself unless replicated): what it adds to sums
        over ranks, so that every value is counted once."""
        return tensor[self.lo : self.lo + self.shard_size] if self.replicated else tensor

    def shard_ranges(self, indices: list[int]) -> list[tuple[int, int]]:
        """Where parameters ``indices`` lie in this rank's shard, as ``[a, b)`` ranges of shard positions."""
        return self._ranges(indices, self.lo, self.shard_size)

    def master_ranges(self, indices: list[int]) -> list[tuple[int, int]]:
        """Where parameters ``indices`` lie in the master (the shard, or the whole buffer while replicated)."""
        return self._ranges(indices, self.master_lo, self.master.numel())

    def _ranges(self, indices: list[int], lo: int, size: int) -> list[tuple[int, int]]:
        out = []
        for i in indices:
            a = max(self.offsets[i], lo)
            b = min(self.offsets[i] + self.numels[i], lo + size)
            if a < b:
                out.append((a - lo, b - lo))
        return out

    def names_in(self, start: int, stop: int) -> list[str]:
        """Names of the parameters that overlap ``[start, stop)`` of the flat buffer."""
        return [
            name
            for name, a, n in zip(self.names, self.offsets[:-1], self.numels, strict=True)
            if a < stop and a + n > start
        ]

    def non_finite_names(self) -> list[str]:
        """Names of the parameters whose gradient holds NaN or Inf."""
        return [
            name
            for name, p in zip(self.names, self.params, strict=True)
            if p.grad is not None and not bool(torch.isfinite(p.grad).all())
        ]

    def zero_model_grads(self) -> None:
        """Drop the parameters' gradients (they live in the master shard from now on)."""
        for p in self.params:
            p.grad = None

    def full_master(self) -> Tensor:
        """All-gather the fp32 master shards into the full flat buffer (a collective)."""
        return self.gather_full(self.master)

    def gather_full(self, shard: Tensor) -> Tensor:
        """All-gather a master-shaped tensor (e.g. ``exp_avg``) into the full flat buffer (a collective, unless
        replicated: then it is the full buffer already and is copied)."""
        if self.world_size == 1 or self.replicated:
            return shard.detach().clone()
        by_rank = torch.empty(self.padded, dtype=shard.dtype, device=shard.device)
        all_gather_rows(by_rank, shard.detach().contiguous(), None)
        if self.intra_size in (None, 1, self.world_size):
            return by_rank  # every rank owns the shard of its own index
        return in_shard_order(by_rank, self.world_size, self.intra_size).reshape(-1)

    def shard_of(self, per_param: list[Tensor]) -> Tensor:
        """The master-shaped slice of the flat concatenation of ``per_param`` (zero padding), as fp32."""
        full = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        for view, t in zip(self.views(full), per_param, strict=True):
            view.copy_(t.reshape(view.shape))
        return full if self.replicated else full[self.lo : self.lo + self.shard_size].clone()


def padding_warning(buckets: list[FlatBucket], world_size: int, alignment: int) -> str | None:
    """What to tell the user when padding dominates what the buckets communicate, or ``None``."""
    numel = sum(sum(b.numels) for b in buckets)
    padded = sum(b.padded for b in buckets)
    if padded - numel <= max(numel, 2**20):
        return None
    return (
        f"SDP4BitStrategy pads {numel:,} parameter values to {padded:,} ({len(buckets)} buckets, {world_size} "
        f"ranks, shards a multiple of {alignment}): most of what is communicated is padding. Lower "
        "`weight_group_size`/`gradient_group_size`, merge small param groups or use larger buckets."
    )


def split_params(params: list[Tensor], bucket_numel: int | None) -> list[list[Tensor]]:
    """Cut a param group into consecutive runs of parameters of at most ``bucket_numel`` values each.

    The cut starts from the end of the group, so that the last parameters (whose gradients backward produces first)
    fill whole buckets; a parameter larger than ``bucket_numel`` gets a bucket of its own. ``None``: one bucket.

    Args:
        params: the group's parameters in order.
        bucket_numel: values per bucket, or ``None`` for one bucket per group.
    """
    if bucket_numel is None:
        return [list(params)]
    runs: list[list[Tensor]] = []
    current: list[Tensor] = []
    size = 0
    for p in reversed(params):
        if current and size + p.numel() > bucket_numel:
            runs.append(current[::-1])
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        runs.append(current[::-1])
    return runs[::-1]


def shard_group(
    group: dict[str, Any], names: dict[int, str], layout: ShardLayout, group_index: int = 0
) -> list[FlatBucket]:
    """Build the :class:`FlatBucket` s of one param group (its ``"params"`` are left as they are).

    Args:
        group: an optimizer param group holding model parameters.
        names: ``id(param) -> name`` for error messages.
        layout: how the buckets are cut and which shard this rank owns.
        group_index: index of the group in the optimizer.
    """
    params = list(group["params"])
    if not params:
        raise ValueError("An optimizer param group has no parameters.")
    buckets = []
    for run in split_params(params, layout.bucket_numel):
        bucket = FlatBucket(run, [names.get(id(p), f"<unnamed {tuple(p.shape)}>") for p in run], layout, group_index)
        bucket.master.requires_grad_(True)
        buckets.append(bucket)
    return buckets


def group_buckets(buckets: list[FlatBucket], group_index: int) -> list[FlatBucket]:
    """The buckets of param group ``group_index``, in parameter order."""
    return [b for b in buckets if b.group_index == group_index]


def group_params(buckets: list[FlatBucket], group_index: int) -> list[Tensor]:
    """The model parameters of param group ``group_index`` (the concatenation of its buckets' parameters)."""
    return [p for b in group_buckets(buckets, group_index) for p in b.params]


def shard_optimizer(
    optimizer: Optimizer, names: dict[int, str], layout: ShardLayout, allow_any: bool = False
) -> list[FlatBucket]:
    """Build the flat buckets of every param group of an optimizer that holds no state yet. Returns the buckets.

    The param groups keep the model parameters; :func:`use_shards` swaps the fp32 master shards in while the
    optimizer steps (or its state is read or written).

    Args:
        optimizer: the user's optimizer, still holding the model parameters and no state.
        names: ``id(param) -> name`` for error messages.
        layout: how the buckets are cut and which shard this rank owns.
        allow_any: see :func:`check_optimizer`.
    """
    check_optimizer(optimizer, allow_any)
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError(
            "SDP4BitStrategy must shard the optimizer before its first step, but it already holds state. Create "
            "the optimizer in `configure_optimizers` and load optimizer state through `ckpt_path=`."
        )
    buckets = [
        bucket for i, group in enumerate(optimizer.param_groups) for bucket in shard_group(group, names, layout, i)
    ]
    optimizer.state.clear()
    return buckets


def shard_new_groups(
    optimizer: Optimizer, buckets: list[FlatBucket], names: dict[int, str], layout: ShardLayout
) -> bool:
    """Shard the param groups added since :func:`shard_optimizer` (``add_param_group``, e.g. by
    ``BackboneFinetuning``), appending their buckets to ``buckets``. Returns whether there were any.

    Removing param groups or editing a group's ``"params"`` after sharding is refused with a ``ValueError``. The
    other arguments are those of :func:`shard_optimizer`.
    """
    groups = optimizer.param_groups
    n_known = len({b.group_index for b in buckets})
    if len(groups) < n_known:
        raise ValueError(
            f"The optimizer had {n_known} param groups when SDP4BitStrategy sharded it and now has "
            f"{len(groups)}: removing param groups during training is not supported (adding them is)."
        )
    for i, group in enumerate(groups[:n_known]):
        params, known = group["params"], group_params(buckets, i)
        if len(params) != len(known) or any(p is not q for p, q in zip(params, known, strict=True)):
            raise ValueError(
                f"The parameters of optimizer param group {i} changed after SDP4BitStrategy sharded it: editing "
                "a group's 'params' during training is not supported. Add new parameters with "
                "`optimizer.add_param_group(...)` instead."
            )
    for i in range(n_known, len(groups)):
        buckets.extend(shard_group(groups[i], names, layout, i))
    return len(groups) > n_known


class use_shards:  # lower case: used like a function: ``with use_shards(optimizer, buckets): ...``
    """Context manager: the optimizer's param groups hold the fp32 master shards inside, the model parameters outside.

    Outside, ``optimizer.param_groups`` looks as in plain Lightning (callbacks such as ``BackboneFinetuning`` and
    ``toggle_optimizer`` see the model parameters); inside, the user's optimizer steps the shards.

    Args:
        optimizer: the sharded optimizer.
        buckets: its buckets (one or more per param group).
    """

    def __init__(self, optimizer: Optimizer, buckets: list[FlatBucket]) -> None:
        self.optimizer = optimizer
        self.buckets = buckets

    def __enter__(self) -> Optimizer:
        for i, group in enumerate(self.optimizer.param_groups):
            group["params"] = [b.master for b in group_buckets(self.buckets, i)]
        return self.optimizer

    def __exit__(self, *exc: Any) -> None:
        for i, group in enumerate(self.optimizer.param_groups):
            group["params"] = group_params(self.buckets, i)


def consolidate_state(optimizer: Optimizer, buckets: list[FlatBucket], extra: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state as the unsharded optimizer would save it (a collective; every rank must call it).

    Shard-shaped state tensors are all-gathered, cut per parameter and reshaped; scalar state (``step``) is copied.
    The fp32 master weights are added under ``"sdp4bit"`` together with ``extra``.

    Args:
        optimizer: the sharded optimizer.
        buckets: its buckets (one or more per param group).
        extra: more entries for the ``"sdp4bit"`` section.
    """
    state: dict[int, dict[str, Any]] = {}
    groups = []
    masters: dict[int, Tensor] = {}
    index = 0
    for group_index, group in enumerate(optimizer.param_groups):
        ids: list[int] = []
        for bucket in group_buckets(buckets, group_index):
            index = _consolidate_bucket(optimizer, bucket, state, masters, ids, index)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups, "sdp4bit": {"master": masters, **extra}}


def _consolidate_bucket(
    optimizer: Optimizer,
    bucket: FlatBucket,
    state: dict[int, dict[str, Any]],
    masters: dict[int, Tensor],
    ids: list[int],
    index: int,
) -> int:
    """Add one bucket's parameters to a consolidated state from ``index`` on; returns the next free index."""
    shard_state = optimizer.state.get(bucket.master, {})
    full = {k: bucket.gather_full(v) if _is_shard_state(v, bucket) else v for k, v in sorted(shard_state.items())}
    master_full = bucket.full_master()
    for i, p in enumerate(bucket.params):
        a, n = bucket.offsets[i], bucket.numels[i]
        entry = {}
        for k, v in full.items():
            is_flat = isinstance(v, Tensor) and v.dim() == 1 and v.numel() == bucket.padded
            entry[k] = v[a : a + n].view_as(p).clone() if is_flat else (v.clone() if isinstance(v, Tensor) else v)
        if entry:
            state[index] = entry
        masters[index] = master_full[a : a + n].view(p.shape).clone()
        ids.append(index)
        index += 1
    return index


def single_process_state(optimizer: Optimizer, state: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """:func:`consolidate_state`'s layout for one process: the optimizer's own ``state_dict()`` plus the ``"sdp4bit"``
    section.

    With one process the optimizer is the user's own, so its state dict already has the consolidated layout
    (per-parameter state, parameters numbered in param-group order); the section adds the fp32 weights as the
    "master" weights and ``extra`` (the step counters), so the checkpoint equals what several processes save.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    masters = {i: p.detach().float().clone() for i, p in enumerate(params)}
    return {**state, "sdp4bit": {"master": masters, **extra}}


def load_consolidated_state(optimizer: Optimizer, buckets: list[FlatBucket], saved: dict[str, Any]) -> None:
    """Cut a consolidated (unsharded) optimizer state for this rank and load it into the sharded optimizer.

    Works for any world size; also restores the fp32 master shard when the checkpoint carries it.

    Args:
        optimizer: the sharded optimizer.
        buckets: its buckets.
        saved: a dict from :func:`consolidate_state` or a plain ``optimizer.state_dict()`` of the unsharded
            optimizer.
    """
    saved_groups = saved.get("param_groups", [])
    n_groups = len(optimizer.param_groups)
    if len(saved_groups) != n_groups:
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} param groups, this one has {n_groups}: the "
            "checkpoint comes from a different model or optimizer configuration."
        )
    saved_state = saved.get("state", {})
    masters = saved.get("sdp4bit", {}).get("master", {})
    for group_index, (group, sgroup) in enumerate(zip(optimizer.param_groups, saved_groups, strict=True)):
        ids = list(sgroup["params"])
        mine = group_buckets(buckets, group_index)
        n_params = sum(len(b.params) for b in mine)
        if len(ids) != n_params:
            raise ValueError(
                f"A param group of the checkpoint has {len(ids)} parameters, this one has {n_params}: the "
                "checkpoint comes from a different configuration."
            )
        start = 0
        for bucket in mine:
            _load_bucket(optimizer, bucket, ids[start : start + len(bucket.params)], saved_state, masters)
            start += len(bucket.params)
        for k, v in sgroup.items():
            if k != "params":
                group[k] = v


def put_master_weights(state: dict[str, Any], module: Module, buckets: list[FlatBucket]) -> dict[str, Any]:
    """Replace the parameters in ``module``'s ``state`` dict by the exact master weights (a collective).

    Every name of a parameter is replaced (tied weights appear under several names), in the state's dtype.
    """
    aliases: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    for bucket in buckets:
        full = bucket.full_master()
        for p, view in zip(bucket.params, bucket.views(full), strict=True):
            for name in aliases.get(id(p), []):
                if name in state:
                    state[name] = view.to(state[name].dtype).clone()
    return state


def _load_bucket(optimizer: Optimizer, bucket: FlatBucket, ids: list[int], saved_state: dict, masters: dict) -> None:
    """Cut the consolidated state of parameters ``ids`` for this rank's shard of ``bucket``."""
    entries = [saved_state.get(i, {}) for i in ids]
    new_state: dict[str, Any] = {}
    keys = set().union(*(e.keys() for e in entries)) if entries else set()
    for k in sorted(keys):
        values = [e.get(k) for e in entries]
        # a plain optimizer's state (e.g. one saved by a single process) has no entry for a parameter that never
        # got a gradient: such a parameter starts from fresh state, as torch would start it
        present = [(v, p) for v, p in zip(values, bucket.params, strict=True) if v is not None]
        first = present[0][0] if present else None
        per_param = bool(present) and all(
            isinstance(v, Tensor) and v.shape == p.shape and v.dim() > 0 for v, p in present
        )
        if per_param:
            values = [
                v if v is not None else _fresh_state(optimizer, bucket, k, p)
                for v, p in zip(values, bucket.params, strict=True)
            ]
            new_state[k] = bucket.shard_of(values).to(bucket.master.device)
        elif isinstance(first, Tensor) and first.dim() == 0:
            new_state[k] = first.clone().to(bucket.master.device)
        elif first is not None and not isinstance(first, Tensor):
            new_state[k] = first
        else:
            shapes = [tuple(v.shape) if isinstance(v, Tensor) else None for v in values]
            raise ValueError(
                f"The checkpoint's optimizer state {k!r} has shapes {shapes}, which do not match the parameters "
                f"{[tuple(p.shape) for p in bucket.params]}: it comes from a different configuration."
            )
    optimizer.state[bucket.master] = new_state if new_state else {}
    if not new_state:
        del optimizer.state[bucket.master]
    if all(i in masters for i in ids):
        for i, p in zip(ids, bucket.params, strict=True):
            if tuple(masters[i].shape) != tuple(p.shape):
                raise ValueError(
                    f"The checkpoint's master weight {i} has shape {tuple(masters[i].shape)}, the parameter "
                    f"has {tuple(p.shape)}: the checkpoint comes from a different configuration."
                )
        with torch.no_grad():
            bucket.master.copy_(bucket.shard_of([masters[i] for i in ids]))
    else:
        with torch.no_grad():
            bucket.load_from_params()
            lo = bucket.master_lo
            bucket.master.copy_(bucket.model_flat[lo : lo + bucket.master.numel()].float())


# Value of a fresh optimizer state entry where it is not zero (Rprop starts every step size at the learning rate).
_FRESH_STATE_FROM_GROUP = {"step_size": "lr"}
# What :func:`snapshot_absent` saves for one bucket: its group index, the bucket, the shard ranges of the absent
# parameters, their master values and their optimizer state (``{"": None}``: no state yet, reset to fresh values).
AbsentSnapshot = tuple[int, FlatBucket, list[tuple[int, int]], Tensor, dict[str, Tensor | None]]


def _fresh_state(optimizer: Optimizer, bucket: FlatBucket, key: str, param: Tensor) -> Tensor:
    """The value state ``key`` of a parameter that has none yet starts from (zeros, or Rprop's learning rate)."""
    fresh = _FRESH_STATE_FROM_GROUP.get(key)
    value = float(optimizer.param_groups[bucket.group_index][fresh]) if fresh else 0.0
    return torch.full(param.shape, value, dtype=torch.float32)


def _is_shard_state(value: Any, bucket: FlatBucket) -> bool:
    return isinstance(value, Tensor) and value.dim() == 1 and value.numel() == bucket.master.numel()


def _range_index(bucket: FlatBucket, ranges: list[tuple[int, int]]) -> Tensor:
    return torch.cat([torch.arange(a, b, device=bucket.master.device) for a, b in ranges])


def snapshot_absent(
    optimizer: Optimizer, buckets: list[FlatBucket], absent: dict[int, list[int]]
) -> list[AbsentSnapshot]:
    """Save the master values and optimizer state of parameters without a gradient on any rank.

    torch's optimizers leave a parameter whose ``.grad`` is ``None`` alone; on a flat shard its values would still
    be stepped (weight decay, momentum). :func:`restore_absent` puts them back after the step.

    Args:
        optimizer: the sharded optimizer.
        buckets: its buckets.
        absent: per bucket (``id(bucket)``), the indices of its parameters that no rank has a gradient for.
    """
    saved_all: list[AbsentSnapshot] = []
    for bucket in buckets:
        indices = absent.get(id(bucket))
        if not indices or bucket.master.grad is None:
            continue
        ranges = bucket.master_ranges(indices)
        if not ranges:
            continue
        idx = _range_index(bucket, ranges)
        state = optimizer.state.get(bucket.master, {})
        saved: dict[str, Tensor | None] = {k: v[idx].clone() for k, v in state.items() if _is_shard_state(v, bucket)}
        if not state:
            saved = {"": None}  # the state does not exist yet: reset to fresh values after the step
        saved_all.append((bucket.group_index, bucket, ranges, bucket.master.detach()[idx].clone(), saved))
    return saved_all


@torch.no_grad()
def restore_absent(optimizer: Optimizer, snapshots: list[AbsentSnapshot]) -> None:
    """Undo the optimizer step on what :func:`snapshot_absent` saved."""
    for index, bucket, ranges, master, saved in snapshots:
        idx = _range_index(bucket, ranges)
        bucket.master.index_copy_(0, idx, master)
        state = optimizer.state.get(bucket.master, {})
        for k, v in state.items():
            if not _is_shard_state(v, bucket):
                continue
            if k in saved and saved[k] is not None:
                v.index_copy_(0, idx, saved[k])
            elif "" in saved:
                fresh = _FRESH_STATE_FROM_GROUP.get(k)
                v.index_fill_(0, idx, float(optimizer.param_groups[index][fresh]) if fresh else 0.0)


@torch.no_grad()
def expose_gradients(buckets: list[FlatBucket], absent: dict[int, list[int]]) -> None:
    """Put the reduced gradients in the parameters' ``.grad``, as DDP holds them (a collective unless replicated).

    Each bucket's gradient shards are all-gathered into one fp32 buffer; the parameters' ``.grad`` become views of
    it (copies for other dtypes) and the master's gradient becomes the view of this rank's shard, so an in-place
    edit of an fp32 ``.grad`` (scaling, clipping by hand) reaches the step. Parameters without a gradient on any rank
    (``absent``) keep ``None``.
    """
    for bucket in buckets:
        grad = bucket.master.grad
        if grad is None:
            continue
        full = grad if bucket.replicated else bucket.gather_full(grad)
        if not bucket.replicated:
            bucket.master.grad = full[bucket.lo : bucket.lo + bucket.shard_size]
        skip = set(absent.get(id(bucket), []))
        for i, (p, view) in enumerate(zip(bucket.params, bucket.views(full), strict=True)):
            if i not in skip:
                p.grad = view if p.dtype == torch.float32 else view.to(p.dtype)


def clip_shard_grads(buckets: list[FlatBucket], kind: str, clip_val: float, device: torch.device) -> None:
    """Clip the reduced shard gradients of ``buckets`` in place, as if the whole model's gradients were clipped.

    ``"norm"`` is ``clip_grad_norm_`` (the norm of all shards, all-reduced across ranks), ``"value"`` is
    ``clip_grad_value_``.
    """
    with_grad = [b for b in buckets if b.master.grad is not None]
    grads = [b.master.grad for b in with_grad if b.master.grad is not None]
    if kind == "value":
        for g in grads:
            g.clamp_(-clip_val, clip_val)
        return
    sq = torch.zeros(1, dtype=torch.float32, device=device)
    for b, g in zip(with_grad, grads, strict=True):
        sq += b.own(g).pow(2).sum()  # each value once over the ranks (a replicated master holds every value)
    total = all_reduce_sum(sq).sqrt()
    coef = torch.clamp(clip_val / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


def shard_grad_norms(
    buckets: list[FlatBucket], absent: dict[int, list[int]], names: dict[int, str], norm_type: float
) -> tuple[list[str], Tensor | None]:
    """Per parameter, this rank's part of the p-norm of its reduced gradient (sum of ``|g|^p``, or max for inf).

    Parameters not in ``names`` (``id -> name``) or without a gradient on any rank (``absent``) are left out. Sum
    (or max) the parts over ranks and take the p-th root for the norms.

    Returns:
        The parameter names and their parts (``None`` when there is none).
    """
    out: list[str] = []
    parts: list[Tensor] = []
    for bucket in buckets:
        grad = bucket.master.grad
        if grad is None:
            continue
        skip = set(absent.get(id(bucket), []))
        for i, p in enumerate(bucket.params):
            if i in skip or id(p) not in names:
                continue
            out.append(names[id(p)])
            ranges = bucket.shard_ranges([i])
            own = bucket.own(grad)
            values = own[ranges[0][0] : ranges[0][1]].double().abs() if ranges else grad.new_zeros(0).double()
            if math.isinf(norm_type):
                parts.append(values.max() if values.numel() else values.new_zeros(()))
            else:
                parts.append(values.pow(norm_type).sum())
    return out, (torch.stack(parts) if parts else None)


def all_reduce_sum(values: Tensor) -> Tensor:
    """Sum a small tensor over all ranks (no-op without a process group)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
    return values
