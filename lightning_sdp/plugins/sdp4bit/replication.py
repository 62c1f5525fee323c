"""DDP's arithmetic as a candidate of ``"auto"``: an fp32 all-reduce of the gradients and a replicated optimizer.

On a fast link the sharded exchange (a reduce-scatter and an all-gather, each in two levels) can cost more than the
single all-reduce DDP runs, even uncompressed. ``"auto"`` may then replicate the optimizer state: every bucket's
master becomes the whole flat buffer on every rank (for fp32 models the model's own buffer, so the parameters are
stepped in place as DDP steps them), the optimizer state is all-gathered to match, the gradients are all-reduced and
there is no weight all-gather. That gives up sharding's memory saving, so it is only tried when the extra bytes fit
(:func:`replica_fits`), and ``optimizer_state="shard"`` forbids it. :func:`replicate` and :func:`shard` switch a
sharded optimizer in place (both collectives); checkpoints are consolidated either way, so they do not depend on
the choice, nor on the world size. Nothing here imports Lightning.

With automatic optimization the all-reduce itself is torch's: :func:`reducer_wrapper` wraps the module in
``DistributedDataParallel``, whose C++ reducer averages the gradients while backward runs (the same all-reduce
issued from Python hooks and threads cost more CPU than DDP on a CPU-bound machine), and
:func:`take_reduced_gradients` hands its result to the replicated optimizer step.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_sdp.plugins.sdp4bit.overlap import all_finite
from lightning_sdp.plugins.sdp4bit.sharding import FlatBucket

# Replicate only if the ranks sharing one memory need at most this share of what it has free (the rest is headroom
# for activations, the allocator and other processes).
FIT_FRACTION = 0.8


def _is_master_state(value: Any, bucket: FlatBucket) -> bool:
    return isinstance(value, Tensor) and value.dim() == 1 and value.numel() == bucket.master.numel()


def _aliases_model(bucket: FlatBucket) -> bool:
    """Whether a replicated master can be the model's own flat buffer (fp32 weights: nothing to copy after a step)."""
    return bucket.dtype == torch.float32


@torch.no_grad()
def replicate(optimizer: Optimizer, buckets: list[FlatBucket]) -> None:
    """Make every sharded bucket's master and optimizer state the whole buffer on every rank (a collective).

    The model weights become the exact master weights (as after loading a checkpoint).
    """
    for bucket in buckets:
        if bucket.replicated:
            continue
        state = optimizer.state.pop(bucket.master, {})
        full_state = {k: bucket.gather_full(v) if _is_master_state(v, bucket) else v for k, v in state.items()}
        full = bucket.full_master()
        bucket.model_flat.copy_(full)
        bucket.store_to_params()
        bucket.master = bucket.model_flat if _aliases_model(bucket) else full
        bucket.replicated = True
        if full_state:
            optimizer.state[bucket.master] = full_state


@torch.no_grad()
def shard(optimizer: Optimizer, buckets: list[FlatBucket]) -> None:
    """Cut every replicated bucket's master and optimizer state back to this rank's shard (no communication)."""
    for bucket in buckets:
        if not bucket.replicated:
            continue
        state = optimizer.state.pop(bucket.master, {})
        lo, size = bucket.lo, bucket.shard_size
        cut = {k: v[lo : lo + size].clone() if _is_master_state(v, bucket) else v for k, v in state.items()}
        bucket.master = bucket.master[lo : lo + size].float().clone().requires_grad_(True)
        bucket.replicated = False
        if cut:
            optimizer.state[bucket.master] = cut


@torch.no_grad()
def finish_replicated_step(buckets: list[FlatBucket]) -> None:
    """After a replicated optimizer step: bring the model weights to the masters (a copy unless they are one)."""
    for bucket in buckets:
        if bucket.master is not bucket.model_flat:
            bucket.model_flat.copy_(bucket.master)
        bucket.store_to_params()


def reducer_wrapper(module: Module, device: torch.device, find_unused_parameters: bool) -> DistributedDataParallel:
    """``module`` wrapped in ``DistributedDataParallel`` with DDP's defaults, the gradients left in its buckets.

    The ranks' weights are already identical (replicated steps), so nothing is broadcast at construction. The
    wrapper only covers the parameters that require a gradient now: build a new one when that set changes.

    Args:
        module: the LightningModule.
        device: this rank's device.
        find_unused_parameters: let the reducer skip parameters that got no gradient in a step (DDP's option).
    """
    return DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters,
        init_sync=False,
        gradient_as_bucket_view=True,  # no copy back from the buckets: take_reduced_gradients copies them once
    )


