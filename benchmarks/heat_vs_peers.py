"""HEAT against the recommenders users already use: Recall/NDCG@20 against training wall-clock, tuned on validation.

Methods (``--methods``): implicit ALS and BPR, LightFM WARP, cornac BPR (and cornac EASE on catalogues of at most
``EASE_MAX_ITEMS`` items: its dense item x item inverse does not fit otherwise), HEAT's fused MF-CCL, HEAT's fused
SimpleX with an attention aggregator (when ``SimpleXModule`` has one), HEAT's budgeted recipe
(:func:`lightning_sdp.recipes.fit_simplex_within_budget`) and the plain-PyTorch reference backend.

Protocol, the same for every method:

1. the validation split is carved out of the training interactions with the datamodule's ``split_validation``
   (``--val-fraction``, seed 0); every model trains on train minus validation, except with ``--refit`` the final
   (test-scored) models, which train on the whole training split once validation has chosen their settings;
2. tuning: ``--configs`` configurations from the method's stated grid (``GRIDS``; the first is the library's default,
   the rest a seeded sample that covers every value of the grid first, ``sample_configs``), each trained for
   ``--trial-seconds`` of training time and scored on validation;
   the best one is kept. HEAT's recipe does its own search inside each budget instead (stricter: its search time
   counts against the budget);
3. test: iterative methods (ALS, BPR, WARP, cornac BPR, reference) train once up to the largest budget and are
   scored on the test split (training and validation items masked) at about ``--curve-points`` moments and where
   each budget runs out; scheduled methods (HEAT, whose learning rate decays to 0 at the end of a run) train once
   per budget. Times are training time only; evaluation time is measured and reported separately.

Every method uses ``--threads`` threads (torch, numba, BLAS through threadpoolctl, implicit's, LightFM's and cornac's
``num_threads``). Run ``python -m benchmarks.heat_vs_peers`` (Gowalla from ``../shared/data/gowalla``; ``--dataset
lastfm`` for Last.fm, ``suite`` for both real data sets and the generated catalogues); the expected run time is
printed first. ``--quick`` runs tiny synthetic data in seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._common import RESULTS_DIR, SHARED_DATA, machine_info, markdown_table, write_results
from benchmarks.tools.catalogues import REAL, SUITE
from benchmarks.tools.heat import DATASETS, Split, heat_batch_size, load_split, set_threads
from lightning_sdp.models.simplex import SimpleXModule
from lightning_sdp.recipes import (
    CCL_GRID,
    SOFTMAX_GRID,
    SimpleXRunner,
    evaluate_ranking,
    fit_simplex_within_budget,
    sample_configs,
)

NAME = "heat_vs_peers"
# the CCL grid plus light negative terms and low margins (method heat_budget_wide): on a dense catalogue it lifts CCL
# well above the default grid; on a sparse one its short search trials favour the light weights
WIDE_GRID: dict[str, list[Any]] = {
    **CCL_GRID,
    "margin": [0.9, 0.8, 0.5, 0.0],
    "negative_weight": [150.0, 50.0, 10.0, 1.0],
}
RESULTS = RESULTS_DIR  # where write_results puts the files
EASE_MAX_ITEMS = 15_000
ITERATIVE = ("als", "bpr", "lightfm", "cornac_bpr", "reference")
# HEAT's budgeted recipe, by the arguments it gets beside the budget: the default (its grid chosen from the training
# data); the cosine contrastive loss's grid whatever the data; HEAT's softmax loss's grid whatever the data; the
# earlier recipe (its search ranks trials by their last validation score, not the score extrapolated to the final
# length, and may cut the anchor configuration early); the wide CCL grid; the final fit as three warm restarts whose
# best snapshot on validation is kept
BUDGETED: dict[str, dict[str, Any]] = {
    "heat_budget": {},
    "heat_budget_ccl": {"grid": CCL_GRID},
    "heat_budget_softmax": {"grid": SOFTMAX_GRID},
    "heat_budget_last": {"selection": "last", "keep_anchor": False},
    "heat_budget_wide": {"grid": WIDE_GRID},
    "heat_budget_cycles": {"cycles": 3},
}
SCHEDULED = ("heat", "heat_attention", *BUDGETED)
ONE_SHOT = ("cornac_ease",)
ALL_METHODS = ITERATIVE[:4] + ONE_SHOT + SCHEDULED + ITERATIVE[4:]
DEFAULT_METHODS = ("als", "bpr", "lightfm", "cornac_bpr", "cornac_ease", "heat", "heat_budget")
PEER_PACKAGES = {
    "als": "implicit",
    "bpr": "implicit",
    "lightfm": "lightfm",
    "cornac_bpr": "cornac",
    "cornac_ease": "cornac",
}
# the stated grids (first entry = the library's defaults, as a new user would start)
GRIDS: dict[str, dict[str, list[Any]]] = {
    "als": {"factors": [100, 64, 128, 256], "regularization": [0.01, 0.05, 0.1], "alpha": [1.0, 10.0, 20.0, 40.0]},
    "bpr": {"factors": [100, 64, 128], "learning_rate": [0.01, 0.05, 0.1], "regularization": [0.01, 0.001]},
    "lightfm": {"no_components": [10, 64, 128], "learning_rate": [0.05, 0.02, 0.1], "item_alpha": [0.0, 1e-6]},
    "cornac_bpr": {"k": [10, 64, 128], "learning_rate": [0.001, 0.01, 0.05], "lambda_reg": [0.01, 0.001]},
    "cornac_ease": {"lamb": [500.0, 100.0, 50.0, 1000.0]},
    "heat": CCL_GRID,
    "heat_attention": {**CCL_GRID, "dim": [64, 128]},
    "reference": {"dim": [64, 128], "lr": [1e-3, 1e-4, 3e-3], "num_negatives": [64, 200]},
}


# ---------------------------------------------------------------------------------------------------- data


# ---------------------------------------------------------------------------------------------------- threads


# ---------------------------------------------------------------------------------------------------- methods
class Iterative:
    """A model trained one pass at a time: ``step()`` trains one pass, ``score(users)`` gives dense scores."""

    def __init__(self, step: Callable[[], None], score: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.step, self.score = step, score


def _factor_scores(users_f: np.ndarray, items_f: np.ndarray, bias: np.ndarray | None = None) -> Callable:
    def score(users: torch.Tensor) -> torch.Tensor:
        s = torch.from_numpy(np.ascontiguousarray(users_f[users.numpy()])) @ torch.from_numpy(items_f).T
        return s + torch.from_numpy(bias) if bias is not None else s

    return score


def cornac_dataset(split: Split, seed: int) -> tuple[Any, np.ndarray, np.ndarray]:
    """cornac's ``Dataset`` of train minus validation, the raw item of each inner item and the inner id of each user."""
    import cornac

    triples = list(zip(split.train_users.tolist(), split.train[1].tolist(), [1.0] * len(split.train[1]), strict=True))
    ds = cornac.data.Dataset.build(triples, seed=seed)
    raw_items = np.array([raw for raw, _ in sorted(ds.iid_map.items(), key=lambda kv: kv[1])], dtype=np.int64)
    inner_user = np.full(split.num_users, -1, dtype=np.int64)
    for raw, inner in ds.uid_map.items():
        inner_user[int(raw)] = inner
    return ds, raw_items, inner_user


