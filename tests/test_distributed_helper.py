import pytest
import torch
import torch.distributed as dist

from tests._distributed import run_distributed


def _all_reduce(rank: int, world_size: int, value: float) -> float:
    t = torch.tensor([value * (rank + 1)])
    dist.all_reduce(t)
    return float(t)


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def test_run_distributed_returns_per_rank_results():
    assert run_distributed(_all_reduce, 2, 1.5) == [4.5, 4.5]


def test_run_distributed_reports_failing_rank_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1.*boom on rank one"):
        run_distributed(_fail_on_rank_one, 2, timeout=60)
