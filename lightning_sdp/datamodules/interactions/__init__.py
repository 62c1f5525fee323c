"""User-item interaction data for collaborative filtering (SimpleX / HEAT).

Three sources, one shape: a LightGCN folder (``train.txt`` / ``test.txt``, one line ``user item item ...``), a
user-item CSV/TSV file split per user with a seed, or a seeded synthetic power-law catalogue for demos and tests.
A seeded per-user validation set is carved out of the training interactions; the test set stays untouched.

Modules: :mod:`.datamodule` (:class:`InteractionsDataModule`), :mod:`.readers` (files and the id rule, synthetic
data), :mod:`.split` (test and validation splits), :mod:`.csr` (the CSR layout), :mod:`.eval_memory` (evaluation
batch sizing).
"""

from lightning_sdp.datamodules.interactions.csr import CSR, merge_csr, to_csr
from lightning_sdp.datamodules.interactions.datamodule import InteractionsDataModule, PositivePairs
from lightning_sdp.datamodules.interactions.eval_memory import auto_eval_batch_size, check_eval_batch_size
from lightning_sdp.datamodules.interactions.readers import ID_RULE, read_id_table, read_lightgcn, synthetic_interactions
from lightning_sdp.datamodules.interactions.split import split_per_user, split_validation

__all__ = [
    "CSR",
    "ID_RULE",
    "InteractionsDataModule",
    "PositivePairs",
    "auto_eval_batch_size",
    "check_eval_batch_size",
    "merge_csr",
    "read_id_table",
    "read_lightgcn",
    "split_per_user",
    "split_validation",
    "synthetic_interactions",
    "to_csr",
]
