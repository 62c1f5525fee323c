"""Smoke test of benchmarks/heat_vs_peers.py --quick: HEAT and every installed peer score, missing peers say why."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("numba", reason="HEAT's fused backend needs the cpu extra (numba)")
pytest.importorskip("threadpoolctl", reason="the benchmark limits BLAS threads with threadpoolctl")

from benchmarks import heat_vs_peers as hvp


@pytest.mark.bench
@pytest.mark.slow
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


@pytest.mark.bench
def test_quick_refit_run_trains_the_budgeted_recipe_on_everything() -> None:
    results = hvp.main(["--quick", "--refit", "--methods", "heat_budget", "--name", "heat_vs_peers_refit"])
    (row,) = results["datasets"]["synthetic_quick"]["methods"]
    split = hvp.load_split("synthetic", "", results["args"]["val_fraction"], quick=True)
    assert all(p["refit"] and p["train_positives"] == len(split.full_train[1]) for p in row["curve"])
    assert "validation folded back in" in (hvp.RESULTS_DIR / "heat_vs_peers_refit_quick.md").read_text()


def _stored_run(name: str, dataset: str, budgets: list[float], refit: bool, rows: dict[str, list], merged=()) -> dict:
    """A results document as ``main`` writes it: ``rows`` maps a method to its test points; ``merged`` lists the
    methods of runs added with ``--merge`` (their rows carry the run index)."""
    args = {"dataset": dataset, "methods": "als,heat_budget", "budgets": budgets, "refit": refit, "name": name}
    args.update(seed=0, configs=3, trial_seconds=8.0, threads=2, val_fraction=0.1)
    machine = {"cpu": "test cpu", "cores": 2, "torch": "x", "date": f"{name} date", "load_avg_1m": 1.0}
    methods = []
    for method, points in rows.items():
        curve = [{"train_s": t, "recall@20": r, "ndcg@20": n, "eval_s": 1.0, **extra} for t, r, n, extra in points]
        row = {"method": method, "config": {"dim": 8}, "trials": [], "curve": curve}
        methods.append({**row, "run": 1} if method in merged else row)
    doc = {"args": args, "methods": list(rows), "machine": machine, "datasets": {dataset: {"split": {}}}}
    doc["datasets"][dataset]["methods"] = methods
    if merged:
        doc["runs"] = [{"machine": machine, "methods": list(rows)}, {"machine": machine, "methods": list(merged)}]
    return doc


def test_merge_runs_puts_stored_runs_side_by_side_with_their_numbers_and_commands() -> None:
    import json

    runs = {
        "m_short": _stored_run(
            "m_short",
            "gowalla",
            [30.0, 60.0],
            True,
            {
                "als": [(5.0, 0.15, 0.12, {}), (29.0, 0.1638, 0.1365, {}), (59.0, 0.1637, 0.1364, {})],
                "heat_budget": [(29.0, 0.1716, 0.1376, {"budget_s": 30.0}), (59.0, 0.1746, 0.1402, {"budget_s": 60.0})],
            },
            merged=("heat_budget",),
        ),
        "m_long": _stored_run(
            "m_long", "gowalla", [600.0], True, {"heat_budget": [(591.0, 0.1850, 0.1499, {"budget_s": 600.0})]}
        ),
        "m_fresh": _stored_run(
            "m_fresh", "synthetic_fresh", [30.0], False, {"heat_budget": [(29.6, 0.4643, 0.3429, {"budget_s": 30.0})]}
        ),
    }
    for stem, doc in runs.items():
        (hvp.RESULTS_DIR / f"{stem}.json").write_text(json.dumps(doc))
    merged = hvp.main(["--merge-runs", *runs, "--name", "m_merged"])

    gowalla = {r["method"]: r for r in merged["datasets"]["gowalla"]["methods"]}
    assert merged["datasets"]["gowalla"]["refit"] and not merged["datasets"]["synthetic_fresh"]["refit"]
    recipe = gowalla["heat_budget"]["curve"]
    assert [(p["budget_s"], p["recall@20"], p["source"], p["run"]) for p in recipe] == [
        (30.0, 0.1716, "m_short", 1),
        (60.0, 0.1746, "m_short", 1),
        (600.0, 0.1850, "m_long", 0),
    ]
    assert [p["recall@20"] for p in gowalla["als"]["curve"]] == [0.15, 0.1638, 0.1637]  # numbers unchanged
    commands = [c for source in merged["merged_from"] for c in source["commands"]]
    assert len(commands) == 4 and commands[1].endswith("--name m_short --merge") and "--refit" in commands[2]
    assert "--refit" not in commands[3] and "--dataset synthetic_fresh" in commands[3]

    md = (hvp.RESULTS_DIR / "m_merged.md").read_text()
    assert all(f"`{c}`" in md for c in commands)
    assert '| heat_budget | {"dim": 8} | 0.1716 / 0.1376 | 0.1746 / 0.1402 | 0.1850 / 0.1499 |' in md
    assert '| als | {"dim": 8} | 0.1638 / 0.1365 | 0.1637 / 0.1364 |  |' in md  # ALS did not run to 600 s
    assert "## synthetic_fresh (held out)" in md and (hvp.RESULTS_DIR / "m_merged.png").exists()

    # a merged file merges again (its sources carried over); overlapping or mixed-protocol runs are refused
    again = hvp.merge_runs(["m_merged"])
    assert again["merged_from"] == merged["merged_from"]
    assert again["datasets"]["gowalla"]["methods"] == merged["datasets"]["gowalla"]["methods"]
    with pytest.raises(ValueError, match="same budgets"):
        hvp.merge_runs(["m_short", "m_long", "m_long"])
    with pytest.raises(ValueError, match="same budgets"):
        hvp.merge_runs(["m_short", "m_short"])  # ALS's curve, from two runs
    held_out = _stored_run(
        "m_held", "gowalla", [1800.0], False, {"heat_budget": [(1.0, 0.1, 0.1, {"budget_s": 1800.0})]}
    )
    (hvp.RESULTS_DIR / "m_held.json").write_text(json.dumps(held_out))
    with pytest.raises(ValueError, match="another protocol"):
        hvp.merge_runs(["m_short", "m_held"])


def test_suite_catalogues_split_with_their_stated_shape_and_keep_the_aside_out() -> None:
    from benchmarks.tools.catalogues import ASIDE, CATALOGUES, SUITE

    assert not set(ASIDE) & set(SUITE) and set(CATALOGUES) <= set(hvp.DATASETS)
    densities = []
    for name in ("suite_very_dense", "suite_dense"):
        split = hvp.load_split(name, "", 0.1, quick=False)
        assert split is not None and split.name == name
        info = split.describe()
        assert (info["users"], info["items"]) == (CATALOGUES[name].users, CATALOGUES[name].items)
        assert info["val"] > 0 and info["test"] > 0
        densities.append(info["density"])
    assert densities[0] > densities[1]  # the suite spans density
    # `--dataset suite` never includes the catalogue kept aside for the final, single scoring
    seen: list[str] = []
    original = hvp.load_split
    try:
        hvp.load_split = lambda ds, *a, **k: seen.append(ds) or None  # type: ignore[assignment]
        hvp.main(["--dataset", "suite", "--methods", "als", "--budgets", "1", "--name", "suite_smoke"])
    finally:
        hvp.load_split = original  # type: ignore[assignment]
    assert seen == ["gowalla", "lastfm", *SUITE]


@pytest.mark.shared_data
def test_lastfm_is_real_data_of_the_suite(shared_data) -> None:
    from benchmarks.tools.catalogues import REAL

    assert list(REAL) == ["gowalla", "lastfm"] and set(REAL) <= set(hvp.DATASETS)
    split = hvp.load_split("lastfm", str(shared_data / "gowalla"), 0.1, quick=False)
    assert split is not None
    info = split.describe()
    assert (info["users"], info["items"]) == (1892, 4489)
    assert info["train"] + info["val"] == 42135 and info["test"] == 10533 - 3  # two cold test users left out
