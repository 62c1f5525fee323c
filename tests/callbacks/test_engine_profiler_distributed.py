"""EngineProfiler under 2 gloo processes: rank 0 only by default; with all_ranks, per-global-rank files and the
merged summary on rank 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._distributed import run_distributed


def _fit_two_ranks(rank: int, world_size: int, out: str, all_ranks: bool) -> dict:
    import torch
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sdp.callbacks import EngineProfiler
    from lightning_sdp.models.gpt import GPT

    torch.manual_seed(0)
    x = torch.randint(0, 17, (32, 8))
    loader = DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=2)
    model = GPT(vocab_size=17, n_layer=1, n_head=2, n_embd=16, block_size=8, attention="explicit")
    cb = EngineProfiler(wait=1, warmup=1, active=1, dirpath=out, print_summary=False, all_ranks=all_ranks)
    trainer = Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy="ddp",
        max_steps=3,
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    first = cb.reports[0] if cb.reports else None
    return {
        "global_rank": trainer.global_rank,
        "report_rank": None if first is None else first.rank,
        "comm_frac": None if first is None else first.fractions["communication"],
        "merged_ranks": None if cb.merged is None else cb.merged.ranks,
        "matrix_util": None if first is None else first.utilisation["matrix"],
    }


def _fit_both(rank: int, world_size: int, out: str) -> dict:
    return {
        "all": _fit_two_ranks(rank, world_size, f"{out}/all", all_ranks=True),
        "zero": _fit_two_ranks(rank, world_size, f"{out}/zero", all_ranks=False),
    }


@pytest.mark.slow
def test_per_rank_files_and_merged_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_SDP_CACHE_DIR", str(tmp_path / "cache"))  # measured ceilings: a private cache
    out = tmp_path / "ep"
    both = run_distributed(_fit_both, 2, str(out), init_group=False, timeout=240)
    # default: rank 0 alone profiles and writes; rank 1 does nothing
    zero = [r["zero"] for r in both]
    assert zero[0]["report_rank"] == 0 and zero[1]["report_rank"] is None
    assert zero[0]["merged_ranks"] == [0] and zero[1]["merged_ranks"] is None
    assert sorted(p.name for p in (out / "zero").iterdir() if "rank1" in p.name) == []
    assert (out / "zero" / "engine_profile-rank0.json").is_file()
    results = [r["all"] for r in both]
    out = out / "all"
    assert [r["global_rank"] for r in results] == [0, 1]
    assert [r["report_rank"] for r in results] == [0, 1]
    # DDP's gradient all-reduce shows up as communication.
    assert all(r["comm_frac"] > 0 for r in results)
    assert results[0]["merged_ranks"] == [0, 1]
    assert results[1]["merged_ranks"] is None
    # Each rank measured (or read from the cache) the CPU's ceilings: utilisation is reported, not n/a.
    assert all(r["matrix_util"] > 0 for r in results)
    for rank in (0, 1):
        assert (out / f"engine_profile-rank{rank}.json").is_file()
        assert (out / f"engine_profile-rank{rank}-window0.pt.trace.json.gz").is_file()
    summary = json.loads(Path(out / "engine_profile-summary.json").read_text())
    assert summary["world_size"] == 2 and set(summary["step_time_s"]) == {"0", "1"}
