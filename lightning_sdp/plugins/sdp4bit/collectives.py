"""The collectives SDP4Bit's exchanges run, each in the form that costs least on the process group's backend.

On NCCL the library collectives are the fast path. On gloo (CPU clusters) they are not: its all-gather flattens
and copies through staging buffers, and an all-to-all followed by a sum allocates and reads a receive buffer the
size of the whole input, so both cost a multiple of the CPU that one send and one receive per peer cost
(``benchmarks/README.md`` has the measurements). :func:`all_gather_rows` and :func:`reduce_rows` therefore exchange
rows point to point on gloo, straight into their destination.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# ``all_gather_into_tensor(output, input, group=None)``: every rank's ``input`` laid end to end in ``output``. Newer
# torch releases name it ``all_gather_single`` (beside ``all_to_all_single``); older ones only have the long name.
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_ranks(group: Any) -> list[int]:
    """Global ranks of ``group`` in group order (``None``: the default group)."""
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


def point_to_point(group: Any) -> bool:
    """Whether :func:`all_gather_rows` and :func:`reduce_rows` exchange rows point to point on ``group`` (gloo)."""
    return dist.get_backend(group) == "gloo"


def all_to_all(out: Tensor, inp: Tensor, group: Any) -> None:
    """Row ``j`` of ``inp`` to the group's rank ``j``; row ``j`` of ``out`` from it."""
    dist.all_to_all_single(out, inp, group=group)


def _exchange(sends: dict[int, Tensor], recvs: dict[int, Tensor], group: Any) -> None:
    """Post every send and receive at once (no ordering can deadlock), then wait for all of them."""
    works = [dist.irecv(buffer, peer, group=group) for peer, buffer in recvs.items()]
    works += [dist.isend(row, peer, group=group) for peer, row in sends.items()]
    for work in works:
        if work is not None:  # ``None`` only for a rank outside ``group``
            work.wait()


def all_gather_rows(out: Tensor, row: Tensor, group: Any) -> None:
    """Every rank's ``row`` laid end to end in ``out`` in group order (``out``: ``k * row.numel()`` values).

    Args:
        out: receives the rows (contiguous; any shape with ``k * row.numel()`` elements).
        row: this rank's contribution (contiguous).
        group: the process group (``None``: the default group).
    """
    if not point_to_point(group):
        all_gather_into_tensor(out, row, group=group)
        return
    ranks = group_ranks(group)
    me = ranks.index(dist.get_rank())
    rows = out.view(len(ranks), -1)
    others = [(j, peer) for j, peer in enumerate(ranks) if j != me]
    _exchange({peer: row for _, peer in others}, {peer: rows[j] for j, peer in others}, group)
    rows[me].copy_(row)


def reduce_rows(send: Tensor, group: Any) -> Tensor:
    """Reduce-scatter: the sum over the group's ranks of their row ``me`` of ``send`` (``k`` rows), as a new tensor.

    Args:
        send: ``(k, m)`` rows; row ``j`` is this rank's contribution to the group's rank ``j``.
        group: the process group (``None``: the default group).
    """
    ranks = group_ranks(group)
    k = len(ranks)
    if not point_to_point(group):
        recv = torch.empty_like(send)
        all_to_all(recv, send, group)
        return recv.sum(dim=0)
    me = ranks.index(dist.get_rank())
    if k == 1:
        return send[me].clone()
    others = [(j, peer) for j, peer in enumerate(ranks) if j != me]
    buffers = torch.empty(k - 1, send.shape[1], dtype=send.dtype, device=send.device)
    _exchange({peer: send[j] for j, peer in others}, {peer: buffers[i] for i, (_, peer) in enumerate(others)}, group)
    total = buffers[0]
    for extra in buffers[1:]:
        total.add_(extra)
    return total.add_(send[me])
