"""Settings chosen from the training data (``lightning_sdp.models.simplex.auto``): the statistics, the rule, the module's
``"auto"`` arguments through a Trainer and a checkpoint, and the recipe's grid."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba", reason="the fused backend needs the cpu extra (numba)")

from lightning.pytorch import Trainer

from lightning_sdp.datamodules.interactions import InteractionsDataModule
from lightning_sdp.models.simplex import InteractionStats, SimpleXModule, auto_grid, auto_settings, choose_loss
from lightning_sdp.models.simplex.auto import CCL_GRID, SOFTMAX_GRAD_CLIP, SOFTMAX_GRID, SOFTMAX_MIN_DENSITY
from lightning_sdp.plugins.heat import HEATAccelerator
from lightning_sdp.recipes import fit_simplex_within_budget


def _random_csr(rng: np.random.Generator, users: int, items: int) -> tuple[np.ndarray, np.ndarray]:
    counts = rng.integers(1, min(12, items) + 1, users)
    indices = np.concatenate([np.sort(rng.choice(items, c, replace=False)) for c in counts]).astype(np.int64)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), indices


def _dense() -> InteractionsDataModule:  # 200 x 100, about 15% of the pairs
    return InteractionsDataModule(num_users=200, num_items=100, batch_size=256, eval_batch_size=64, seed=0)


def _sparse() -> InteractionsDataModule:  # 1,500 x 6,000 with 4 items per user: under 0.1% of the pairs
    return InteractionsDataModule(
        num_users=1500, num_items=6000, interactions_per_user=4, batch_size=1024, eval_batch_size=256, seed=0
    )


def test_statistics_match_a_direct_count() -> None:
    rng = np.random.default_rng()
    users, items = int(rng.integers(5, 40)), int(rng.integers(5, 30))
    indptr, indices = _random_csr(rng, users, items)
    stats = InteractionStats.from_csr(indptr, indices, items)
    n = len(indices)
    assert (stats.num_users, stats.num_items, stats.num_positives) == (users, items, n)
    assert stats.density == pytest.approx(n / (users * items))
    assert stats.positives_per_user == pytest.approx(n / users)
    assert stats.positives_per_item == pytest.approx(n / items)
    counts = np.bincount(indices, minlength=items).astype(float)
    gini = np.abs(counts[:, None] - counts[None, :]).sum() / (2 * items * counts.sum())  # mean difference / 2 mean
    assert stats.popularity_gini == pytest.approx(gini)
    with pytest.raises(ValueError, match="training interactions are empty"):
        InteractionStats.from_csr(np.zeros(3, np.int64), np.zeros(0, np.int64), 4)


def test_the_rule_splits_at_the_stated_density() -> None:
    def stats(density: float) -> InteractionStats:
        return InteractionStats(100, 100, int(density * 1e4), density, 1.0, 1.0, 0.5)

    below, at = stats(SOFTMAX_MIN_DENSITY * 0.99), stats(SOFTMAX_MIN_DENSITY)
    assert (choose_loss(below), choose_loss(at)) == ("ccl", "softmax")
    assert auto_settings(below) == {"loss": "ccl", "grad_clip": None}
    assert auto_settings(at) == {"loss": "softmax", "grad_clip": SOFTMAX_GRAD_CLIP}
    assert auto_settings(None) == {"loss": "ccl", "grad_clip": None}  # nothing known: the CCL defaults
    assert auto_grid(below) == CCL_GRID and auto_grid(at) == SOFTMAX_GRID
    auto_grid(at)["lr"].append(9.0)  # a copy: the module's grid stays as it is
    assert 9.0 not in SOFTMAX_GRID["lr"]


def _fit_one_step(model: SimpleXModule, dm: InteractionsDataModule, tmp_path) -> Trainer:
    trainer = Trainer(
        accelerator=HEATAccelerator(num_threads=1),
        devices=1,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, datamodule=dm)
    return trainer


def test_the_module_chooses_from_its_training_data_says_so_and_checkpoints_the_choice(tmp_path, monkeypatch) -> None:
    import lightning_sdp.models.simplex.module as module

    said: list[str] = []  # the rank-zero message itself: other tests may change the logging levels
    monkeypatch.setattr(module, "rank_zero_info", said.append)
    dense = SimpleXModule(num_negatives=8)
    trainer = _fit_one_step(dense, _dense(), tmp_path)
    assert (dense.config.loss, dense.config.grad_clip) == ("softmax", SOFTMAX_GRAD_CLIP)
    assert (dense.hparams.loss, dense.hparams.grad_clip) == ("softmax", SOFTMAX_GRAD_CLIP)
    assert len(said) == 1 and "loss='softmax'" in said[0] and "of all user-item pairs" in said[0]
    trainer.save_checkpoint(tmp_path / "dense.ckpt")
    restored = SimpleXModule.load_from_checkpoint(tmp_path / "dense.ckpt")
    assert (restored.config.loss, restored.config.grad_clip, restored.config.auto_fields) == ("softmax", 0.1, ())

    sparse = SimpleXModule(num_negatives=8)
    _fit_one_step(sparse, _sparse(), tmp_path)
    assert (sparse.hparams.loss, sparse.hparams.grad_clip) == ("ccl", None)


def test_what_the_user_gives_is_kept_and_grad_clip_follows_the_loss() -> None:
    dense = _dense()
    dense.setup("fit")
    sparse = _sparse()
    sparse.setup("fit")

    def chosen(data: InteractionsDataModule, **kwargs) -> tuple[str, float | None]:
        model = SimpleXModule(data.num_users, data.num_items, **kwargs)
        model.set_interactions(*data.train_csr)
        return model.config.loss, model.config.grad_clip

    assert chosen(dense, loss="ccl") == ("ccl", None)
    assert chosen(sparse, loss="softmax") == ("softmax", SOFTMAX_GRAD_CLIP)
    assert chosen(dense, grad_clip=None) == ("softmax", None)
    assert chosen(sparse, grad_clip=0.3) == ("ccl", 0.3)
    # an attention aggregator forms no per-sample gradients: "auto" does not clip there
    assert chosen(dense, g=0.8, aggregator="user_attention") == ("softmax", None)


def test_the_recipe_searches_the_grid_its_data_calls_for() -> None:
    kwargs = dict(budget_epochs=1, search_fraction=0.0, threads=1, batch_size=256)
    for data, grid, loss in ((_dense(), SOFTMAX_GRID, "softmax"), (_sparse(), CCL_GRID, "ccl")):
        fit = fit_simplex_within_budget(data, **kwargs)
        assert fit.grid == grid and fit.config["loss"] == loss and fit.model.config.loss == loss
        assert 0 < fit.data_stats["num_positives"] <= fit.train_positives  # the search's split (refit: + validation)
        assert any(f"loss={loss!r}" in note for note in fit.notes)
    given = fit_simplex_within_budget(_dense(), grid=CCL_GRID, **kwargs)
    assert given.config["loss"] == "ccl" and not any("grid chosen" in note for note in given.notes)
