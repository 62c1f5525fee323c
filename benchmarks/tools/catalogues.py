"""The development suite of interaction data sets for HEAT's recipe: two real data sets (``REAL``: Gowalla and
Last.fm, LightGCN splits in ``../shared/data``) and generated catalogues that span what a user's data may look like.

Each catalogue is a seeded :func:`~lightning_sdp.datamodules.interactions.readers.synthetic_interactions` draw
(power-law item popularity with exponent ``alpha``, users in ``num_clusters`` taste clusters, about
``per_user`` items per user), split per user into train and test by ``InteractionsDataModule``; the benchmarks carve
validation out of train. They span density (0.05% to 9% of all user-item pairs after de-duplication), items per
user (14 to 71 on average), popularity skew (``alpha`` 0.5 to 1.1) and cluster structure (one cluster, i.e.
popularity only, to 100).

``ASIDE`` holds a catalogue kept out of every choice: it is scored once, after a rule for the recipe's defaults has
been derived on the others. Each aside catalogue joins the development ones once it has been scored and then used to
look for what the recipe lacks there, and a new one is defined, before any run on it: ``suite_aside`` (defined with
the suite), then ``suite_aside2``, then ``suite_aside3`` to ``suite_aside6``, whose parameters are the first four
seeded draws from the suite's ranges (users 3,000-15,000, items 1,000-8,000, 15-80 items per user, ``alpha``
0.5-1.1, 1-150 clusters; ``numpy.random.default_rng(20261204)``) rather than a choice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RealData:
    """One real data set of the suite: a LightGCN folder (``train.txt``, ``test.txt``) under ``../shared/data``."""

    folder: str
    what: str


REAL: dict[str, RealData] = {
    "gowalla": RealData("gowalla", "Gowalla check-ins: 29,858 users x 40,981 items, 0.08% dense (SimpleX's split)"),
    "lastfm": RealData("lastfm", "Last.fm listening (HetRec 2011): 1,892 users x 4,489 artists, 0.62% dense"),
}


@dataclass(frozen=True)
class Catalogue:
    """One generated catalogue of the suite (the arguments of ``InteractionsDataModule`` for synthetic data)."""

    users: int
    items: int
    per_user: int
    alpha: float
    num_clusters: int
    seed: int
    what: str

    def datamodule_kwargs(self) -> dict[str, Any]:
        return {
            "num_users": self.users,
            "num_items": self.items,
            "interactions_per_user": self.per_user,
            "alpha": self.alpha,
            "num_clusters": self.num_clusters,
            "seed": self.seed,
        }

    def nominal_density(self) -> float:
        return min(self.per_user, self.items // 2) / self.items

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "nominal_density": self.nominal_density()}


SUITE: dict[str, Catalogue] = {
    "suite_sparse_skewed": Catalogue(20_000, 30_000, 22, 1.1, 100, 11, "sparse (0.05%), steep popularity"),
    "suite_mid_flat": Catalogue(8_000, 4_000, 20, 0.5, 40, 12, "0.4%, flat popularity"),
    "suite_popularity_only": Catalogue(5_000, 3_000, 25, 1.0, 1, 16, "0.7%, no taste clusters"),
    "suite_long_histories": Catalogue(3_000, 5_000, 150, 0.9, 30, 15, "1.4%, 71 items per user"),
    "suite_dense": Catalogue(2_000, 1_000, 130, 0.8, 20, 13, "dense (4.9%), the size of a small public set"),
    "suite_very_dense": Catalogue(1_000, 400, 90, 0.6, 10, 14, "very dense (9%), few items"),
    "suite_aside": Catalogue(6_000, 2_500, 35, 0.7, 60, 17, "0.8%, 60 clusters (the first aside catalogue)"),
    "suite_aside2": Catalogue(12_000, 5_000, 28, 0.85, 120, 19, "0.5%, 120 clusters (the second aside catalogue)"),
    "suite_aside3": Catalogue(6_679, 3_498, 44, 0.62, 130, 23, "1.3%, 130 clusters (the third aside, a seeded draw)"),
    "suite_aside4": Catalogue(12_628, 2_481, 21, 1.0, 52, 24, "0.85%, 52 clusters (the fourth aside, a seeded draw)"),
    "suite_aside5": Catalogue(10_625, 7_070, 56, 1.1, 75, 25, "0.8%, 75 clusters (the fifth aside, a seeded draw)"),
}

# Scored once, at the end; never used to choose anything.
ASIDE: dict[str, Catalogue] = {
    "suite_aside6": Catalogue(13_693, 1_418, 25, 0.91, 73, 26, "held out: 1.8%, 73 clusters, a seeded draw"),
}

CATALOGUES: dict[str, Catalogue] = {**SUITE, **ASIDE}

__all__ = ["ASIDE", "CATALOGUES", "REAL", "SUITE", "Catalogue", "RealData"]
