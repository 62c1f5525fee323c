"""FastCLIP distributed reduction: 2 gloo processes give the same parameter gradient as 1 process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_sdp.models.fastclip.distributed import COMM_STATS
from lightning_sdp.models.fastclip.losses import VARIANTS, build_loss
from tests._distributed import run_distributed

N, DATA, STEPS = 8, 24, 3


class _TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.img = nn.Linear(10, 6)
        self.txt = nn.Linear(7, 6)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.2)))

    def encode_image(self, x: torch.Tensor) -> torch.Tensor:
        return self.img(x)

    def encode_text(self, x: torch.Tensor) -> torch.Tensor:
        return self.txt(x)


def _run(variant: str, rank: int, world_size: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = _TwoTower().double()
    loss_fn = build_loss(variant, DATA, gamma=0.6, rho=1.0, lr_tau=0.05).double()
    temperature = VARIANTS[variant].temperature
    g = torch.Generator().manual_seed(1)
    grads = []
    b = N // world_size
    for step in range(STEPS):
        x = torch.randn(N, 10, generator=g, dtype=torch.float64)
        t = x[:, :7] + 0.5 * torch.randn(N, 7, generator=g, dtype=torch.float64)
        idx = torch.randperm(DATA, generator=g)[:N]
        sl = slice(rank * b, (rank + 1) * b)
        model.zero_grad()
        e1 = F.normalize(model.encode_image(x[sl]), dim=-1)
        e2 = F.normalize(model.encode_text(t[sl]), dim=-1)
        ls = {"learnable": model.logit_scale, "constant": model.logit_scale.detach(), "individual": None}[temperature]
        out = loss_fn(e1, e2, idx[sl], ls)
        out.loss.backward()
        if world_size > 1:  # what DDP does: average parameter gradients
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= world_size
        grads.append({k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for k, p in model.named_parameters()})
        with torch.no_grad():  # a plain SGD step so later steps see new features
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.5 * p.grad
    return {"grads": grads, "state": {k: v.clone() for k, v in loss_fn.state_dict().items()}}


def _rank_fn(rank: int, world_size: int, variants: list[str]) -> dict[str, dict[str, object]]:
    results = {}
    for variant in variants:
        COMM_STATS.reset()
        result = _run(variant, rank, world_size)
        # plain numpy crosses the process boundary without torch's shared-memory file descriptors
        results[variant] = {
            "grads": [{k: v.numpy() for k, v in step.items()} for step in result["grads"]],
            "state": {k: v.numpy() for k, v in result["state"].items()},
            "bytes": COMM_STATS.bytes_received,
        }
    return results


def _variants() -> list[str]:
    from lightning_sdp._imports import _OPEN_CLIP_AVAILABLE

    return [v for v in sorted(VARIANTS) if v != "openclip" or _OPEN_CLIP_AVAILABLE]


@pytest.fixture(scope="module")
def two_process_results() -> list[dict[str, dict[str, object]]]:
    """One pair of gloo processes runs every variant (spawning is the slow part)."""
    return run_distributed(_rank_fn, 2, _variants(), timeout=180)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_process_gradient_equals_one_process(variant, two_process_results):
    if variant == "openclip":
        pytest.importorskip("open_clip")
    single = _run(variant, 0, 1)
    ranks = [r[variant] for r in two_process_results]
    for r in ranks:
        for step in range(STEPS):
            for name, grad in single["grads"][step].items():
                torch.testing.assert_close(torch.from_numpy(r["grads"][step][name]), grad, rtol=1e-9, atol=1e-12, msg=f"{variant} {name} {step}")
        for k, v in single["state"].items():
            torch.testing.assert_close(torch.from_numpy(r["state"][k]), v, rtol=1e-9, atol=1e-12, msg=f"{variant} state {k}")
    if variant != "openclip":
        # the gradient of the logit scale is non-zero exactly where it is learned
        learned = VARIANTS[variant].temperature == "learnable"
        assert (float(single["grads"][0]["logit_scale"].abs()) > 0) == learned
        assert ranks[0]["bytes"] > 0  # features and estimator values went through the no-grad all-gather
