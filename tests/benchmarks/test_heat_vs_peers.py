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
