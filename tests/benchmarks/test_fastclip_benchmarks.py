"""The FastCLIP benchmarks run as modules (``python -m benchmarks.<name> --quick``) and write their results (into the
temporary results folder that ``tests/benchmarks/conftest.py`` sets)."""

from __future__ import annotations

import ast
import json
import math
import os
from pathlib import Path

import pytest
import torch

from benchmarks._common import RESULTS_DIR
from benchmarks.fastclip_u_diagnostic import merge_payloads
from benchmarks.tools.fastclip import UDiagnosticProbe, estimate_stats, rare_term_stats
from lightning_sdp.integrations.open_clip import NANO_CONFIG
from tests._warm_python import run_python

REPO = Path(__file__).resolve().parents[2]
NAMES = (
    "fastclip_small_batch",
    "fastclip_small_batch_10k",
    "fastclip_u_diagnostic",
    "fastclip_many_visits",
    "fastclip_batch_gap",
)


def _run_quick(name: str) -> dict:
    assert RESULTS_DIR != REPO / "benchmarks" / "results"  # conftest points the results at a temporary folder
    out = RESULTS_DIR / f"{name}_quick.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_python(["-m", f"benchmarks.{name}", "--quick"], cwd=REPO, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (RESULTS_DIR / f"{name}_quick.md").is_file()
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", NAMES)
def test_benchmark_source_needs_no_path_edits_and_no_private_package_names(name):
    source = (REPO / "benchmarks" / f"{name}.py").read_text()
    assert "sys.path" not in source and "noqa: E402" not in source
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_sdp"):
            private = [a.name for a in node.names if a.name.startswith("_")]
            assert not private and "._" not in node.module, f"{name} imports {node.module}: {private}"


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.open_clip
def test_small_batch_quick_trains_both_losses_and_counts_fewer_fastclip_loss_bytes():
    payload = _run_quick("fastclip_small_batch")
    assert payload["bench_model"] == NANO_CONFIG
    assert sorted(r["loss"] for r in payload["runs"]) == ["fastclip_v3", "openclip"]
    assert all(0.0 <= r["zeroshot_top1"] <= 1.0 and r["steps"] >= 1 for r in payload["runs"])
    comm = {r["reduction"]: r for r in payload["comm"]}
    # FastCLIP gathers features once without gradients; OpenCLIP also sends the feature gradients back
    assert 0 < comm["fastclip_v3"]["loss_bytes_per_step"] < comm["openclip"]["loss_bytes_per_step"]


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.open_clip
def test_small_batch_10k_quick_reports_the_u_diagnostic_every_epoch():
    payload = _run_quick("fastclip_small_batch_10k")
    assert payload["complete"] and payload["bench_model"] == NANO_CONFIG
    v3 = next(r for r in payload["runs"] if r["loss"] == "fastclip_v3")
    assert [p["epoch"] for p in v3["u_probe"]] == list(range(payload["args"]["epochs"]))
    assert all(p["u_rel_err_median"] >= 0 for p in v3["u_probe"])
    assert next(r for r in payload["runs"] if r["loss"] == "openclip")["u_probe"] == []


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.open_clip
def test_batch_gap_quick_runs_the_four_configurations_and_the_gap_table():
    payload = _run_quick("fastclip_batch_gap")
    assert payload["complete"]
    assert sorted(r["label"] for r in payload["runs"]) == sorted(
        ["openclip_large", "openclip_small", "fastclip_v3_small", "siglip_small"]
    )
    large = next(r for r in payload["runs"] if r["label"] == "openclip_large")
    small = next(r for r in payload["runs"] if r["label"] == "openclip_small")
    assert large["batch"] == 4 * small["batch"] and large["lr"] == pytest.approx(2 * small["lr"])  # sqrt scaling
    assert {(g["metric"], g["peer"]) for g in payload["gap"]} == {
        (m, p) for m in ("zeroshot_top1", "retrieval_r1") for p in ("fastclip_v3_small", "siglip_small")
    }
    assert "zeroshot_top1" in payload["verdict"]


def test_batch_gap_closed_share_and_verdict_on_made_up_runs():
    from benchmarks.fastclip_batch_gap import gap_analysis, verdict

    def run(label, seed, top1):
        return {"label": label, "seed": seed, "zeroshot_top1": top1 / 100}

    runs = [run("openclip_large", s, 40 + s) for s in range(3)] + [run("openclip_small", s, 30 + s) for s in range(3)]
    runs += [run("fastclip_v3_small", s, 35 + s) for s in range(3)]
    (row,) = gap_analysis(runs, "zeroshot_top1", ["fastclip_v3_small"])
    assert row["gap"] == pytest.approx(10) and row["gap_std"] == pytest.approx(0)
    assert row["seed_spread"] == pytest.approx(1) and row["gap_beyond_spread"]
    assert row["closed"] == pytest.approx(0.5) and row["closed_per_seed"] == [0.5, 0.5, 0.5]
    assert "closes 50 %" in verdict([row])
    tied = [run("openclip_large", s, 30 + 3 * s) for s in range(3)] + [run("openclip_small", s, 31) for s in range(3)]
    (row,) = gap_analysis([*tied, *runs[6:]], "zeroshot_top1", ["fastclip_v3_small"])
    assert not row["gap_beyond_spread"] and "cannot show the claim" in verdict([row])