def build_iterative(method: str, config: dict[str, Any], split: Split, threads: int, seed: int) -> Iterative:
    """One iterative method, ready to train one pass at a time."""
    if method in ("als", "bpr"):
        from implicit.als import AlternatingLeastSquares
        from implicit.bpr import BayesianPersonalizedRanking

        cls = AlternatingLeastSquares if method == "als" else BayesianPersonalizedRanking
        model = cls(iterations=1, num_threads=threads, random_state=seed, **config)
        matrix = split.matrix()

        def step() -> None:
            model.fit(matrix, show_progress=False)  # continues from the current factors (implicit >= 0.5)

        return Iterative(step, lambda u: _factor_scores(model.user_factors, model.item_factors)(u))
    if method == "lightfm":
        from lightfm import LightFM

        model = LightFM(loss="warp", random_state=seed, **config)
        coo = split.matrix().tocoo()

        def step() -> None:
            model.fit_partial(coo, epochs=1, num_threads=threads)

        def score(users: torch.Tensor) -> torch.Tensor:
            bias, items = model.get_item_representations()
            _, user_f = model.get_user_representations()
            return _factor_scores(user_f, items, bias)(users)

        return Iterative(step, score)
    if method == "cornac_bpr":
        from cornac.models import BPR

        ds, raw_items, inner_user = cornac_dataset(split, seed)
        state: dict[str, Any] = {}

        def step() -> None:
            model = BPR(max_iter=1, num_threads=threads, seed=seed, init_params=dict(state) or None, **config)
            model.fit(ds)
            state.update(U=model.u_factors, V=model.i_factors, Bi=model.i_biases)

        def score(users: torch.Tensor) -> torch.Tensor:
            out = torch.full((len(users), split.num_items), float("-inf"))
            inner = inner_user[users.numpy()]
            factors = _factor_scores(state["U"], state["V"], state["Bi"])
            out[:, torch.from_numpy(raw_items)] = factors(torch.from_numpy(inner))
            return out

        return Iterative(step, score)
    if method == "reference":
        model = SimpleXModule(
            split.num_users, split.num_items, backend="reference", optimizer="adam", seed=seed, **config
        )
        model.set_interactions(*split.train)
        optimizer = model.configure_optimizers()
        items = torch.from_numpy(split.train[1])
        users = torch.from_numpy(split.train_users)
        gen = np.random.default_rng(seed)
        batch, per_step = 1024, 16  # one "pass" = 16 batches of 1024 (an epoch of Gowalla is ~800 batches)

        def step() -> None:
            for _ in range(per_step):
                idx = torch.from_numpy(gen.integers(0, len(items), batch))
                negatives = torch.randint(0, split.num_items, (batch, model.hparams.num_negatives))
                objective, _ = model.reference_loss(users[idx], items[idx], negatives)
                optimizer.zero_grad()
                objective.backward()
                optimizer.step()

        return Iterative(step, model.score)
    raise ValueError(f"unknown iterative method {method!r}")


