"""Non-finite values never pass silently: temperatures, NaN rows in training (both backends), and ranking."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer

from lightning_sdp.datamodules.interactions import InteractionsDataModule
from lightning_sdp.models.simplex import SimpleXModule

_SMALL = {"dim": 8, "num_negatives": 4}
_BACKENDS = ["reference", pytest.param("fused", marks=pytest.mark.numba)]


def _trainer(tmp_path: Path) -> Trainer:
    return Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
    )


@pytest.mark.parametrize("temperature", [1e-45, 0.0, -0.07, math.inf, math.nan])
def test_temperatures_whose_float32_inverse_is_not_finite_are_refused(temperature):
    with pytest.raises(ValueError, match="temperature must be a positive number whose inverse is finite in float32"):
        SimpleXModule(loss="softmax", temperature=temperature)


def test_small_but_representable_temperatures_are_accepted():
    assert SimpleXModule(loss="softmax", temperature=1e-30).config.temperature == 1e-30


class _SetRowNaN:
    """Sets one row of a table to NaN just before training starts (as a bad load or a diverged update would)."""

    def __init__(self, table: str, row: int) -> None:
        self.table, self.row = table, row

    def __call__(self, model: SimpleXModule) -> None:
        with torch.no_grad():
            getattr(model, self.table).weight[self.row] = float("nan")


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize(
    ("table", "row", "named"), [("item_embedding", 7, "item row 7"), ("user_embedding", 3, "user row 3")]
)
def test_a_nan_row_stops_training_naming_the_row_before_it_spreads(backend, table, row, named, tmp_path):
    from lightning.pytorch import Callback

    class Poison(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            _SetRowNaN(table, row)(pl_module)

    dm = InteractionsDataModule(num_users=120, num_items=60, batch_size=64, seed=1)
    extra = {"optimizer": "sgd", "lr": 0.05} if backend == "reference" else {}
    model = SimpleXModule(backend=backend, loss="ccl", **_SMALL, **extra)
    trainer = _trainer(tmp_path)
    trainer.callbacks.append(Poison())
    with pytest.raises(FloatingPointError, match=named):
        trainer.fit(model, dm)
    for name in ("user_embedding", "item_embedding"):
        bad = ~torch.isfinite(getattr(model, name).weight).all(dim=1)
        expected = {row} if name == table else set()
        assert set(torch.nonzero(bad).flatten().tolist()) == expected  # only the row that was set bad


@pytest.mark.parametrize("backend", _BACKENDS)
def test_a_nan_history_row_is_named_for_simplex(backend, tmp_path):
    dm = InteractionsDataModule(num_users=120, num_items=60, batch_size=64, seed=2)
    dm.setup()
    extra = {"optimizer": "sgd", "lr": 0.05} if backend == "reference" else {}
    model = SimpleXModule(dm.num_users, dm.num_items, g=0.5, backend=backend, loss="ccl", **_SMALL, **extra)
    model.set_interactions(*dm.train_csr)
    history = model.histories()
    user = int(np.flatnonzero(np.diff(history.indptr) >= 3)[0])
    own = history.indices[history.indptr[user] : history.indptr[user + 1]]
    with torch.no_grad():
        model.item_embedding.weight[int(own[0])] = float("nan")
    users, items = torch.tensor([user]), torch.tensor([int(own[1])])
    negatives = torch.tensor([[j for j in range(dm.num_items) if j not in set(own.tolist())][:4]])
    if backend == "fused":
        with pytest.raises(FloatingPointError, match=f"item row {int(own[0])} \\(in user {user}'s history\\)"):
            model.fused_step(users, items, 0.05, negatives=negatives, num_threads=1)
    else:
        from lightning_sdp.models.simplex.backends import ReferenceBackend

        model.generator.manual_seed(0)
        with pytest.raises(FloatingPointError, match=f"item row {int(own[0])} \\(in user {user}'s history\\)"):
            ReferenceBackend().training_step(model, users, items)


@pytest.mark.numba
def test_the_fused_step_stops_at_the_first_bad_sample_and_applies_the_earlier_ones():
    dm = InteractionsDataModule(num_users=50, num_items=40, batch_size=64, seed=3)
    dm.setup()
    model = SimpleXModule(dm.num_users, dm.num_items, loss="softmax", grad_clip=0.1, **_SMALL)
    model.set_interactions(*dm.train_csr)
    with torch.no_grad():
        model.item_embedding.weight[39] = float("inf")
    before = model.item_embedding.weight.detach().clone()
    users, items = torch.tensor([0, 1, 2]), torch.tensor([5, 39, 6])
    negatives = torch.tensor([[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21]])
    with pytest.raises(FloatingPointError, match=r"position 1 of the batch read .* from item row 39 \(its positive\)"):
        model.fused_step(users, items, 0.1, negatives=negatives, num_threads=1)
    after = model.item_embedding.weight.detach()
    assert not torch.equal(after[[5, 10]], before[[5, 10]])  # sample 0 was applied
    assert torch.equal(after[[6, 14, 18]], before[[6, 14, 18]])  # samples 1 and 2 were not


def _ranked_model(seed: int = 0) -> SimpleXModule:
    model = SimpleXModule(30, 20, backend="reference", **_SMALL)
    indptr = np.arange(0, 31, dtype=np.int64)
    model.set_interactions(indptr, np.arange(30, dtype=np.int64) % 20)
    return model


def test_recommend_never_ranks_a_nan_item_first_and_says_which():
    model = _ranked_model()
    with torch.no_grad():
        model.item_embedding.weight[13] = float("nan")
    with pytest.raises(ValueError, match=r"1 item row\(s\) hold NaN or infinite values \(e.g. \[13\]\)"):
        model.recommend([0, 1], k=5)
    with pytest.raises(ValueError, match=r"\[13\]"):
        model.similar_items([2], k=3)
    with pytest.raises(ValueError, match=r"\[13\]"):
        model.recommend_for_new_user([1, 2], k=3)


def test_recommend_refuses_a_nan_user_vector_and_says_whose():
    model = _ranked_model()
    with torch.no_grad():
        model.user_embedding.weight[4] = float("inf")
    with pytest.raises(ValueError, match=r"user vector\(s\) hold NaN or infinite values \(e.g. \[4\]\)"):
        model.recommend([0, 4], k=5)
    assert model.recommend([0, 5], k=5).items.shape == (2, 5)  # other users are served


def test_evaluation_refuses_nan_scores(tmp_path):
    dm = InteractionsDataModule(num_users=80, num_items=40, batch_size=64, eval_batch_size=32, seed=4)
    model = SimpleXModule(backend="reference", **_SMALL)
    trainer = _trainer(tmp_path)
    trainer.fit(model, dm)
    with torch.no_grad():
        model.item_embedding.weight[2] = float("nan")
    with pytest.raises(ValueError, match=r"item row\(s\) hold NaN or infinite values \(e.g. \[2\]\)"):
        trainer.test(model, dm)
