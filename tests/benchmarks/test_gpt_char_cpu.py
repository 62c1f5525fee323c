"""``python -m benchmarks.gpt_char_cpu --quick``: the character GPT's validation curve and attention throughputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks._common import RESULTS_DIR
from tests._warm_python import run_python

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.bench
def test_quick_run_writes_a_falling_curve_and_three_attention_rows():
    res = run_python(
        ["-m", "benchmarks.gpt_char_cpu", "--quick", "--data", "/nonexistent/input.txt"], cwd=REPO, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "using the built-in corpus" in res.stdout
    payload = json.loads((RESULTS_DIR / "gpt_char_cpu_quick.json").read_text())
    curve = payload["curve"]
    assert [r["step"] for r in curve] == [10, 20]
    assert curve[-1]["val_loss"] < curve[0]["val_loss"]
    assert payload["model"] == {"n_layer": 2, "n_head": 2, "n_embd": 64}
    rows = payload["attention_throughput"]
    assert [r["attention"] for r in rows] == ["sdpa", "explicit", "linear"]
    assert all(r["train_tokens_per_s"] > 0 for r in rows) and rows[0]["vs_sdpa"] == 1.0
