"""Flat, padded parameter buckets and in-place sharding of a user optimizer (distributed-optimizer style).

Each optimizer param group becomes one :class:`FlatBucket`: its parameters laid end to end in a flat buffer of
``world_size * S`` values (zero padding at the end), where ``S`` is a whole number of quantisation groups and
Hadamard blocks. Rank ``r`` keeps the fp32 master copy of ``[r * S, (r + 1) * S)`` and the optimizer sees only
that shard: ``param_group["params"] = [master_shard]``, so AdamW, SGD, ... and any LR scheduler run unchanged on
``1 / world_size`` of the state. Optimizer state is consolidated to the unsharded layout for checkpoints and cut
again for the world size that loads it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_sdp.plugins.sdp4bit.exchange import _all_gather_single, padded_shard_size

# Optimizers whose update is element-wise, so that stepping a shard equals stepping the whole tensor. Subclasses of
# these (``class MyAdamW(AdamW)``) are accepted too: they inherit the element-wise update.
SUPPORTED_OPTIMIZERS = (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop",
)  # fmt: skip

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


class FlatBucket:
    """One param group flattened: full model copy (every rank), fp32 master shard (this rank), grad buffer.

    Args:
        params: the group's parameters (one dtype and device).
        names: a name per parameter (for error messages).
        world_size: data-parallel world size.
        rank: this rank.
        alignment: ``S`` is a multiple of this (lcm of the group sizes and the Hadamard size).
        param_alignment: every parameter starts at a multiple of this in the flat buffer (the Hadamard block size
            when gradients are Hadamard-transformed, so that no block mixes two parameters; 1 otherwise).
    """

    def __init__(
        self,
        params: list[Tensor],
        names: list[str],
        world_size: int,
        rank: int,
        alignment: int,
        param_alignment: int = 1,
    ) -> None:
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
        self.numels = [p.numel() for p in params]
        # offsets[i] is where parameter i starts; offsets[-1] is the end of the last one
        self.offsets = []
        end = 0
        for n in self.numels:
            start = -(-end // param_alignment) * param_alignment
            self.offsets.append(start)
            end = start + n
        self.offsets.append(end)
        self.numel = end
        self.world_size = world_size
        self.rank = rank
        self.shard_size = padded_shard_size(self.numel, world_size, alignment)
        self.padded = world_size * self.shard_size
        self.lo = rank * self.shard_size
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.model_flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self.grad_flat = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        self.load_from_params()
        self.master = self.model_flat[self.lo : self.lo + self.shard_size].float().clone()

    def views(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views of a flat buffer with this bucket's layout."""
        return [
            flat[a : a + n].view_as(p) for a, n, p in zip(self.offsets[:-1], self.numels, self.params, strict=True)
        ]

    @torch.no_grad()
    def load_from_params(self) -> None:
        """Copy the parameters into the flat model buffer (the padding stays zero)."""
        torch._foreach_copy_(self.views(self.model_flat), [p.detach() for p in self.params])

    @torch.no_grad()
    def store_to_params(self) -> None:
        """Copy the flat model buffer back into the parameters."""
        torch._foreach_copy_([p.data for p in self.params], self.views(self.model_flat))

    @torch.no_grad()
    def gather_grads(self) -> Tensor:
        """Flat fp32 copy of the parameters' gradients (missing gradients count as zero)."""
        self.grad_flat.zero_()
        for view, p in zip(self.views(self.grad_flat), self.params, strict=True):
            if p.grad is not None:
                view.copy_(p.grad)
        return self.grad_flat

    def has_grad_flags(self) -> Tensor:
        """One value per parameter: 1.0 where this rank holds a gradient, 0.0 where it is ``None``."""
        return torch.tensor([float(p.grad is not None) for p in self.params], dtype=torch.float32)

    def shard_ranges(self, indices: list[int]) -> list[tuple[int, int]]:
        """Where parameters ``indices`` lie in this rank's shard, as ``[a, b)`` ranges of shard positions."""
        out = []
        for i in indices:
            a = max(self.offsets[i], self.lo)
            b = min(self.offsets[i] + self.numels[i], self.lo + self.shard_size)
            if a < b:
                out.append((a - self.lo, b - self.lo))
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
        if self.world_size == 1:
            return self.master.clone()
        full = torch.empty(self.padded, dtype=torch.float32, device=self.device)
        _all_gather_single(full, self.master.detach().contiguous())
        return full

    def gather_full(self, shard: Tensor) -> Tensor:
        """All-gather a shard-shaped tensor (e.g. ``exp_avg``) into the full flat buffer (a collective)."""
        if self.world_size == 1:
            return shard.detach().clone()
        full = torch.empty(self.padded, dtype=shard.dtype, device=shard.device)
        _all_gather_single(full, shard.detach().contiguous())
        return full

    def shard_of(self, per_param: list[Tensor]) -> Tensor:
        """This rank's slice of the flat concatenation of ``per_param`` (zero padding), as fp32."""
        full = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        for view, t in zip(self.views(full), per_param, strict=True):
            view.copy_(t.reshape(view.shape))
        return full[self.lo : self.lo + self.shard_size].clone()


def shard_group(
    group: dict[str, Any],
    names: dict[int, str],
    world_size: int,
    rank: int,
    alignment: int,
    param_alignment: int = 1,
) -> FlatBucket:
    """Build the :class:`FlatBucket` of one param group (its ``"params"`` are left as they are).

    Args:
        group: an optimizer param group holding model parameters.
        names: ``id(param) -> name`` for error messages.
        world_size: data-parallel world size.
        rank: this rank.
        alignment: shard sizes are multiples of this.
        param_alignment: parameter starts are multiples of this.
    """
    params = list(group["params"])
    bucket = FlatBucket(
        params, [names.get(id(p), f"<unnamed {tuple(p.shape)}>") for p in params], world_size, rank, alignment,
        param_alignment,
    )  # fmt: skip
    bucket.master.requires_grad_(True)
    return bucket