def run_iterative(
    method: str,
    config: dict[str, Any],
    split: Split,
    seconds: float,
    eval_at: list[float],
    target: str,
    threads: int,
    seed: int,
) -> list[dict[str, float]]:
    """Train up to ``seconds`` of training time; score on ``target`` once training time passes each ``eval_at``."""
    model = build_iterative(method, config, split, threads, seed)
    known, goal = (split.train, split.val) if target == "val" else (split.full_train, split.test)
    users = None
    if target == "val":  # validation on a seeded subset of at most 5000 users, as the recipe does
        users = np.flatnonzero(np.diff(split.val[0]) > 0)
        if len(users) > 5000:
            users = np.sort(np.random.default_rng(seed).choice(users, 5000, replace=False))
    pending, curve, train_s, passes = sorted(eval_at), [], 0.0, 0

    def point() -> dict[str, float]:
        start = time.perf_counter()
        recall, ndcg = evaluate_ranking(model.score, known, goal, split.num_items, 20, users)
        return {
            "train_s": train_s,
            "passes": passes,
            "recall@20": recall,
            "ndcg@20": ndcg,
            "eval_s": time.perf_counter() - start,
        }

    while train_s < seconds:
        start = time.perf_counter()
        model.step()
        train_s += time.perf_counter() - start
        passes += 1
        if pending and (train_s >= pending[0] or train_s >= seconds):
            while pending and train_s >= pending[0]:
                pending.pop(0)
            curve.append(point())
    if not curve or curve[-1]["passes"] != passes:
        curve.append(point())
    return curve


def run_ease(config: dict[str, Any], split: Split, target: str, seed: int) -> list[dict[str, float]]:
    """cornac's EASE (closed form, one point): fit, then score ``X[u] @ B`` for every item."""
    from cornac.models import EASE

    ds, raw_items, inner_user = cornac_dataset(split, seed)
    start = time.perf_counter()
    model = EASE(verbose=False, seed=seed, **config)
    model.fit(ds)
    train_s = time.perf_counter() - start
    weights = torch.from_numpy(np.asarray(model.B, dtype=np.float32))

    def score(users: torch.Tensor) -> torch.Tensor:
        rows = torch.from_numpy(ds.matrix[inner_user[users.numpy()]].toarray().astype(np.float32))
        out = torch.full((len(users), split.num_items), float("-inf"))
        out[:, torch.from_numpy(raw_items)] = rows @ weights
        return out

    known, goal = (split.train, split.val) if target == "val" else (split.full_train, split.test)
    start = time.perf_counter()
    recall, ndcg = evaluate_ranking(score, known, goal, split.num_items)
    eval_s = time.perf_counter() - start
    return [{"train_s": train_s, "passes": 1, "recall@20": recall, "ndcg@20": ndcg, "eval_s": eval_s}]


def heat_kwargs(method: str) -> dict[str, Any]:
    if method == "heat_attention":
        return {"g": 0.8, "aggregator": "user_attention", "aggregator_weight_decay": 1e-4, "aggregator_lr_scale": 0.1}
    return {}


def run_scheduled(
    method: str, config: dict[str, Any], split: Split, seconds: float, target: str, threads: int, seed: int
) -> dict[str, Any]:
    """One HEAT run whose linear schedule ends within ``seconds`` of training, scored on ``target``."""
    runner = SimpleXRunner(split.train, split.num_items, heat_batch_size(split), threads, seed, heat_kwargs(method))
    model, steps, train_s, final_lr = runner.fit_for_seconds(config, seconds)
    known, goal = (split.train, split.val) if target == "val" else (split.full_train, split.test)
    start = time.perf_counter()
    recall, ndcg = evaluate_ranking(model.score, known, goal, split.num_items)
    return {
        "train_s": train_s,
        "steps": steps,
        "final_lr": final_lr,
        "recall@20": recall,
        "ndcg@20": ndcg,
        "eval_s": time.perf_counter() - start,
    }