@torch.no_grad()
def take_reduced_gradients(buckets: list[FlatBucket]) -> dict[int, list[int]]:
    """After a backward through :func:`reducer_wrapper`: the averaged gradients become the masters' ``.grad``.

    They are identical on every rank, so nothing needs agreeing. The parameters' fp32 ``.grad`` become views of the
    master's gradient, so hooks that read or edit them (``on_before_optimizer_step``) see what the optimizer steps.

    Returns:
        Per bucket (by ``id``), the parameters without a gradient (unused on every rank: the reducer leaves them
        ``None``); their slots of the master's gradient are zero.
    """
    absent: dict[int, list[int]] = {}
    for bucket in buckets:
        has_grad = [p.grad is not None for p in bucket.params]
        if not any(has_grad):
            bucket.master.grad = None  # the optimizer leaves the whole group alone, as torch does
            continue
        flat = bucket.gather_grads()
        for p, view in zip(bucket.params, bucket.views(flat), strict=True):
            if p.grad is not None and p.dtype == flat.dtype:
                p.grad = view
        if not all(has_grad):
            absent[id(bucket)] = [i for i, has in enumerate(has_grad) if not has]
        bucket.master.grad = flat
    return absent


def reduced_nonfinite_names(buckets: list[FlatBucket]) -> list[str] | None:
    """``None`` when every master gradient is finite, else the parameters holding NaN/Inf (identical on every rank
    after an all-reduce; empty when only the sum over ranks left the fp32 range)."""
    if all(all_finite(b.master.grad) for b in buckets if b.master.grad is not None):
        return None
    return [name for b in buckets for name in b.non_finite_names()]


def extra_bytes(optimizer: Optimizer, buckets: list[FlatBucket]) -> int:
    """Bytes per rank that replicating the optimizer of ``buckets`` costs beyond sharding it (what sharding saves).

    Every state tensor shaped like a master grows from the shard to the whole buffer; so does the fp32 master,
    except where it becomes the model's own fp32 buffer (then the shard is freed). Read after a first optimizer step
    (the state is created lazily).
    """
    total = 0
    for bucket in buckets:
        if bucket.replicated:
            continue
        state = optimizer.state.get(bucket.master, {})
        tensors = sum(_is_master_state(v, bucket) for v in state.values())
        grow = (bucket.padded - bucket.shard_size) * 4
        total += tensors * grow + (-bucket.shard_size * 4 if _aliases_model(bucket) else grow)
    return max(total, 0)


def free_bytes(device: torch.device) -> int:
    """Bytes this process could still allocate on ``device``: the GPU's free memory plus what torch's allocator
    holds unused, or the host's available memory (``MemAvailable`` of ``/proc/meminfo``)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _memory_key(device: torch.device) -> str:
    """Which memory this process allocates from: the host's (shared by its CPU processes) or one GPU's."""
    boot = Path("/proc/sys/kernel/random/boot_id")  # one per host, also across network namespaces
    host = boot.read_text().strip() if boot.exists() else socket.gethostname()
    return f"{host}/cuda:{device.index}" if device.type == "cuda" else host


def replica_fits(needed: int, device: torch.device) -> tuple[bool, str]:
    """Whether every rank can replicate: the ranks sharing a memory need at most :data:`FIT_FRACTION` of what
    it has free (a collective on the default group; every rank gets the same answer).

    Args:
        needed: this rank's extra bytes (:func:`extra_bytes`).
        device: this rank's device.

    Returns:
        ``(fits, what was compared, in words)``.
    """
    mine = (_memory_key(device), needed, free_bytes(device))
    everyone: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    memories: dict[str, tuple[int, int]] = {}
    for key, need, free in everyone:
        total, least_free = memories.get(key, (0, free))
        memories[key] = (total + need, min(least_free, free))
    worst = max(memories.values(), key=lambda pair: pair[0] / max(pair[1], 1))
    fits = all(need <= FIT_FRACTION * free for need, free in memories.values())
    words = f"{needed / 2**20:,.1f} MiB more per rank, {worst[0] / 2**20:,.1f} MiB of {worst[1] / 2**20:,.1f} MiB free"
    return fits, words