def test_estimate_stats_gives_the_sign_of_the_bias():
    g = torch.tensor([1.0, 2.0, 0.5, 4.0])
    high = estimate_stats(2 * g, g)
    assert high["rel_err"] == pytest.approx(1.0) and high["above"] == 1.0
    assert high["log_ratio"] == pytest.approx(math.log(2))
    low = estimate_stats(g / 4, g)
    assert low["rel_err"] == pytest.approx(0.75) and low["above"] == 0.0
    assert low["log_ratio"] == pytest.approx(-math.log(4))


def test_rare_term_stats_one_dominant_negative_vs_uniform():
    n, batch = 101, 11  # 100 negatives, 10 per mini-batch
    dominant = torch.full((1, n), 1e-6)
    dominant[0, 7] = 1.0
    dominant[0, 0] = 0.0  # the anchor's own column
    out = rare_term_stats(dominant, batch)
    assert out["top1_share"] > 0.99 and out["k50"] == 1
    assert out["p_batch_has_k50"] == pytest.approx(10 / 100)  # a batch holds that one negative 10 % of the time
    uniform = torch.ones(1, n)
    uniform[0, 0] = 0.0
    out = rare_term_stats(uniform, batch)
    assert out["k50"] == 50 and out["topb_share"] == pytest.approx(0.1)
    assert out["p_batch_has_k50"] == pytest.approx(1 - math.comb(50, 10) / math.comb(100, 10))


