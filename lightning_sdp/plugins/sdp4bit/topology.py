"""Two-level (intra-node / inter-node) process topology for SDP4Bit's hierarchical gradient exchange."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor


@dataclass
class Topology:
    """Where this rank sits in a ``inter_size x intra_size`` grid of processes.

    Rank ``r`` lives on node ``r // intra_size`` with local index ``r % intra_size`` (Lightning's global rank is
    ``node_rank * num_processes + local_rank``). ``intra_group`` holds the ranks of this rank's node,
    ``inter_group`` the ranks of every node with the same local index. Groups of size 1 are ``None``. The rank owns
    shard :attr:`shard` of every flat buffer (local-major, see :func:`shard_index`).

    Attributes:
        rank: global rank.
        world_size: data-parallel world size.
        intra_size: processes per (real or emulated) node.
        inter_size: number of nodes.
        intra_group: process group of this node, or ``None``.
        inter_group: process group of the ranks with this local index, or ``None``.
        world_group: a private process group of all ranks for the strategy's own collectives (weight all-gathers
            that may run on a communication thread while the training loop uses the default group), or ``None``.
        weight_inter_group: with several nodes of several processes, a private group of the ranks with this
            local index for the weight all-gather's inter-node stage, or ``None``.
        weight_intra_group: the same for its intra-node stage (this rank's node), or ``None``.
        owned_groups: the process groups :func:`build_topology` created that hold this rank (to destroy them).
        timeout: how long a collective on these groups waits for a peer (``None``: torch's default).
    """

    rank: int
    world_size: int
    intra_size: int
    inter_size: int
    intra_group: Any = None
    inter_group: Any = None
    world_group: Any = None
    weight_inter_group: Any = None
    weight_intra_group: Any = None
    owned_groups: list[Any] = field(default_factory=list)
    timeout: timedelta | None = None

    def destroy(self) -> None:
        """Destroy the process groups this topology created (not the default group); idempotent."""
        while self.owned_groups:
            group = self.owned_groups.pop()
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group(group)
        self.intra_group = self.inter_group = self.world_group = None
        self.weight_inter_group = self.weight_intra_group = None

    @property
    def node(self) -> int:
        """Index of this rank's node."""
        return self.rank // self.intra_size

    @property
    def local(self) -> int:
        """Index of this rank inside its node."""
        return self.rank % self.intra_size

    @property
    def shard(self) -> int:
        """Index of the shard this rank owns (see :func:`shard_index`)."""
        return shard_index(self.rank, self.world_size, self.intra_size)

    @classmethod
    def single(cls) -> Topology:
        """The trivial topology of a one-process run."""
        return cls(rank=0, world_size=1, intra_size=1, inter_size=1)


def shard_index(rank: int, world_size: int, intra_size: int | None) -> int:
    """The shard of the flat buffers that ``rank`` owns: local-major, ``local * inter_size + node``.

    With this order the shards a node's rank ``j`` reduces lie side by side (``[j * N, (j + 1) * N)`` for ``N``
    nodes), so the intra-node all-to-all sends contiguous blocks and the two-stage weight all-gather (across nodes,
    then inside the node) lands in shard order: neither copies the whole buffer to reorder it. With one node or one
    process per node this is the rank itself.

    Args:
        rank: global rank.
        world_size: data-parallel world size.
        intra_size: processes per node (``None``: one node).
    """
    if not intra_size or intra_size in (1, world_size):
        return rank
    inter_size = world_size // intra_size
    return (rank % intra_size) * inter_size + rank // intra_size


def in_shard_order(by_rank: Tensor, world_size: int, intra_size: int | None) -> Tensor:
    """View of rows gathered in rank order (``world_size`` equal rows, flat) as ``(L, N, row)`` in shard order.

    Rank ``(node n, local j)`` holds shard ``j * N + n`` (:func:`shard_index`), so the rank-order rows ``(N, L)``
    transposed are in shard order; flatten the view (``reshape(-1)``, a copy) or ``copy_`` it into a buffer.
    """
    local = intra_size if intra_size and intra_size > 1 else world_size
    return by_rank.view(world_size // local, local, -1).transpose(0, 1)


def build_topology(rank: int, world_size: int, intra_size: int, timeout: timedelta | None = None) -> Topology:
    """Create the intra- and inter-node process groups. Every rank must call this, in the same order.

    Args:
        rank: global rank of the caller.
        world_size: size of the default process group.
        intra_size: processes per node; must divide ``world_size``.
        timeout: how long a collective on these groups waits for a peer before it fails (``None``: torch's default
            for a new group, 30 minutes; the strategy passes its own ``timeout``).
    """
    if intra_size < 1 or world_size % intra_size:
        raise ValueError(
            f"The intra-node size ({intra_size}) must divide the world size ({world_size}). Set "
            "`SDP4BitStrategy(intra_node_size=...)` to the number of processes per node."
        )
    inter_size = world_size // intra_size
    topo = Topology(rank=rank, world_size=world_size, intra_size=intra_size, inter_size=inter_size, timeout=timeout)
    if world_size == 1:
        return topo
    nodes = [list(range(n * intra_size, (n + 1) * intra_size)) for n in range(inter_size)]
    peers = [list(range(local, world_size, intra_size)) for local in range(intra_size)]
    if intra_size > 1:
        topo.intra_group = _own_group(topo, nodes)
    if inter_size > 1:
        topo.inter_group = _own_group(topo, peers)
    topo.world_group = _own_group(topo, [list(range(world_size))])
    if inter_size > 1 and intra_size > 1:
        # The weight all-gather in two stages (across nodes, then inside each node) sends each shard over the
        # slow link once per remote node; its own groups keep its collectives apart from the gradient threads'.
        topo.weight_inter_group = _own_group(topo, peers)
        topo.weight_intra_group = _own_group(topo, nodes)
    return topo


def _own_group(topo: Topology, partition: list[list[int]]) -> Any:
    """Create one process group per rank list (every rank creates all of them, in order); keep the caller's."""
    mine = None
    for ranks in partition:
        group = dist.new_group(ranks, timeout=topo.timeout)
        if topo.rank in ranks:
            mine = group
            topo.owned_groups.append(group)
    return mine
