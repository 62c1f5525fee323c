"""Smoke test of benchmarks/heat_vs_peers.py --quick: HEAT and every installed peer score, missing peers say why."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("numba", reason="HEAT's fused backend needs the cpu extra (numba)")
pytest.importorskip("threadpoolctl", reason="the benchmark limits BLAS threads with threadpoolctl")

from benchmarks import heat_vs_peers as hvp


def test_quick_run_scores_heat_and_installed_peers() -> None:
    results = hvp.main(["--quick"])
    rows = {r["method"]: r for r in results["datasets"]["synthetic_quick"]["methods"]}
    assert set(rows) == set(hvp.DEFAULT_METHODS)
    for method in ("heat", "heat_budget"):
        assert [p["budget_s"] for p in rows[method]["curve"]] == results["args"]["budgets"]
        assert all(0.0 < p["recall@20"] <= 1.0 for p in rows[method]["curve"])
    assert all(p["final_lr"] == 0.0 for p in rows["heat"]["curve"])  # every HEAT run ended decayed
    for method, package in hvp.PEER_PACKAGES.items():
        if method not in rows:
            continue
        if importlib.util.find_spec(package) is None:
            assert package in rows[method]["missing"]
        else:
            assert "missing" not in rows[method]
            assert len(rows[method]["trials"]) == results["args"]["configs"]
            assert all(0.0 <= p["recall@20"] <= 1.0 for p in rows[method]["curve"])
    assert (hvp.RESULTS_DIR / "heat_vs_peers_quick.md").exists()


def test_at_budget_takes_the_last_point_inside_the_budget() -> None:
    curve = [{"train_s": 1.0, "recall@20": 0.1}, {"train_s": 2.0, "recall@20": 0.2}, {"train_s": 5.0, "recall@20": 0.3}]
    assert hvp.at_budget(curve, 3.0)["recall@20"] == 0.2
    assert hvp.at_budget(curve, 0.5) is None


def test_refit_split_trains_on_train_and_validation() -> None:
    split = hvp.load_split("synthetic", "", 0.2, quick=True)
    refit = split.refit()
    assert refit.train is split.full_train and refit.test is split.test and refit.val is split.val
    assert len(refit.train_users) == len(split.full_train[1]) > len(split.train_users)
    assert refit.matrix().nnz == len(split.full_train[1])
    assert split.matrix().nnz == len(split.train[1])  # the tuning split is left as it was


def test_quick_refit_run_trains_the_budgeted_recipe_on_everything() -> None:
    results = hvp.main(["--quick", "--refit", "--methods", "heat_budget", "--name", "heat_vs_peers_refit"])
    (row,) = results["datasets"]["synthetic_quick"]["methods"]
    split = hvp.load_split("synthetic", "", results["args"]["val_fraction"], quick=True)
    assert all(p["refit"] and p["train_positives"] == len(split.full_train[1]) for p in row["curve"])
    assert "validation folded back in" in (hvp.RESULTS_DIR / "heat_vs_peers_refit_quick.md").read_text()
