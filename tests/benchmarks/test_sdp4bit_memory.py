"""``benchmarks/sdp4bit_memory.py``: the bytes it counts and its quick run (2 processes, the small GPT)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.sdp4bit_memory import analytic_bytes, main

pytestmark = pytest.mark.bench


def test_analytic_bytes_per_rank():
    p, w = 1_000, 4
    assert analytic_bytes("ddp", p, w, block=100, replicated=False, padded=p) == 20 * p
    assert analytic_bytes("zero_ddp", p, w, block=100, replicated=False, padded=p) == 12 * p + 2 * p
    assert analytic_bytes("fsdp2", p, w, block=100, replicated=False, padded=p) == 4 * p + 800
    # SDP4Bit: full weights, gradients and flat gradient buffer; fp32 masters and AdamW sharded (padding counted)
    assert analytic_bytes("sdp4bit_qwd_tlq_hs", p, w, block=100, replicated=False, padded=1024) == 12 * p + 3 * 1024
    # with DDP's exchange: as DDP
    assert analytic_bytes("sdp4bit_auto", p, w, block=100, replicated=True, padded=1024) == 20 * p


@pytest.mark.slow
def test_quick_run_measures_every_method_and_shards_the_optimizer_state():
    main(["--quick", "--methods", "ddp", "zero_ddp", "sdp4bit_qwd_tlq_hs", "--name", "sdp4bit_memory_smoke"])
    payload = json.loads(
        (Path(os.environ["LIGHTNING_SDP_RESULTS_DIR"]) / "sdp4bit_memory_smoke_quick.json").read_text()
    )
    assert not [r for r in payload["rows"] if "error" in r]
    table = {row["method"]: row for row in payload["table"]}
    assert set(table) == {"ddp", "zero_ddp", "sdp4bit_qwd_tlq_hs"}
    for row in table.values():
        assert row["peak RSS MiB/rank (max)"] > row["added MiB/rank (peak - start)"] > 0
    # AdamW's state per rank: all of it under DDP, half of it (2 ranks; SDP4Bit pads its shards) when sharded
    assert table["ddp"]["state vs DDP"] == 1.0
    assert table["zero_ddp"]["state vs DDP"] == pytest.approx(0.5, rel=0.01)
    assert table["sdp4bit_qwd_tlq_hs"]["state vs DDP"] == pytest.approx(0.5, rel=0.02)
    assert table["sdp4bit_qwd_tlq_hs"]["fp32 masters MiB/rank"] > 0
