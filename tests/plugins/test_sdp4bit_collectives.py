"""SDP4Bit's point-to-point collectives on gloo against the library collectives they replace (4 processes)."""

import torch
import torch.distributed as dist

from lightning_sdp.plugins.sdp4bit.collectives import (
    all_gather_into_tensor,
    all_gather_rows,
    point_to_point,
    reduce_rows,
)
from lightning_sdp.plugins.sdp4bit.topology import build_topology
from tests._distributed import run_distributed


def _compare(rank: int, world: int, seed: int) -> list[str]:
    """Every group of a 2x2 grid, built twice (new group objects each time): both forms agree; returns mismatches."""
    bad = []
    for attempt in range(2):
        topo = build_topology(rank, world, 2)
        groups = {"intra": topo.intra_group, "inter": topo.inter_group, "world": topo.world_group, "default": None}
        for name, group in groups.items():
            size = dist.get_world_size(group)
            gen = torch.Generator().manual_seed(seed + 31 * rank + attempt)
            row = torch.randn(int(torch.randint(1, 50, (1,), generator=gen)) + 7, generator=gen)
            # Every rank must agree on the row length: take the largest over ranks.
            length = torch.tensor([row.numel()])
            dist.all_reduce(length, op=dist.ReduceOp.MAX)
            row = torch.cat([row, torch.randn(int(length) - row.numel(), generator=gen)])
            expected = torch.empty(size * row.numel())
            all_gather_into_tensor(expected, row, group=group)
            got = torch.full_like(expected, float("nan"))
            all_gather_rows(got, row, group)
            if not torch.equal(got, expected):
                bad.append(f"all_gather_rows on {name}")
            send = torch.randn(size, row.numel(), generator=gen)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=group)
            if not torch.allclose(reduce_rows(send, group), recv.sum(dim=0), rtol=1e-6, atol=1e-6):
                bad.append(f"reduce_rows on {name}")
            if not point_to_point(group):
                bad.append(f"{name}: gloo group not exchanged point to point")
        topo.destroy()
    return bad


def test_point_to_point_rows_match_the_library_collectives_on_every_group() -> None:
    seed = int(torch.randint(0, 10_000, (1,)))
    results = run_distributed(_compare, 4, seed)
    assert results == [[], [], [], []], f"seed {seed}: {results}"


def _two_rank_sum_is_exact(rank: int, world: int) -> bool:
    send = torch.randn(2, 1000, generator=torch.Generator().manual_seed(rank))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return torch.equal(reduce_rows(send, None), recv.sum(dim=0))


def test_reduce_rows_of_two_ranks_is_bit_identical_to_all_to_all_and_sum() -> None:
    assert run_distributed(_two_rank_sum_is_exact, 2) == [True, True]