# ---------------------------------------------------------------------------------------------------- protocol
def available(method: str) -> str | None:
    """``None`` when the method can run here, else why not."""
    package = PEER_PACKAGES.get(method)
    if package and importlib.util.find_spec(package) is None:
        hint = ""
        if package == "lightfm":
            hint = " (LightFM 1.17's sdist fails to build under setuptools' build backend: see benchmarks/README.md)"
        return f"{package} is not installed: pip install 'lightning-sdp[bench]'{hint}"
    return None


def merge_into_stored(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` added to ``results/heat_vs_peers.json``: this run's methods replace their rows there.

    Each row keeps the machine line of the run that produced it, so a merged report says which run measured what.
    """
    path = RESULTS_DIR / f"{results['args']['name']}.json"
    if not path.exists():
        return results
    stored = json.loads(path.read_text())
    if stored["args"]["budgets"] != results["args"]["budgets"]:
        raise SystemExit(
            f"--merge: the stored run used budgets {stored['args']['budgets']}, this one {results['args']['budgets']}; "
            "use the same --budgets or run without --merge"
        )
    if stored["args"].get("refit", False) != results["args"]["refit"]:
        raise SystemExit(
            f"--merge: the stored run used refit={stored['args'].get('refit', False)}, this one "
            f"{results['args']['refit']}; runs of the two protocols cannot share a report: use another --name"
        )
    run = {"machine": results["machine"], "methods": results["methods"]}
    stored.setdefault("runs", [{"machine": stored["machine"], "methods": stored["methods"]}]).append(run)
    for name, data in results["datasets"].items():
        old = stored["datasets"].setdefault(name, {"split": data["split"], "methods": []})
        new_rows = {row["method"]: {**row, "run": len(stored["runs"]) - 1} for row in data["methods"]}
        old["methods"] = [r for r in old["methods"] if r["method"] not in new_rows] + list(new_rows.values())
    stored["methods"] = list(dict.fromkeys([*stored["methods"], *results["methods"]]))
    stored["machine"]["load_avg_1m_end"] = results["machine"]["load_avg_1m_end"]
    return stored


def tune(method: str, split: Split, args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Same budget for everyone: ``args.configs`` configurations, ``args.trial_seconds`` of training each."""
    configs = sample_configs(GRIDS[method], args.configs, args.seed)
    trials = []
    for config in configs:
        start = time.perf_counter()
        if method in ITERATIVE:
            curve = run_iterative(
                method, config, split, args.trial_seconds, [args.trial_seconds], "val", args.threads, args.seed
            )
            final = curve[-1]
        elif method in ONE_SHOT:
            final = run_ease(config, split, "val", args.seed)[-1]
        else:
            final = run_scheduled(method, config, split, args.trial_seconds, "val", args.threads, args.seed)
        trials.append(
            {
                "config": config,
                "val_recall@20": final["recall@20"],
                "val_ndcg@20": final["ndcg@20"],
                "train_s": final["train_s"],
                "wall_s": time.perf_counter() - start,
            }
        )
        print(
            f"  {method} trial {config}: val Recall@20 {final['recall@20']:.4f} ({final['train_s']:.1f}s)", flush=True
        )
    best = max(trials, key=lambda t: t["val_recall@20"])
    return best["config"], trials


def run_method(method: str, split: Split, args: argparse.Namespace) -> dict[str, Any]:
    budgets = args.budgets
    if method == "cornac_ease" and split.num_items > EASE_MAX_ITEMS:
        why = f"EASE needs a dense {split.num_items}^2 item matrix (> {EASE_MAX_ITEMS} items)"
        return {"method": method, "missing": why}
    if method in BUDGETED:
        points = []
        settings = {"refit": args.refit and BUDGETED[method].get("cycles", 1) == 1, **BUDGETED[method]}
        for budget in budgets:
            fit = fit_simplex_within_budget(
                split.train,
                budget_seconds=budget,
                val=split.val,
                num_items=split.num_items,
                threads=args.threads,
                seed=args.seed,
                **settings,
            )
            model = fit.model
            start = time.perf_counter()
            recall, ndcg = evaluate_ranking(model.score, split.full_train, split.test, split.num_items)
            points.append(
                {
                    "budget_s": budget,
                    "train_s": fit.search_seconds + fit.fit_seconds,
                    "recall@20": recall,
                    "ndcg@20": ndcg,
                    "eval_s": time.perf_counter() - start,
                    "val_recall@20": fit.val_recall,
                    "config": fit.config,
                    "max_steps": fit.max_steps,
                    "final_lr": fit.final_lr,
                    "search_s": fit.search_seconds,
                    "trials": len(fit.trials),
                    "selection": fit.selection,
                    "search_trials": [{k: v for k, v in t.__dict__.items() if k != "fit_seconds"} for t in fit.trials],
                    "cycle_steps": fit.cycle_steps,
                    "cycle_val_recall@20": fit.cycle_val_recall,
                    "chosen_cycle": fit.chosen_cycle,
                    "check_steps": fit.check_steps,
                    "check_val_recall@20": fit.check_val_recall,
                    "chosen_check": fit.chosen_check,
                    "refit": fit.refit,
                    "train_positives": fit.train_positives,
                    "notes": fit.notes,
                }
            )
            print(f"  {method} {budget}s: test Recall@20 {recall:.4f}, chose {fit.config}", flush=True)
        return {"method": method, "config": "chosen inside each budget", "trials": [], "curve": points}
    config, trials = tune(method, split, args)
    final = split.refit() if args.refit else split  # what the test-scored model trains on
    if method in ITERATIVE:
        top = max(budgets)
        eval_at = sorted(set(budgets) | {top * f for f in np.geomspace(0.02, 1.0, args.curve_points)})
        curve = run_iterative(method, config, final, top, eval_at, "test", args.threads, args.seed)
    elif method in ONE_SHOT:
        curve = run_ease(config, final, "test", args.seed)
    else:
        curve = []
        for budget in budgets:
            point = run_scheduled(method, config, final, budget, "test", args.threads, args.seed)
            curve.append({"budget_s": budget, **point})
    for point in curve:
        print(
            f"  {method} test: {point['train_s']:.1f}s Recall@20 {point['recall@20']:.4f} "
            f"NDCG@20 {point['ndcg@20']:.4f}"
        )
    return {"method": method, "config": config, "trials": trials, "curve": curve}


def at_budget(curve: list[dict[str, Any]], budget: float) -> dict[str, Any] | None:
    """The last test point whose training time fits in ``budget`` (scheduled: the run made for that budget)."""
    if curve and "budget_s" in curve[0]:
        return next((p for p in curve if p["budget_s"] == budget), None)
    inside = [p for p in curve if p["train_s"] <= budget * 1.05]
    return inside[-1] if inside else None


def estimate_seconds(methods: list[str], splits: list[str], args: argparse.Namespace) -> float:
    """Rough wall time: tuning + training + evaluations (about 7 s per Gowalla test evaluation on 2 cores)."""
    total, top, total_budget = 0.0, max(args.budgets), sum(args.budgets)
    for _ in splits:
        for m in methods:
            if m in BUDGETED:
                total += total_budget + 10 * len(args.budgets)
            elif m in SCHEDULED:
                total += args.configs * (args.trial_seconds + 3) + total_budget + 10 * len(args.budgets)
            elif m in ITERATIVE:
                total += args.configs * (args.trial_seconds + 2) + top + 7 * (args.curve_points + len(args.budgets))
            else:
                total += args.configs * 5
    return total


def _figure(num_datasets: int) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, num_datasets)
    return plt.subplots(1, n, figsize=(6.5 * n, 4.5), squeeze=False)


def _plot_dataset(ax: Any, name: str, rows: list[dict[str, Any]], threads: int) -> None:
    """Test Recall@20 against training time of every method of one dataset."""
    for r in rows:
        if "missing" not in r:
            curve, marker = r["curve"], "-o" if r["method"] not in SCHEDULED else "-s"
            ax.plot([p["train_s"] for p in curve], [p["recall@20"] for p in curve], marker, ms=3, label=r["method"])
    ax.set_xscale("log")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("Recall@20 (test)")
    ax.set_title(f"{name}: quality vs training time, {threads} threads", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _budget_cells(curve: list[dict[str, Any]], budgets: list[float], measured: list[float]) -> dict[str, str]:
    """``R@20 <b>s`` -> ``"recall / ndcg"`` at each of ``budgets``; empty where the run did not reach ``b``."""
    cells = {}
    for b in budgets:
        p = at_budget(curve, b) if b in measured else None
        cells[f"R@20 {b:g}s"] = "" if p is None else f"{p['recall@20']:.4f} / {p['ndcg@20']:.4f}"
    return cells


def report(results: dict[str, Any], args: argparse.Namespace, name: str) -> None:
    write_results(name, results, *render(results))


def _ratio_rows(results: dict[str, Any], budgets: list[float]) -> list[dict[str, Any]]:
    """Per dataset, the recipe's test Recall@20 over ALS's at each budget (when both ran)."""
    rows = []
    for ds, entry in results["datasets"].items():
        by_method = {r["method"]: r for r in entry["methods"] if "curve" in r}
        if "als" not in by_method or "heat_budget" not in by_method:
            continue
        row: dict[str, Any] = {"dataset": ds}
        for b in budgets:
            als, recipe = at_budget(by_method["als"]["curve"], b), at_budget(by_method["heat_budget"]["curve"], b)
            if als and recipe and als["recall@20"] > 0:
                row[f"recipe / ALS {b:g}s"] = f"{recipe['recall@20'] / als['recall@20']:.3f}"
        rows.append(row)
    return rows


def render(results: dict[str, Any]) -> tuple[str, Any]:
    """The run's page and figure from its stored results (``render_results`` rebuilds them without a rerun)."""
    args = argparse.Namespace(**results["args"])
    datasets = list(results["datasets"])
    fig, axes = _figure(len(datasets))
    md = [
        f"Protocol: validation carved from train ({args.val_fraction:.0%} per user, `split_validation`, seed 0); every "
        f"method tuned with the same budget ({args.configs} configurations of its grid, {args.trial_seconds:g} s of "
        "training each, scored on validation); the chosen one trained on "
        + (
            "the whole training split (validation folded back in, `--refit`)"
            if args.refit
            else "train minus validation"
        )
        + " and scored on the test split (training and validation items masked). Times are training time only (evaluation excluded, "
        f"column `eval_s`). {args.threads} threads for every method. HEAT's recipe (`heat_budget`) tunes inside "
        "each budget (its search time is part of `train_s`). Grids: "
        + "; ".join(f"`{m}` {GRIDS[m]}" for m in results["methods"] if m in GRIDS),
    ]
    for i, run in enumerate(results.get("runs", [])):
        m = run["machine"]
        md.append(
            f"Run {i} (column `run`): {', '.join(run['methods'])}; load average {m.get('load_avg_1m')} at the start, "
            f"{m.get('load_avg_1m_end')} at the end, {m.get('time', m.get('date', ''))}."
        )
    for ax, ds in zip(axes[0], datasets, strict=False):
        entry = results["datasets"][ds]
        md.append(f"\n## {ds}\n\n" + markdown_table([entry["split"]]))
        rows = []
        for r in entry["methods"]:
            if "missing" in r:
                rows.append({"method": r["method"], "setting": "missing: " + r["missing"]})
                continue
            row: dict[str, Any] = {"method": r["method"], "setting": json.dumps(r["config"])}
            row.update(_budget_cells(r["curve"], args.budgets, args.budgets))
            row["eval_s (total)"] = round(sum(p["eval_s"] for p in r["curve"]), 1)
            if "runs" in results:
                row["run"] = r.get("run", 0)
            rows.append(row)
        md.append("Recall@20 / NDCG@20 on test at each training-time budget:\n\n" + markdown_table(rows))
        _plot_dataset(ax, ds, entry["methods"], args.threads)
    ratios = _ratio_rows(results, args.budgets)
    if ratios:
        md.insert(1, "The recipe's test Recall@20 over validation-tuned ALS's:\n\n" + markdown_table(ratios))
    return "\n\n".join(md), fig


# ---------------------------------------------------------------------------------------------------- merged runs
def command_of(args: dict[str, Any], methods: list[str] | None = None, merge: bool = False) -> str:
    """The command line that made a stored run (``methods`` and ``merge`` for the runs merged into it)."""
    parts = [f"python -m benchmarks.heat_vs_peers --dataset {args['dataset']}"]
    parts.append(f"--methods {','.join(methods) if methods else args['methods']}")
    parts.append(f"--budgets {','.join(f'{b:g}' for b in args['budgets'])}")
    parts += ["--refit"] if args.get("refit") else []
    for key, default in (("seed", 0), ("configs", 3), ("trial_seconds", 8.0), ("threads", 2), ("val_fraction", 0.1)):
        if args.get(key, default) != default:
            parts.append(f"--{key.replace('_', '-')} {args[key]:g}")
    parts.append(f"--name {args['name']}" + (" --merge" if merge else ""))
    return " ".join(parts)


def _sources_of(stem: str, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """What a stored file was made from: itself (one entry per source run), or the sources a merged file lists."""
    if "merged_from" in doc:
        return doc["merged_from"]
    runs = doc.get("runs") or [{"machine": doc["machine"], "methods": doc["methods"]}]
    commands = [command_of(doc["args"], run["methods"], merge=i > 0) for i, run in enumerate(runs)]
    return [{"name": stem, "commands": commands, "refit": doc["args"].get("refit", False), "runs": runs}]


def _merge_row(into: dict[str, Any] | None, row: dict[str, Any], dataset: str) -> dict[str, Any]:
    """``row`` added to the same method's merged row: scheduled runs (one point per budget) side by side; a method
    measured along one curve (ALS, BPR, ...) must come from one run only."""
    if into is None:
        return {**row, "curve": list(row["curve"]), "budgets": list(row["budgets"])}
    points = {p.get("budget_s") for p in into["curve"]}
    if None in points or any(p.get("budget_s") in points for p in row["curve"]):
        raise ValueError(
            f"merge: two runs measured {row['method']} on {dataset} at the same budgets "
            f"({into['curve'][0]['source']} and {row['curve'][0]['source']}); merge one of them only."
        )
    curve = sorted([*into["curve"], *row["curve"]], key=lambda p: p["budget_s"])
    return {**into, "curve": curve, "budgets": sorted({*into["budgets"], *row["budgets"]})}


def merge_runs(stems: list[str], folder: Path | None = None) -> dict[str, Any]:
    """One results document from stored runs ``<folder>/<stem>.json`` (numbers unchanged).

    Each dataset keeps the rows of every run that measured it; a method's points of several runs (HEAT's recipe at
    30/60/180 s in one run, 10 minutes in another) form one row, every point naming its ``source`` run. The runs
    and the commands that made them are listed under ``merged_from``.

    Raises:
        ValueError: two runs measured a method on a dataset at the same budget, or under different protocols.
    """
    folder = folder or RESULTS_DIR
    merged: dict[str, Any] = {"merged_from": [], "datasets": {}, "methods": []}
    for stem in stems:
        doc = json.loads((folder / f"{stem}.json").read_text())
        sources = _sources_of(stem, doc)
        merged["merged_from"] += sources
        merged.setdefault("machine", doc["machine"])
        merged["threads"] = doc.get("threads", doc.get("args", {}).get("threads", 2))
        merged["methods"] = list(dict.fromkeys([*merged["methods"], *doc["methods"]]))
        refit = doc["args"].get("refit", False) if "args" in doc else None
        for name, data in doc["datasets"].items():
            entry = merged["datasets"].setdefault(name, {"split": data["split"], "refit": refit, "methods": {}})
            entry["refit"] = data.get("refit", refit) if entry["refit"] is None else entry["refit"]
            if data.get("refit", refit) != entry["refit"]:
                raise ValueError(f"merge: {stem} scored {name} under another protocol (refit) than the runs before it.")
            for row in data["methods"]:
                if "missing" in row:
                    continue
                budgets = row.get("budgets") or doc["args"]["budgets"]
                curve = [{"source": stem, "run": row.get("run", 0), **p} for p in row["curve"]]
                new = {**row, "curve": curve, "budgets": budgets}
                entry["methods"][row["method"]] = _merge_row(entry["methods"].get(row["method"]), new, name)
    for entry in merged["datasets"].values():
        entry["methods"] = list(entry["methods"].values())
    return merged


def merged_report(merged: dict[str, Any], name: str) -> None:
    """Write ``results/<name>.{json,md,png}`` for :func:`merge_runs`' document."""
    datasets = list(merged["datasets"])
    fig, axes = _figure(len(datasets))
    md = [
        "Merged from the stored runs below (numbers as measured, not rerun). Protocol of every run: validation "
        "carved from train (10% per user, `split_validation`, seed 0); each peer tuned on validation (3 "
        "configurations of its grid, 8 s of training each), the chosen one trained on train minus validation "
        "(*held out*) or on the whole training split (*refit*) and scored on the test split (training and "
        "validation items masked). HEAT's recipe (`heat_budget`) tunes inside each budget (its search time is part "
        "of `train_s`). Times are training time only; "
        f"{merged.get('threads', 2)} threads for every method. Grids: "
        + "; ".join(f"`{m}` {GRIDS[m]}" for m in merged["methods"] if m in GRIDS),
        "## Source runs",
    ]
    for source in merged["merged_from"]:
        lines = [f"- `{source['name']}`:"]
        for command, run in zip(source["commands"], source["runs"], strict=True):
            m = run["machine"]
            lines.append(
                f"  - `{command}` ({m.get('date', '')}, {m.get('cpu', '')}, load {m.get('load_avg_1m')} at the start, "
                f"{m.get('load_avg_1m_end')} at the end)"
            )
        md.append("\n".join(lines))
    for ax, ds in zip(axes[0], datasets, strict=False):
        entry = merged["datasets"][ds]
        budgets = sorted({b for r in entry["methods"] for b in r["budgets"]})
        rows = []
        for r in entry["methods"]:
            row: dict[str, Any] = {"method": r["method"], "setting": json.dumps(r["config"])}
            row.update(_budget_cells(r["curve"], budgets, r["budgets"]))
            row["source (run)"] = ", ".join(dict.fromkeys(f"`{p['source']}` ({p['run']})" for p in r["curve"]))
            rows.append(row)
        protocol = "refit" if entry["refit"] else "held out"
        md.append(f"## {ds} ({protocol})\n\n" + markdown_table([entry["split"]]))
        md.append("Recall@20 / NDCG@20 on test at each training-time budget:\n\n" + markdown_table(rows))
        _plot_dataset(ax, ds, entry["methods"], merged.get("threads", 2))
    write_results(name, merged, "\n\n".join(md), fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--data",
        default=str(SHARED_DATA / "gowalla"),
        help="LightGCN folder of the Gowalla split; the other real data sets are read from folders beside it",
    )
    parser.add_argument(
        "--dataset",
        default="gowalla",
        help="comma list of gowalla, lastfm, synthetic (dense, 3000 x 1500), synthetic_fresh (6000 x 4000), "
        "synthetic_holdout (12000 x 8000, scored once), synthetic_holdout2 (20000 x 15000, scored once), the "
        "development suite's catalogues (benchmarks/tools/catalogues.py), 'suite' for the real data sets and all "
        "catalogues but the aside one",
    )
    parser.add_argument("--name", default=NAME, help="stem of the results files (another stem keeps the stored run)")
    parser.add_argument(
        "--methods", default=",".join(DEFAULT_METHODS), help=f"comma list of {', '.join(ALL_METHODS)} or 'all'"
    )
    parser.add_argument("--budgets", default="30,60,180", help="training-time budgets in seconds")
    parser.add_argument("--configs", type=int, default=3, help="configurations tried per method (same for all)")
    parser.add_argument("--trial-seconds", type=float, default=8.0, help="training time of each tuning trial")
    parser.add_argument("--curve-points", type=int, default=5, help="extra test evaluations along iterative runs")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--refit",
        action="store_true",
        help="train the final, test-scored models of every method on train + validation once validation has chosen",
    )
    parser.add_argument("--quick", action="store_true", help="tiny synthetic data, seconds (smoke test)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="add this run's methods to the stored results (same datasets and budgets), replacing their old rows",
    )
    parser.add_argument(
        "--merge-runs",
        nargs="+",
        metavar="STEM",
        default=None,
        help="run nothing: merge the stored results/<STEM>.json runs into results/<--name>.{json,md,png}",
    )
    args = parser.parse_args(argv)
    if args.merge_runs:
        merged = merge_runs(args.merge_runs)
        merged_report(merged, args.name)
        return merged
    args.budgets = [float(b) for b in args.budgets.split(",")]
    if any(b <= 0 for b in args.budgets):
        raise SystemExit(f"--budgets must be positive seconds, got {args.budgets}")
    methods = list(ALL_METHODS) if args.methods == "all" else args.methods.split(",")
    unknown = sorted(set(methods) - set(ALL_METHODS))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {', '.join(ALL_METHODS)}")
    datasets = [*REAL, *SUITE] if args.dataset == "suite" else args.dataset.split(",")
    unknown_data = sorted(set(datasets) - set(DATASETS))
    if unknown_data:
        raise SystemExit(f"unknown datasets {unknown_data}; choose from {', '.join(DATASETS)}")
    if args.quick:
        # budgets of a few seconds: the probe and the search must leave a step on a loaded 2-core machine
        datasets, args.budgets, args.configs = ["synthetic"], [2.5, 3.0], 2
        args.trial_seconds, args.curve_points = 0.3, 2
    print(
        f"heat_vs_peers: methods {methods}, datasets {datasets}, budgets {args.budgets} s, {args.configs} configs "
        f"x {args.trial_seconds:g} s tuning each; expected run time about "
        f"{estimate_seconds(methods, datasets, args) / 60:.1f} min (more on a loaded machine)",
        flush=True,
    )
    limiter = set_threads(args.threads)
    results: dict[str, Any] = {"args": vars(args), "methods": methods, "datasets": {}, "machine": machine_info()}
    for ds in datasets:
        split = load_split(ds, args.data, args.val_fraction, args.quick)
        if split is None:
            continue
        print(f"{ds}: {split.describe()}", flush=True)
        rows = []
        for method in methods:
            why = available(method)
            if why:
                print(f"  {method}: missing ({why})", flush=True)
                rows.append({"method": method, "missing": why})
                continue
            start = time.perf_counter()
            rows.append({**run_method(method, split, args), "wall_s": time.perf_counter() - start})
        results["datasets"][split.name] = {"split": split.describe(), "methods": rows}
    results["machine"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    del limiter
    if args.merge and not args.quick:
        results = merge_into_stored(results)
    if results["datasets"]:
        report(results, args, args.name + ("_quick" if args.quick else ""))
    return results


if __name__ == "__main__":
    main()
