"""Smoke tests of the HEAT benchmarks' ``--quick`` modes: each trains on small synthetic data and writes its report."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("numba", reason="HEAT's fused backend needs the cpu extra (numba)")

from benchmarks import (
    heat_attention_throughput,
    heat_fused_gap,
    heat_gowalla_quality,
    heat_gowalla_tuning,
    heat_refit,
    heat_temperature,
    heat_throughput,
    heat_trainer_overhead,
)
from benchmarks._common import RESULTS_DIR


def _quick_results(name: str) -> dict:
    return json.loads((RESULTS_DIR / f"{name}_quick.json").read_text())


@pytest.mark.bench
@pytest.mark.slow
def test_throughput_quick_measures_both_backends() -> None:
    heat_throughput.main(["--quick"])
    payload = _quick_results("heat_throughput")
    rows = payload["rows"]
    # the tile-vs-uniform comparison is part of the run: both samplers' final scores and their curves
    assert [r["sampler"] for r in payload["sampler"]] == ["uniform", "tile"]
    assert {c["sampler"] for c in payload["sampler_curve"]} == {"uniform", "tile"}
    assert {r["model"] for r in rows} == {"MF-CCL", "SimpleX"}
    assert all(r["fused"] > 0 and r["reference"] > 0 for r in rows)
    assert all(r["fused/reference"] == pytest.approx(r["fused"] / r["reference"], rel=0.01) for r in rows)


@pytest.mark.bench
def test_gowalla_quality_quick_scores_validation_during_training_and_test_once() -> None:
    heat_gowalla_quality.main(["--quick"])
    results = _quick_results("heat_gowalla_quality")["results"]
    assert {r["model"] for r in results} == {"MF-CCL", "SimpleX"}
    for r in results:
        assert len(r["curve"]) >= 1 and r["curve"][-1]["recall@20"] == r["val_recall@20"]  # the curve is validation
        assert 0.0 < r["recall@20"] <= 1.0 and 0.0 < r["ndcg@20"] <= 1.0  # the test split, scored once after it


@pytest.mark.bench
def test_gowalla_quality_refit_trains_on_everything_and_scores_test_once() -> None:
    heat_gowalla_quality.main(["--quick", "--refit", "--models", "SimpleX", "--aggregator", "user_attention"])
    (result,) = _quick_results("heat_gowalla_quality")["results"]
    assert result["curve"] == [] and result["val_recall@20"] != result["val_recall@20"]  # no validation: NaN
    assert 0.0 < result["recall@20"] <= 1.0


@pytest.mark.bench
def test_gowalla_tuning_quick_scores_the_validation_split() -> None:
    heat_gowalla_tuning.main(["--quick", "quick", "sampler=tile", "tile_size=8", "tile_refresh=64"])
    (run,) = _quick_results("heat_gowalla_tuning")["runs"]
    assert run["split"] == "validation"
    assert (run["sampler"], run["tile_size"], run["tile_refresh"]) == ("tile", 8, 64)
    assert [point["epochs"] for point in run["curve"]] == [1, 2]
    assert 0.0 < run["recall@20"] <= 1.0


@pytest.mark.bench
def test_refit_quick_trains_the_same_epochs_on_both_splits() -> None:
    heat_refit.main(["--quick"])
    held_out, refit = _quick_results("heat_refit")["rows"]
    assert refit["positives"] > held_out["positives"] and refit["epochs"] == held_out["epochs"]
    assert refit["steps"] >= held_out["steps"]  # the same epochs over more positives
    assert all(0.0 < r["test Recall@20"] <= 1.0 for r in (held_out, refit))


@pytest.mark.bench
def test_attention_throughput_quick_compares_the_aggregators_and_the_reference() -> None:
    heat_attention_throughput.main(["--quick"])  # the current code only: nothing is loaded from git
    rows = {r["variant"]: r for r in _quick_results("heat_attention_throughput")["rows"]}
    assert set(rows) == {"mean", "user_attention", "self_attention", "user_attention (reference, b4096)"}
    assert all(r["positives_per_s"] > 0 for r in rows.values())
    base = rows["mean"]["positives_per_s"]  # every row's cost is relative to the mean aggregator's
    assert all(r["cost_vs_mean"] == pytest.approx(base / r["positives_per_s"]) for r in rows.values())
    positives = {round(r["epoch_s"] * r["positives_per_s"]) for r in rows.values()}
    assert len(positives) == 1 and positives.pop() > 0  # one epoch of the same training positives in every row


@pytest.mark.bench
@pytest.mark.slow
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


@pytest.mark.bench
@pytest.mark.slow
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


def test_gowalla_quality_combine_keeps_each_run_with_its_setting_and_command(tmp_path) -> None:
    defaults = vars(heat_gowalla_quality._parser().parse_args([]))
    stored = {
        "run_a": {**defaults, "models": "MF-CCL", "dim": 256, "negatives": 200, "lr": 0.1, "sampler": "tile"},
        "run_b": {**defaults, "models": "SimpleX", "seed": 1, "aggregator_lr_scale": 0.1, "refit": True},
    }
    paths = []
    for stem, args in stored.items():
        row = {"model": args["models"], "epochs": 3, "wall_s": 1.5, "recall@20": 0.1234, "ndcg@20": 0.0987}
        row.update({"published_recall@20": 0.18, "published_ndcg@20": 0.15, "load_avg_1m": 1.0})
        row["curve"] = [{"epochs": 3, "seconds": 1.5, "recall@20": 0.1234, "ndcg@20": 0.0987}]
        if stem == "run_b":
            row["val_recall@20"] = 0.2
        doc = {
            "results": [row],
            "args": {**args, "name": stem},
            "machine": {"cpu": "test cpu", "cores": 2, "torch": "x", "date": stem},
        }
        paths.append(tmp_path / f"{stem}.json")
        paths[-1].write_text(json.dumps(doc))
    heat_gowalla_quality.main(["--combine", *map(str, paths), "--name", "gowalla_quality_combined"])
    combined = json.loads((RESULTS_DIR / "gowalla_quality_combined.json").read_text())
    assert [(r["source"], r["recall@20"], r["ndcg@20"]) for r in combined["results"]] == [
        ("run_a", 0.1234, 0.0987),
        ("run_b", 0.1234, 0.0987),
    ]
    assert "d=256, 200 tile negatives" in combined["results"][0]["setting"]
    assert [s["validation"] for s in combined["sources"]] == [False, True]
    md = (RESULTS_DIR / "gowalla_quality_combined.md").read_text()
    for source, (stem, args) in zip(combined["sources"], stored.items(), strict=True):
        assert f"`{source['command']}`" in md
        repeated = vars(heat_gowalla_quality._parser().parse_args(source["command"].split()[3:]))
        assert {k: repeated[k] for k in args if k not in ("data", "name")} == {
            k: v for k, v in args.items() if k not in ("data", "name")
        }  # the command repeats the run's options
        assert repeated["name"] == stem
    again = heat_gowalla_quality.combine_runs([RESULTS_DIR / "gowalla_quality_combined.json"])
    assert again["results"] == combined["results"] and again["sources"] == combined["sources"]


@pytest.mark.bench
@pytest.mark.slow
def test_fused_gap_quick_scores_every_variant_with_both_losses() -> None:
    heat_fused_gap.main(["--quick", "--seeds", "0"])
    rows = _quick_results("heat_fused_gap")["rows"]
    assert [r["loss"] for r in rows] == ["ccl", "softmax"]
    for row in rows:
        assert all(0.0 < row[v] <= 1.0 for v in heat_fused_gap.VARIANTS)  # every variant learned something
        assert row["2t/1t"] == pytest.approx(row["fused_2t"] / row["fused_1t"])
        assert row["fused_1t_spread"] == 0.0  # one seed


def test_temperature_anneal_moves_the_inverse_temperature_linearly() -> None:
    from types import SimpleNamespace

    from lightning_sdp.models.simplex import SimpleXModule

    model = SimpleXModule(num_users=3, num_items=4, dim=8, loss="softmax", temperature=0.5)
    anneal = heat_temperature.AnnealTemperature(0.2, 0.05, steps=10)
    seen = []
    for step in (0, 5, 10, 20):
        anneal.on_train_batch_start(SimpleNamespace(global_step=step), model, None, 0)  # type: ignore[arg-type]
        seen.append(model.config.temperature)
    assert seen[0] == pytest.approx(0.2) and seen[2] == pytest.approx(0.05) and seen[3] == pytest.approx(0.05)
    assert 1.0 / seen[1] == pytest.approx((1.0 / 0.2 + 1.0 / 0.05) / 2)  # linear in 1/T, not in T
    assert model.config.loss == "softmax" and model.config.dim == 8  # nothing else changed


@pytest.mark.bench
def test_temperature_quick_scores_every_schedule_on_validation() -> None:
    heat_temperature.main(["--quick", "--temperatures", "0.07,0.15", "--anneal", "0.15:0.07"])
    rows = _quick_results("heat_temperature")["rows"]
    assert [(r["temperature"], r["epochs"]) for r in rows] == [
        (label, epochs) for label in ("0.07", "0.15", "0.15->0.07") for epochs in (2.0, 4.0)
    ]
    assert all(0.0 < r["val_recall@20"] <= 1.0 and r["steps"] >= 1 for r in rows)


def test_artifact_benchmark_is_skipped_with_the_reason_when_the_artifact_cannot_be_built(tmp_path) -> None:
    from benchmarks import heat_artifact

    results = heat_artifact.main(["--quick", "--source", str(tmp_path)])  # an empty folder: neither checkout nor git
    assert "neither a checkout" in results["skipped"] and "--source" in results["skipped"]
    assert "Skipped: " in (RESULTS_DIR / "heat_artifact_quick.md").read_text()


def test_artifact_summary_compares_the_three_systems_on_their_median_epochs() -> None:
    from benchmarks import heat_artifact

    rows = [
        {"epoch": 0, "artifact_s": 9.0, "alone_s": 9.0, "trainer_s": 9.0},  # the warm-up epoch is left out
        {"epoch": 1, "artifact_s": 4.0, "alone_s": 1.0, "trainer_s": 1.25},
        {"epoch": 2, "artifact_s": 4.0, "alone_s": 1.0, "trainer_s": 1.25},
    ]
    quality = {"artifact": (0.1, 0.05), "fused_alone": (0.2, 0.1), "fused_trainer": (0.21, 0.11)}
    summary = heat_artifact.summarize(rows, 1000, quality, {2})["summary"]
    assert summary["artifact_pos_per_s"] == 250.0 and summary["fused_trainer_pos_per_s"] == 800.0
    assert summary["trainer_vs_artifact"] == pytest.approx(3.2) and summary["alone_vs_artifact"] == pytest.approx(4.0)
    assert summary["trainer_overhead"] == pytest.approx(0.25)
    assert summary["fused_trainer_recall@20"] == 0.21 and summary["artifact_threads_seen"] == [2]


@pytest.mark.bench
@pytest.mark.slow
def test_artifact_quick_builds_and_runs_where_a_source_is_given() -> None:
    import os

    from benchmarks import heat_artifact

    source = os.environ.get("LIGHTNING_SDP_HEAT_ARTIFACT_SOURCE")
    if not source:
        pytest.skip("set LIGHTNING_SDP_HEAT_ARTIFACT_SOURCE to a checkout or git directory of hipdac-lab/ICS23-HEAT")
    summary = heat_artifact.main(["--quick", "--source", source])["summary"]
    assert summary["epochs"] == 2 and summary["artifact_threads_seen"] == [2]
    assert all(summary[f"{k}_pos_per_s"] > 0 for k in ("artifact", "fused_alone", "fused_trainer"))
    assert all(0 <= summary[f"{k}_recall@20"] <= 1 for k in ("artifact", "fused_alone", "fused_trainer"))


@pytest.mark.bench
@pytest.mark.slow
def test_recipe_candidates_quick_scores_each_change_of_the_anchor_on_validation() -> None:
    from benchmarks import heat_recipe_candidates

    rows = heat_recipe_candidates.main(["--quick"])["rows"]
    assert [r["candidate"] for r in rows] == ["anchor", "svd", "T=0.1", "T=0.15"]  # dense: softmax, temperatures too
    assert all(0 < r["val_recall@20"] <= 1 and r["loss"] == "softmax" for r in rows)
