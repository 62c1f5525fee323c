"""Settings that follow the training data: what ``"auto"`` means for :class:`SimpleXModule` and the budgeted recipe.

Two losses train the same model. SimpleX's cosine contrastive loss (CCL) pushes each sampled negative below a margin
with a large weight; HEAT's softmax over ``cos / temperature`` shares one normalised gradient among the positive and
its negatives, with each gradient coordinate clipped. Which one ranks better depends on the data, and the one
statistic that separated them on a development suite of interaction data (generated catalogues from 0.04% to 7.5%
of all user-item pairs, with flat and steep popularity, long and short histories, and Gowalla; see
``benchmarks/tools/catalogues.py`` and ``benchmarks/README.md``) is the **density** of the training interactions:

- below :data:`SOFTMAX_MIN_DENSITY` (very sparse catalogues, most items seen by a handful of users) the CCL recipe
  ranked better;
- at or above it the softmax loss ranked better on every catalogue, and by a wide margin on dense ones, where the
  CCL's fixed margin and weight plateau early.

:func:`choose_loss` is that rule, :func:`auto_settings` the module's defaults that follow from it, and
:func:`auto_grid` the search space of :func:`~lightning_sdp.recipes.fit_simplex_within_budget`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

#: Density (training positives / (users x items)) from which the softmax loss is chosen. The suite's sparse side
#: (Gowalla at 0.07%, a generated 0.04% catalogue) ranked better with CCL and its denser side (0.35% and up) with
#: the softmax loss; the threshold is the geometric middle of that gap.
SOFTMAX_MIN_DENSITY = 0.0015
#: HEAT's per-coordinate gradient clipping (its Gowalla configuration), used with the softmax loss.
SOFTMAX_GRAD_CLIP = 0.1

#: The recipe's search space with the cosine contrastive loss (the anchor, first value of each list, is the HEAT
#: guide's Gowalla recipe at a smaller dimension).
CCL_GRID: dict[str, list[Any]] = {
    "loss": ["ccl"],
    "init": ["normal", "svd"],
    "dim": [128, 64, 256],
    "num_negatives": [200, 64],
    "margin": [0.9, 0.8],
    "negative_weight": [150.0, 50.0],
    "lr": [0.1, 0.3],
}
#: The recipe's search space with HEAT's softmax loss (temperature 0.07, clipping 0.1); margins and weights drop out,
#: so the same number of trials covers more rates. The anchor is HEAT's own configuration (d=128, 64 negatives):
#: the search gives every first-round trial a few epochs *of the anchor*, and every negative of the softmax loss
#: gets a gradient, so an anchor with 200 negatives, at twice the cost of a step or more, left a search of a few
#: minutes on two cores room for few configurations (half as many or fewer on the development suite).
#: Temperatures of the softmax grid: HEAT's 0.07 (the anchor), then the softer ones that scored higher on validation
#: after short schedules on most of the development suite's softmax catalogues and on Last.fm
#: (``benchmarks/heat_temperature.py``, ``benchmarks/heat_recipe_candidates.py``).
SOFTMAX_TEMPERATURES: tuple[float, ...] = (0.07, 0.15, 0.1)
#: Both grids search the tables' initialisation (``SimpleXModule(init=...)``). On softmax data the anchor starts from
#: the truncated SVD of the training matrix, which scored higher on validation than a normal start on every softmax
#: catalogue of the development suite and on Last.fm, at 5 and at 20 epochs; on sparse (CCL) data it helped Gowalla
#: and lost at 20 epochs on the sparsest catalogue, so there the normal start stays the anchor and the SVD a candidate
#: (``benchmarks/heat_recipe_candidates.py``).
SOFTMAX_GRID: dict[str, list[Any]] = {
    "loss": ["softmax"],
    "grad_clip": [SOFTMAX_GRAD_CLIP],
    "init": ["svd", "normal"],
    "temperature": list(SOFTMAX_TEMPERATURES),
    "dim": [128, 64, 256],
    "num_negatives": [64, 200],
    "lr": [0.1, 0.3, 0.03],
}


@dataclass(frozen=True)
class InteractionStats:
    """What :func:`choose_loss` looks at: the shape of a training CSR.

    Attributes:
        num_users: rows of the CSR.
        num_items: items in the catalogue.
        num_positives: stored interactions.
        density: ``num_positives / (num_users * num_items)``.
        positives_per_user: mean interactions per user.
        positives_per_item: mean interactions per item.
        popularity_gini: Gini coefficient of the items' interaction counts (0: every item equally popular; near 1:
            a few items take almost everything).
    """

    num_users: int
    num_items: int
    num_positives: int
    density: float
    positives_per_user: float
    positives_per_item: float
    popularity_gini: float

    @classmethod
    def from_csr(cls, indptr: np.ndarray, indices: np.ndarray, num_items: int | None = None) -> InteractionStats:
        """Statistics of a training CSR ``(indptr, indices)``; ``num_items`` defaults to the largest id + 1.

        Raises:
            ValueError: an empty CSR (no users, items or interactions).
        """
        indices = np.asarray(indices)
        num_users = len(indptr) - 1
        num_items = int(indices.max(initial=-1)) + 1 if num_items is None else int(num_items)
        if num_users <= 0 or num_items <= 0 or len(indices) == 0:
            raise ValueError(
                f"InteractionStats: the training interactions are empty ({num_users} users, {num_items} items, "
                f"{len(indices)} interactions); load data with at least one interaction."
            )
        counts = np.sort(np.bincount(indices, minlength=num_items)).astype(np.float64)
        # Gini of the sorted counts: 1 - 2 * (area under the Lorenz curve)
        cumulative = np.cumsum(counts)
        gini = float(1.0 - 2.0 * (cumulative.sum() - cumulative[-1] / 2.0) / (num_items * cumulative[-1]))
        n = len(indices)
        return cls(num_users, num_items, n, n / (num_users * num_items), n / num_users, n / num_items, gini)

    def describe(self) -> str:
        """One line for logs: ``"2,000 users x 1,000 items, 70,770 interactions (35.4 per user, ...)"``."""
        return (
            f"{self.num_users:,} users x {self.num_items:,} items, {self.num_positives:,} interactions "
            f"({self.positives_per_user:.3g} per user, {self.positives_per_item:.3g} per item, popularity Gini "
            f"{self.popularity_gini:.2f})"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_loss(stats: InteractionStats) -> str:
    """``"softmax"`` when the training density is at least :data:`SOFTMAX_MIN_DENSITY`, else ``"ccl"``."""
    return "softmax" if stats.density >= SOFTMAX_MIN_DENSITY else "ccl"


def auto_settings(stats: InteractionStats | None) -> dict[str, Any]:
    """The values of :class:`SimpleXModule`'s ``"auto"`` arguments for this data: ``loss`` and ``grad_clip``.

    ``None`` (no training interactions known) gives the CCL settings.
    """
    loss = "ccl" if stats is None else choose_loss(stats)
    return {"loss": loss, "grad_clip": SOFTMAX_GRAD_CLIP if loss == "softmax" else None}


def auto_grid(stats: InteractionStats) -> dict[str, list[Any]]:
    """The recipe's search space for this data: :data:`SOFTMAX_GRID` or :data:`CCL_GRID` by :func:`choose_loss`.

    Args:
        stats: the training interactions' shape.
    """
    grid = SOFTMAX_GRID if choose_loss(stats) == "softmax" else CCL_GRID
    return {k: list(v) for k, v in grid.items()}


def explain(stats: InteractionStats) -> str:
    """Why :func:`choose_loss` chose what it did, in words (for logs and the recipe's notes)."""
    loss = choose_loss(stats)
    side = ">=" if loss == "softmax" else "<"
    return (
        f"loss={loss!r}: the training interactions fill {100 * stats.density:.3g}% of all user-item pairs, {side} "
        f"{100 * SOFTMAX_MIN_DENSITY:.3g}% ({stats.describe()})"
    )


__all__ = [
    "CCL_GRID",
    "SOFTMAX_GRAD_CLIP",
    "SOFTMAX_GRID",
    "SOFTMAX_MIN_DENSITY",
    "SOFTMAX_TEMPERATURES",
    "InteractionStats",
    "auto_grid",
    "auto_settings",
    "choose_loss",
    "explain",
]
