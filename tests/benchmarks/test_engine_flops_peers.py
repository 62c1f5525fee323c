"""Smoke test of benchmarks/engine_flops_peers.py on a tiny GPT ."""

import argparse

import pytest

pytest.importorskip("fvcore", reason="the bench extra (fvcore) is not installed")

from benchmarks import engine_flops_peers as efp


def _args() -> argparse.Namespace:
    return argparse.Namespace(gpt_layers=1, gpt_width=32, gpt_heads=2, batch_size=1)


def test_explicit_gpt_forward_flops_equal_twice_fvcore_macs() -> None:
    row = efp.count_case(efp._gpt_case(16, "explicit", _args()))
    assert row["ep_fwd"]["flops"] == 2 * row["fvcore"]["matrix_macs"]
    assert row["residuals"]["fvcore_matrix"] == 0


def test_fused_gpt_difference_is_exactly_the_fused_attention() -> None:
    row = efp.count_case(efp._gpt_case(16, "sdpa", _args()))
    ep = row["ep_fwd"]
    assert ep["attention_flops"] > 0
    assert ep["matrix_flops"] == 2 * row["fvcore"]["matrix_macs"]  # fvcore skips the fused kernel
    assert ep["flops"] - 2 * row["fvcore"]["matrix_macs"] == ep["attention_flops"]


@pytest.mark.bench
@pytest.mark.slow
def test_quick_mode_writes_the_table_and_the_callback_check_agrees() -> None:
    import json

    from benchmarks._common import RESULTS_DIR

    efp.main(["--quick"])
    payload = json.loads((RESULTS_DIR / "engine_flops_peers_quick.json").read_text())
    assert any(row["model"].startswith("resnet18") for row in payload["rows"])
    assert payload["callback_check"]["equal"] is True
    met, total = (int(x) for x in payload["targets_met"].split("/"))
    assert total >= 1 and met == total