@pytest.mark.slow
@pytest.mark.open_clip
def test_u_probe_with_lr_zero_and_full_batch_has_no_estimation_error_and_no_drift():
    import lightning.pytorch as pl

    from lightning_sdp.callbacks import GammaScheduler
    from lightning_sdp.datamodules import ImageTextDataModule
    from lightning_sdp.models import FastCLIPModule

    pl.seed_everything(0, verbose=False)
    n = 24  # one batch of every pair per epoch: the batch's g is the full-data g
    dm = ImageTextDataModule(dataset="scenes", model=NANO_CONFIG, batch_size=n, num_train=n, num_val=8, augment=False)
    module = FastCLIPModule(model=NANO_CONFIG, loss="sogclr", lr=0.0, weight_decay=0.0, warmup_steps=1, max_steps=3)
    anchors = torch.tensor([0, 5, 11, 23])
    probe = UDiagnosticProbe(anchors, batch_size=n, probes_per_epoch=1)
    gamma = GammaScheduler(gamma_min=0.5, decay_epochs=1)
    trainer = pl.Trainer(
        max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[gamma, probe],
    )  # fmt: skip
    trainer.fit(module, dm)
    summary = probe.visit_summary()
    assert [v["visits"] for v in summary] == [2 * len(anchors)] * 3 and summary[-1]["gamma"] == 0.5
    for v in summary:
        assert v["u_new_vs_g_then"]["rel_err"] < 1e-5 and v["probe_vs_training_u_rel_diff"] < 1e-5
    assert summary[-1]["drift_prev_over_then"] == pytest.approx(1.0, abs=1e-6)
    # g never moves and the batch is the data: no sampling error and no staleness in the decomposition either
    assert summary[-1]["u_if_g_still"]["rel_err"] < 1e-6 and abs(summary[-1]["staleness_log_factor"]) < 1e-5
    assert summary[-1]["gap_steps_median"] == 1
    last = probe.probes[-1]
    assert last["proper"]["rel_err"] < 1e-5 and last["total"]["rel_err"] < 1e-5
    assert last["age_median"] == 1  # one optimizer step since the update
    assert last["drift_then_over_now"] == pytest.approx(1.0, abs=1e-6)
    # an estimator twice too large reads as a positive signed bias against both g now and g at the update
    module.gcl_loss.u1.mul_(2.0)
    module.gcl_loss.u2.mul_(2.0)
    probe._probe(trainer, module, 1.0)
    assert probe.probes[-1]["total"]["log_ratio"] == pytest.approx(math.log(2), abs=1e-5)
    assert probe.probes[-1]["proper"]["above"] == 1.0


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.open_clip
def test_u_diagnostic_quick_probes_several_times_per_epoch_and_matches_training():
    payload = _run_quick("fastclip_u_diagnostic")
    assert payload["complete"] and payload["bench_model"] == NANO_CONFIG
    (run,) = payload["runs"]
    a = payload["args"]
    assert [p["epoch"] for p in run["probes"]] == [
        e + (q + 1) / a["probes_per_epoch"] for e in range(a["epochs"]) for q in range(a["probes_per_epoch"])
    ]
    assert [v["epoch"] for v in run["visit_summary"]] == list(range(a["epochs"]))
    # the update predicted from the probe's mini-batch g is the one the loss made (same embeddings, tau, negatives)
    assert all(v["probe_vs_training_u_rel_diff"] < 1e-4 for v in run["visit_summary"])
    later = run["visit_summary"][-1]
    assert later["revisits"] > 0 and later["drift_prev_over_then"] > 0
    assert later["u_if_g_still"]["rel_err"] >= 0 and math.isfinite(later["staleness_log_factor"])
    for p in run["probes"]:
        assert 0 < p["rare"]["topb_share"] <= 1 and 0 <= p["rare"]["p_batch_has_k50"] <= 1
        assert p["total"]["rel_err"] >= 0 and p["age_median"] >= 0


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.open_clip
def test_many_visits_quick_visits_every_sample_each_epoch_and_reports_u_against_visits():
    payload = _run_quick("fastclip_many_visits")
    a = payload["args"]
    assert payload["complete"] and payload["bench_model"] == NANO_CONFIG
    assert sorted(r["loss"] for r in payload["runs"]) == ["fastclip_v3", "openclip"]
    v3 = next(r for r in payload["runs"] if r["loss"] == "fastclip_v3")
    assert v3["steps"] == a["epochs"] * (a["num_train"] // 16)
    # the end-of-epoch curve: one row per visit; the per-visit probe: every anchor seen once per epoch
    assert [r["visits"] for r in payload["probe"] if r["loss"] == "fastclip_v3"] == [1, 2, 3]
    assert [r["visit"] for r in payload["visit_curve"]] == [1, 2, 3]
    assert all(r["visits_seen"] == 2 * a["visit_probe_anchors"] for r in payload["visit_curve"])
    assert all(v["probe_vs_training_u_rel_diff"] < 1e-4 for v in v3["visit_summary"])
    (cmp,) = payload["comparisons"]
    assert cmp["peer"] == "openclip" and cmp["v3_minus_peer"] == pytest.approx(
        100 * (v3["zeroshot_top1"] - next(r for r in payload["runs"] if r["loss"] == "openclip")["zeroshot_top1"])
    )
    md = (RESULTS_DIR / "fastclip_many_visits_quick.md").read_text()
    assert (
        "every sample visited 3 times" in md and not (RESULTS_DIR / "fastclip_many_visits_quick.partial.json").exists()
    )


def _stored(labels: list[str], top1: float, **args) -> dict:
    base = {"dataset": "scenes", "num_train": 64, "num_val": 8, "data_seed": 0, "epochs": 2, "lr": 1e-3,
            "temperature": 0.07, "lr_tau": 1e-4, "rho": 6.5, "name": "x", "runs": ""}  # fmt: skip
    runs = [
        {"label": lab, "zeroshot_top1": top1 + i, "retrieval_r1": 0.1, "final_tau": 0.05, "steps": 4, "probes": [i]}
        for i, lab in enumerate(labels)
    ]
    return {"args": {**base, **args}, "runs": runs, "total_wall_s": 60.0, "complete": True, "machine": {"date": "d"}}


def test_u_diagnostic_merge_keeps_numbers_replaces_same_runs_and_refuses_unlike_ones():
    main = _stored(["a", "b", "c"], 0.3)
    rerun = _stored(["b", "d"], 0.3)
    # the same run "b" again (same scores), with more columns
    rerun["runs"][0].update(zeroshot_top1=main["runs"][1]["zeroshot_top1"], probes=["more columns"])
    merged = merge_payloads([("main.json", main), ("rerun.json", rerun)], "fastclip_u_diagnostic")
    assert [r["label"] for r in merged["runs"]] == ["a", "b", "c", "d"]
    assert merged["runs"][1]["probes"] == ["more columns"] and merged["runs"][0] == main["runs"][0]
    assert merged["total_wall_s"] == 120.0 and merged["planned_runs"] == 4 and merged["complete"]
    assert [m["file"] for m in merged["merged_from"]] == ["main.json", "rerun.json"]
    assert merged["args"]["name"] == "fastclip_u_diagnostic" and merged["machine"] == main["machine"]
    other = _stored(["b"], 0.9)  # same label, other scores: not the same run
    with pytest.raises(ValueError, match="other scores"):
        merge_payloads([("main.json", main), ("other.json", other)], "m")
    with pytest.raises(ValueError, match="other settings.*epochs"):
        merge_payloads([("main.json", main), ("long.json", _stored(["e"], 0.3, epochs=9))], "m")
