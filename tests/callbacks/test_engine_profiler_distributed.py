"""EngineProfiler under 2 gloo processes: per-global-rank files, merged summary on rank 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._distributed import run_distributed


def _fit_two_ranks(rank: int, world_size: int, out: str) -> dict:
    import torch
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sdp.callbacks import EngineProfiler
    from lightning_sdp.models.gpt import GPT

    torch.manual_seed(0)
    x = torch.randint(0, 17, (32, 8))
    loader = DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=2)
    model = GPT(vocab_size=17, n_layer=1, n_head=2, n_embd=16, block_size=8, attention="explicit")
    cb = EngineProfiler(wait=1, warmup=1, active=1, dirpath=out, print_summary=False)
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
    return {
        "global_rank": trainer.global_rank,
        "report_rank": cb.reports[0].rank,
        "comm_frac": cb.reports[0].fractions["communication"],
        "merged_ranks": None if cb.merged is None else cb.merged.ranks,
        "matrix_util": cb.reports[0].utilisation["matrix"],
    }


@pytest.mark.slow
def test_per_rank_files_and_merged_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_SDP_CACHE_DIR", str(tmp_path / "cache"))  # measured ceilings: a private cache
    out = tmp_path / "ep"
    results = run_distributed(_fit_two_ranks, 2, str(out), init_group=False, timeout=240)
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
