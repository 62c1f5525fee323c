"""SimpleX / MF-CCL collaborative filtering (Mao et al., CIKM 2021) trained by HEAT's fused CPU kernel.

One concept per module: :mod:`.config` (the validated settings), :mod:`.auto` (the settings chosen from the
training data), :mod:`.history` (training interactions and capped histories), :mod:`.backends` (the reference and
fused training paths), :mod:`.kernel` (marshalling for the numba kernel), :mod:`.evaluation` (streamed full-ranking
Recall/NDCG), :mod:`.recommend` (streamed top-K recommendations) and :mod:`.module` (the LightningModule).
"""

from lightning_sdp.models.simplex.auto import InteractionStats, auto_grid, auto_settings, choose_loss
from lightning_sdp.models.simplex.backends import FusedBackend, ReferenceBackend, SimpleXBackend, make_backend
from lightning_sdp.models.simplex.config import SimpleXConfig
from lightning_sdp.models.simplex.evaluation import batch_csr, rank_and_score
from lightning_sdp.models.simplex.history import UserHistories
from lightning_sdp.models.simplex.module import SimpleXModule
from lightning_sdp.models.simplex.recommend import Recommendations, top_k_recommendations

__all__ = [
    "FusedBackend",
    "InteractionStats",
    "Recommendations",
    "ReferenceBackend",
    "SimpleXBackend",
    "SimpleXConfig",
    "SimpleXModule",
    "UserHistories",
    "auto_grid",
    "auto_settings",
    "batch_csr",
    "choose_loss",
    "make_backend",
    "rank_and_score",
    "top_k_recommendations",
]
