"""sequence_length_sweep and its command line on a tiny GPT."""

from __future__ import annotations

import json

import pytest

from lightning_sdp.callbacks.engine_profiler.sweep import gpt_factory, main, sequence_length_sweep, sweep_markdown

PEAKS = {"matrix_tflops": 0.05, "vector_tflops": 0.002, "mem_gbps": 10.0}


@pytest.mark.slow
def test_sweep_rows_have_shares_and_analytic_prediction(tmp_path):
    rows = sequence_length_sweep(
        gpt_factory(vocab_size=23, n_layer=1, n_head=2, n_embd=16),
        seq_lens=(8, 32),
        batch_size=2,
        attentions=("explicit", "sdpa", "linear"),
        steps=1,
        wait=0,
        vocab_size=23,
        accelerator="cpu",
        peaks=PEAKS,
        dirpath=str(tmp_path),
        verbose=False,
    )
    assert [(r["attention"], r["seq_len"]) for r in rows] == [
        ("explicit", 8),
        ("explicit", 32),
        ("sdpa", 8),
        ("sdpa", 32),
        ("linear", 8),
        ("linear", 32),
    ]
    for r in rows:
        total = sum(r[c] for c in ("matrix", "attention_fused", "vector", "memory", "host_other"))
        assert total == pytest.approx(1.0, abs=1e-6)  # communication is 0 on one process
        assert r["total_tflops"] > 0
    explicit = [r for r in rows if r["attention"] == "explicit"]
    fused = [r for r in rows if r["attention"] == "sdpa"]
    # The analytic attention share grows with n; fused attention is predicted to have no softmax vector work.
    assert explicit[1]["pred_attn_share"] > explicit[0]["pred_attn_share"]
    assert all(r["pred_vector_share"] == 0.0 for r in fused)
    assert all(r["attention_fused"] > 0 for r in fused)
    assert all(r["attention_fused"] == 0 for r in explicit)
    assert all(r["pred_attn_share"] is None for r in rows if r["attention"] == "linear")
    assert "| explicit | 8 |" in sweep_markdown(rows)


@pytest.mark.slow
def test_cli_writes_outputs(tmp_path, capsys):
    code = main(
        [
            "--seq-lens",
            "8",
            "--attention",
            "sdpa",
            "--n-layer",
            "1",
            "--n-head",
            "2",
            "--n-embd",
            "16",
            "--batch-size",
            "2",
            "--steps",
            "1",
            "--accelerator",
            "cpu",
            "--no-calibrate",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert rows[0]["attention"] == "sdpa" and rows[0]["seq_len"] == 8
    assert (tmp_path / "sweep.png").stat().st_size > 0
    assert "| sdpa | 8 |" in capsys.readouterr().out


def test_bad_arguments():
    with pytest.raises(ValueError, match="seq_lens"):
        sequence_length_sweep(seq_lens=(0,), verbose=False)
    with pytest.raises(ValueError, match="attention"):
        sequence_length_sweep(seq_lens=(8,), attentions=(), verbose=False)


def test_sweep_markdown_prints_rates_in_a_readable_unit() -> None:
    row = {"attention": "sdpa", "seq_len": 8, "matrix_tflops": 319.4355, "total_tflops": 0.01234}
    table = sweep_markdown([row])
    assert "319.4 TFLOP/s" in table and "12.34 GFLOP/s" in table