def shard_optimizer(
    optimizer: Optimizer,
    names: dict[int, str],
    world_size: int,
    rank: int,
    alignment: int,
    param_alignment: int = 1,
    allow_any: bool = False,
) -> list[FlatBucket]:
    """Build one flat bucket per param group of an optimizer that holds no state yet. Returns the buckets.

    The param groups keep the model parameters; :func:`use_shards` swaps the fp32 master shards in while the
    optimizer steps (or its state is read or written).

    Args:
        optimizer: the user's optimizer, still holding the model parameters and no state.
        names: ``id(param) -> name`` for error messages.
        world_size: data-parallel world size.
        rank: this rank.
        alignment: shard sizes are multiples of this.
        param_alignment: parameter starts are multiples of this.
        allow_any: see :func:`check_optimizer`.
    """
    check_optimizer(optimizer, allow_any)
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError(
            "SDP4BitStrategy must shard the optimizer before its first step, but it already holds state. Create "
            "the optimizer in `configure_optimizers` and load optimizer state through `ckpt_path=`."
        )
    buckets = [
        shard_group(group, names, world_size, rank, alignment, param_alignment) for group in optimizer.param_groups
    ]
    optimizer.state.clear()
    return buckets


class use_shards:  # noqa: N801 - used like a function: ``with use_shards(optimizer, buckets): ...``
    """Context manager: the optimizer's param groups hold the fp32 master shards inside, the model parameters outside.

    Outside, ``optimizer.param_groups`` looks as in plain Lightning (callbacks such as ``BackboneFinetuning`` and
    ``toggle_optimizer`` see the model parameters); inside, the user's optimizer steps the shards.

    Args:
        optimizer: the sharded optimizer.
        buckets: its buckets, one per param group.
    """

    def __init__(self, optimizer: Optimizer, buckets: list[FlatBucket]) -> None:
        self.optimizer = optimizer
        self.buckets = buckets

    def __enter__(self) -> Optimizer:
        for group, bucket in zip(self.optimizer.param_groups, self.buckets, strict=True):
            group["params"] = [bucket.master]
        return self.optimizer

    def __exit__(self, *exc: Any) -> None:
        for group, bucket in zip(self.optimizer.param_groups, self.buckets, strict=True):
            group["params"] = list(bucket.params)


def consolidate_state(
    optimizer: Optimizer, buckets: list[FlatBucket], extra: dict[str, Any]
) -> dict[str, Any]:
    """The optimizer state as the unsharded optimizer would save it (a collective; every rank must call it).

    Shard-shaped state tensors are all-gathered, cut per parameter and reshaped; scalar state (``step``) is copied.
    The fp32 master weights are added under ``"sdp4bit"`` together with ``extra``.

    Args:
        optimizer: the sharded optimizer.
        buckets: its buckets, one per param group.
        extra: more entries for the ``"sdp4bit"`` section.
    """
    state: dict[int, dict[str, Any]] = {}
    groups = []
    masters: dict[int, Tensor] = {}
    index = 0
    for group, bucket in zip(optimizer.param_groups, buckets, strict=True):
        shard_state = optimizer.state.get(bucket.master, {})
        full = {
            k: bucket.gather_full(v) if isinstance(v, Tensor) and v.numel() == bucket.shard_size and v.dim() == 1
            else v
            for k, v in sorted(shard_state.items())
        }  # fmt: skip
        master_full = bucket.full_master()
        ids = []
        for i, p in enumerate(bucket.params):
            a, n = bucket.offsets[i], bucket.numels[i]
            entry = {}
            for k, v in full.items():
                is_flat = isinstance(v, Tensor) and v.dim() == 1 and v.numel() == bucket.padded
                entry[k] = (
                    v[a : a + n].view_as(p).clone()
                    if is_flat
                    else (v.clone() if isinstance(v, Tensor) else v)
                )
            if entry:
                state[index] = entry
            masters[index] = master_full[a : a + n].view(p.shape).clone()
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups, "sdp4bit": {"master": masters, **extra}}


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
    if len(saved_groups) != len(buckets):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} param groups, this one has {len(buckets)}: the "
            "checkpoint comes from a different model or optimizer configuration."
        )
    saved_state = saved.get("state", {})
    masters = saved.get("sdp4bit", {}).get("master", {})
    for group, bucket, sgroup in zip(optimizer.param_groups, buckets, saved_groups, strict=True):
        ids = sgroup["params"]
        if len(ids) != len(bucket.params):
            raise ValueError(
                f"A param group of the checkpoint has {len(ids)} parameters, this one has {len(bucket.params)}: the "
                "checkpoint comes from a different configuration."
            )
        entries = [saved_state.get(i, {}) for i in ids]
        new_state: dict[str, Any] = {}
        keys = set().union(*(e.keys() for e in entries)) if entries else set()
        for k in sorted(keys):
            values = [e.get(k) for e in entries]
            first = values[0]
            per_param = all(
                isinstance(v, Tensor) and v.shape == p.shape and v.dim() > 0
                for v, p in zip(values, bucket.params, strict=True)
            )
            if per_param:
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
        for k, v in sgroup.items():
            if k != "params":
                group[k] = v
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
                bucket.master.copy_(bucket.model_flat[bucket.lo : bucket.lo + bucket.shard_size].float())


def all_reduce_sum(values: Tensor) -> Tensor:
    """Sum a small tensor over all ranks (no-op without a process group)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
    return values
