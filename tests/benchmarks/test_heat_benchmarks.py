"""Smoke tests of the HEAT benchmarks' ``--quick`` modes: each trains on small synthetic data and writes its report."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("numba", reason="HEAT's fused backend needs the cpu extra (numba)")

from benchmarks import (
    heat_attention_throughput,
    heat_gowalla_quality,
    heat_gowalla_tuning,
    heat_refit,
    heat_throughput,
    heat_trainer_overhead,
)
from benchmarks._common import RESULTS_DIR


def _quick_results(name: str) -> dict:
    return json.loads((RESULTS_DIR / f"{name}_quick.json").read_text())


def test_throughput_quick_measures_both_backends() -> None:
    heat_throughput.main(["--quick"])
    rows = _quick_results("heat_throughput")["rows"]
    assert {r["model"] for r in rows} == {"MF-CCL", "SimpleX"}
    assert all(r["fused"] > 0 and r["reference"] > 0 for r in rows)
    assert all(r["fused/reference"] == pytest.approx(r["fused"] / r["reference"], rel=0.01) for r in rows)


def test_gowalla_quality_quick_scores_validation_during_training_and_test_once() -> None:
    heat_gowalla_quality.main(["--quick"])
    results = _quick_results("heat_gowalla_quality")["results"]
    assert {r["model"] for r in results} == {"MF-CCL", "SimpleX"}
    for r in results:
        assert len(r["curve"]) >= 1 and r["curve"][-1]["recall@20"] == r["val_recall@20"]  # the curve is validation
        assert 0.0 < r["recall@20"] <= 1.0 and 0.0 < r["ndcg@20"] <= 1.0  # the test split, scored once after it


def test_gowalla_quality_refit_trains_on_everything_and_scores_test_once() -> None:
    heat_gowalla_quality.main(["--quick", "--refit", "--models", "SimpleX", "--aggregator", "user_attention"])
    (result,) = _quick_results("heat_gowalla_quality")["results"]
    assert result["curve"] == [] and result["val_recall@20"] != result["val_recall@20"]  # no validation: NaN
    assert 0.0 < result["recall@20"] <= 1.0


def test_gowalla_tuning_quick_scores_the_validation_split() -> None:
    heat_gowalla_tuning.main(["--quick", "quick", "sampler=tile", "tile_size=8", "tile_refresh=64"])
    (run,) = _quick_results("heat_gowalla_tuning")["runs"]
    assert run["split"] == "validation"
    assert (run["sampler"], run["tile_size"], run["tile_refresh"]) == ("tile", 8, 64)
    assert [point["epochs"] for point in run["curve"]] == [1, 2]
    assert 0.0 < run["recall@20"] <= 1.0


def test_refit_quick_trains_the_same_epochs_on_both_splits() -> None:
    heat_refit.main(["--quick"])
    held_out, refit = _quick_results("heat_refit")["rows"]
    assert refit["positives"] > held_out["positives"] and refit["epochs"] == held_out["epochs"]
    assert refit["steps"] >= held_out["steps"]  # the same epochs over more positives
    assert all(0.0 < r["test Recall@20"] <= 1.0 for r in (held_out, refit))


def test_attention_throughput_quick_compares_the_aggregators_and_the_reference() -> None:
    heat_attention_throughput.main(["--quick"])  # without the historical kernel (its compilation alone takes ~40 s)
    rows = {r["variant"]: r for r in _quick_results("heat_attention_throughput")["rows"]}
    assert set(rows) == {"mean", "user_attention", "self_attention", "user_attention (reference, b4096)"}
    assert all(r["positives_per_s"] > 0 for r in rows.values())
    base = rows["user_attention"]["positives_per_s"]  # every row's speed-up is relative to today's attention kernel
    assert all(r["batched_keys_speedup"] == pytest.approx(base / r["positives_per_s"]) for r in rows.values())
    positives = {round(r["epoch_s"] * r["positives_per_s"]) for r in rows.values()}
    assert len(positives) == 1 and positives.pop() > 0  # one epoch of the same training positives in every row


def test_budget_curves_quick_scores_each_configuration_on_validation_only() -> None:
    pytest.importorskip("threadpoolctl", reason="the benchmark limits BLAS threads with threadpoolctl")
    from benchmarks import heat_budget_curves

    results = heat_budget_curves.main(["--quick"])
    rows = results["rows"]
    assert [r["config"] for r in rows] == [heat_budget_curves._label(c) for c in results["configs"]]
    assert len(rows) == 2 and results["configs"][1]["dim"] == 64  # the anchor, then the cheap anchor
    for row in rows:
        assert all(0.0 <= row[key] <= 1.0 for key in ("val@5", "val@10", "val_final"))
        assert row["final_steps"] >= 1


def test_trainer_overhead_quick_measures_the_kernel_and_each_fit_variant() -> None:
    heat_trainer_overhead.main(["--quick"])
    payload = _quick_results("heat_trainer_overhead")
    rows = {r["variant"]: r for r in payload["rows"]}
    assert set(rows) == {"kernel", "trainer", "trainer_log_every_step", "trainer_torch_gather", "trainer_before"}
    assert all(r["positives_per_s"] > 0 for r in rows.values())
    assert rows["trainer"]["vs_trainer"] == 1.0
    assert all(
        r["ms_per_step"] == pytest.approx(1e3 * payload["batch_size"] / r["positives_per_s"]) for r in rows.values()
    )
