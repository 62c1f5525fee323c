"""``bucket_size_mb="auto"``: how many buckets this run's link and machine want, measured at set-up.

Buckets trade two costs. The last bucket's gradients cross the link after backward with nothing left to hide them
(about ``G / B`` for ``B`` buckets and ``G`` seconds of gradient traffic per step), and every bucket costs its
collectives and their bookkeeping whatever its size (``c`` seconds). ``G / B + c * B`` is smallest at
``B = sqrt(G / c)``: one bucket on a fast link, several on a slow one. :func:`measured_bucket_numel` measures both
terms before the optimizer is sharded: ``G`` from the links' speed (:func:`~lightning_sdp.plugins.sdp4bit.auto.
probe_links`) and the bytes the most compressed gradient format sends, ``c`` by timing one bucket's collectives on
the smallest message. Nothing here imports Lightning.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_sdp.plugins.sdp4bit.auto import Agree, LinkSpeeds, agree_max, gradient_wire_bytes, probe_links
from lightning_sdp.plugins.sdp4bit.collectives import all_gather_rows
from lightning_sdp.plugins.sdp4bit.config import SDP4BitConfig
from lightning_sdp.plugins.sdp4bit.exchange import padded_shard_size
from lightning_sdp.plugins.sdp4bit.formats import GradientFormat
from lightning_sdp.plugins.sdp4bit.topology import Topology

# At most this many buckets per run (each one is padded to whole groups on every rank).
MAX_BUCKETS = 64


def choose_bucket_count(gradient_seconds: float, bucket_seconds: float, most: int = MAX_BUCKETS) -> int:
    """The bucket count that minimises ``gradient_seconds / B + bucket_seconds * B``, between 1 and ``most``.

    Args:
        gradient_seconds: time on the wire of one step's gradient exchange (``G``).
        bucket_seconds: what one more bucket costs a step, whatever its size (``c``).
        most: the largest count returned.
    """
    if gradient_seconds <= 0:
        return 1
    if bucket_seconds <= 0:
        return most
    return max(1, min(most, round(math.sqrt(gradient_seconds / bucket_seconds))))


def bucket_seconds(topo: Topology, device: torch.device, agree: Agree, repeats: int = 5) -> float:
    """Median wall time of one bucket's collectives on the smallest message, every rank at once (a collective).

    A bucket runs an all-to-all inside the node and one between nodes for its gradients and an all-gather of the
    weights; their cost on a few bytes is what a bucket adds whatever its size.
    """
    groups = [g for g in (topo.intra_group, topo.inter_group) if g is not None] or [topo.world_group]
    world = topo.world_size
    send = torch.zeros(world, device=device)
    recv, gathered = torch.empty_like(send), torch.empty(world * world, device=device)
    times = []
    for i in range(repeats + 1):
        agree([0.0])
        start = time.perf_counter()
        for group in groups:
            size = dist.get_world_size(group)
            dist.all_to_all_single(recv[:size], send[:size], group=group)
        all_gather_rows(gathered, send, topo.world_group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first round sets up the connections
            times.append(time.perf_counter() - start)
    return agree([statistics.median(times)])[0]


def gradient_seconds(
    fmt: GradientFormat, topo: Topology, values: int, alignment: int, gradient_group: int, links: LinkSpeeds
) -> float:
    """Seconds on the wire of one step's gradient exchange of ``values`` values in ``fmt``, at the links' speed."""
    shard = padded_shard_size(values, topo.world_size, alignment)
    intra, inter = gradient_wire_bytes(fmt, topo, [shard], gradient_group)
    return intra / (links.intra or math.inf) + inter / (links.inter or math.inf)


def measured_bucket_numel(
    topo: Topology,
    device: torch.device,
    formats: Sequence[GradientFormat],
    values: int,
    alignment: int,
    gradient_group: int,
) -> tuple[int, dict[str, Any]]:
    """Values per bucket for this run (a collective on every rank; every rank gets the same answer).

    Args:
        topo: the process topology.
        device: the strategy's root device.
        formats: the gradient formats the run may use; the one that sends least decides (a slow link's choice).
        values: trainable values of the model (every param group together).
        alignment: every shard is a multiple of this many values.
        gradient_group: values per gradient scale.

    Returns:
        ``(values per bucket, what was measured)``.
    """
    agree = agree_max(topo, device)
    links = probe_links(topo, device, agree)
    wire = min(gradient_seconds(f, topo, values, alignment, gradient_group, links) for f in formats)
    cost = bucket_seconds(topo, device, agree)
    count = choose_bucket_count(wire, cost)
    numel = max(alignment, math.ceil(values / count))
    return numel, {"links": links, "gradient_seconds": wire, "bucket_seconds": cost, "buckets": count}


def bucket_numel(
    config: SDP4BitConfig, topo: Topology | None, device: torch.device, optimizers: Sequence[Optimizer], alignment: int
) -> tuple[int | None, str | None, LinkSpeeds | None]:
    """Values per bucket of this ``fit`` and, for ``bucket_size_mb="auto"``, the choice in words and the links it
    measured (else ``None`` for both; ``"auto"`` compression reuses the links instead of probing them again).

    With ``"auto"`` every rank must call this (it probes the links); with one process it returns the configured size.
    """
    if config.bucket_size_mb != "auto" or topo is None or topo.world_size == 1:
        return config.bucket_numel, None, None
    values = sum(p.numel() for opt in optimizers for g in opt.param_groups for p in g["params"] if p.requires_grad)
    numel, seen = measured_bucket_numel(
        topo, device, config.gradient_candidates, max(values, 1), alignment, config.gradient_group_size
    )
    words = (
        f"SDP4Bit buckets: {seen['buckets']} of at most {numel:,} values (the gradients take "
        f"{1e3 * seen['gradient_seconds']:.1f} ms per step on the measured links, {seen['links'].describe()}; "
        f"a bucket's collectives {1e3 * seen['bucket_seconds']:.2f} ms)"
    )
    return numel, words, seen["links"]
