"""Procedures that drive Trainer runs, apart from the modules they train.

:func:`fit_simplex_within_budget` is HEAT's time-budgeted SimpleX recipe: it chooses hyper-parameters on a
validation split by successive halving (:mod:`.search`) and trains the winner so that its learning-rate schedule
ends with the budget (:mod:`.clocks`, :mod:`.plan`). :func:`evaluate_ranking` (from :mod:`lightning_sdp.metrics`)
is the full-ranking evaluator it scores with.
"""

from lightning_sdp.metrics import evaluate_ranking
from lightning_sdp.models.simplex.auto import CCL_GRID, SOFTMAX_GRID, auto_grid
from lightning_sdp.recipes.budget import BudgetedFit, fit_simplex_within_budget
from lightning_sdp.recipes.plan import BudgetPlan
from lightning_sdp.recipes.runner import BASE_SETTINGS, SimpleXRunner, default_batch_size
from lightning_sdp.recipes.search import (
    MIN_SPAN_RATIO,
    SuccessiveHalving,
    Trial,
    ValidationScorer,
    extrapolate_recall,
    recipe_configs,
    sample_configs,
)

__all__ = [
    "BASE_SETTINGS",
    "CCL_GRID",
    "MIN_SPAN_RATIO",
    "SOFTMAX_GRID",
    "BudgetPlan",
    "BudgetedFit",
    "SimpleXRunner",
    "SuccessiveHalving",
    "Trial",
    "ValidationScorer",
    "auto_grid",
    "default_batch_size",
    "evaluate_ranking",
    "extrapolate_recall",
    "fit_simplex_within_budget",
    "recipe_configs",
    "sample_configs",
]
