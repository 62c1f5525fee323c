"""SimpleXModule.recommend / predict_step: brute-force reference, raw ids, trainer.predict, checkpoints, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_sdp.datamodules.interactions import InteractionsDataModule, merge_csr
from lightning_sdp.models.simplex import Recommendations, SimpleXModule, top_k_recommendations

_SMALL = {"num_negatives": 8, "negative_weight": 10.0, "margin": 0.5, "dim": 16, "backend": "reference"}


def _random_csr(rng: np.random.Generator, num_users: int, num_items: int, most: int) -> tuple[np.ndarray, np.ndarray]:
    counts = rng.integers(0, most + 1, num_users)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    indices = np.concatenate([np.sort(rng.choice(num_items, c, replace=False)) for c in counts]).astype(np.int64)
    return indptr, indices


def _random_model(seed: int, g: float, num_users: int = 40, num_items: int = 50) -> tuple[SimpleXModule, tuple]:
    """A model with fresh random tables, V and training interactions (no training needed)."""
    model = SimpleXModule(num_users, num_items, g=g, max_history=num_items, seed=seed, **_SMALL)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.user_embedding.weight.copy_(torch.randn(num_users, 16, generator=gen))
        model.item_embedding.weight.copy_(torch.randn(num_items, 16, generator=gen))
        model.aggregator.copy_(torch.randn(16, 16, generator=gen))
    csr = _random_csr(np.random.default_rng(seed), num_users, num_items, most=12)
    model.set_interactions(*csr)
    return model, csr


def _brute_force(
    model: SimpleXModule, users: list[int], k: int, csr: tuple | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: SimpleX user vectors (mean of all training items), cosine scores, mask known items, topk."""
    user_w, item_w, V = model.user_embedding.weight, model.item_embedding.weight, model.aggregator
    g = model.config.g
    indptr, indices = model.histories().train_indptr, model.histories().train_indices
    vectors = []
    for u in users:
        p = user_w[u]
        if g < 1:
            own = torch.from_numpy(indices[indptr[u] : indptr[u + 1]])
            h = item_w[own].mean(0) if len(own) else torch.zeros_like(p)
            p = g * p + (1 - g) * (V @ h)
        vectors.append(p)
    scores = F.normalize(torch.stack(vectors), dim=1) @ F.normalize(item_w, dim=1).t()
    if csr is not None:
        for row, u in enumerate(users):
            scores[row, torch.from_numpy(csr[1][csr[0][u] : csr[0][u + 1]])] = float("-inf")
    top = scores.topk(k, dim=1)
    return top.indices, top.values


@pytest.mark.parametrize(("g", "item_chunk"), [(1.0, 65_536), (0.8, 65_536), (0.8, 7)])
@pytest.mark.parametrize("seed", [0, 1])
def test_recommend_equals_brute_force_reference(g, item_chunk, seed):
    model, csr = _random_model(seed, g)
    users = [0, 3, 17, 39, 3]
    with torch.no_grad():
        got = model.recommend(users, k=8, item_chunk=item_chunk)
        want_items, want_scores = _brute_force(model, users, 8, csr)
        everything = model.recommend(np.array(users), k=50, exclude_known=False, item_chunk=item_chunk)
        all_items, _ = _brute_force(model, users, 50, None)
    assert isinstance(got, Recommendations) and got.items.shape == got.scores.shape == (5, 8)
    assert torch.equal(got.items, want_items)
    torch.testing.assert_close(got.scores, want_scores)
    assert (got.scores[:, :-1] >= got.scores[:, 1:]).all()
    for row, u in enumerate(users):  # no known item comes back
        assert not np.isin(got.items[row].numpy(), csr[1][csr[0][u] : csr[0][u + 1]]).any()
    assert torch.equal(everything.items, all_items)  # nothing masked: every item, best first


def test_scores_are_those_of_score_and_of_the_functional_core():
    model, _ = _random_model(2, 0.8)
    users = torch.tensor([1, 2, 30])
    items, scores = model.recommend(users, k=6)
    assert torch.equal(scores, model.score(users).gather(1, items))  # the same function, bit for bit
    core = top_k_recommendations(model.user_vectors(users), F.normalize(model.item_embedding.weight.detach(), dim=1), 6)
    assert torch.equal(core.items, model.recommend(users, k=6, exclude_known=False).items)
    single = model.recommend(30, k=6)  # one id: one row
    assert torch.equal(single.items, items[2:])


def test_known_overrides_the_training_interactions():
    model, csr = _random_model(3, 1.0)
    other = _random_csr(np.random.default_rng(99), 40, 50, most=20)
    users = [5, 6, 7]
    items, _ = model.recommend(users, k=10, known=other)
    want, _ = _brute_force(model, users, 10, other)
    assert torch.equal(items, want)
    both = merge_csr(csr, other)
    items, _ = model.recommend(users, k=10, known=(torch.from_numpy(both.indptr), torch.from_numpy(both.indices)))
    assert torch.equal(items, _brute_force(model, users, 10, both)[0])


def test_clear_errors():
    model, csr = _random_model(4, 1.0)
    with pytest.raises(ValueError, match=r"rows in \[0, 40\), got \[40, 99\]"):
        model.recommend([1, 40, 99])
    with pytest.raises(ValueError, match="k <= 50"):
        model.recommend([0], k=51, exclude_known=False)
    full = int(np.diff(csr[0]).argmax())
    with pytest.raises(ValueError, match=f"user {full} has only .* exclude_known=False"):
        model.recommend([0, full], k=50 - int(np.diff(csr[0]).max()) + 1)
    with pytest.raises(ValueError, match="positive int"):
        model.recommend([0], k=0)
    with pytest.raises(ValueError, match="integers"):
        model.recommend([0.5])
    with pytest.raises(ValueError, match="ignored"):
        model.recommend([0], known=csr, exclude_known=False)
    with pytest.raises(ValueError, match="41 offsets"):
        model.recommend([0], known=(csr[0][:-1], csr[1][: csr[0][-2]]))
    with pytest.raises(ValueError, match="no raw ids"):
        model.recommend([0], raw_ids=True)
    with pytest.raises(ValueError, match="fit it first"):
        SimpleXModule(**_SMALL).recommend([0])
    fresh = SimpleXModule(40, 50, **_SMALL)
    with pytest.raises(ValueError, match="set_interactions"):
        fresh.recommend([0])
    assert fresh.recommend([0], k=3, exclude_known=False).items.shape == (1, 3)
    with pytest.raises(ValueError, match="aggregate the training histories"):
        SimpleXModule(40, 50, g=0.8, **_SMALL).recommend([0], exclude_known=False)


def _trainer(tmp_path: Path) -> Trainer:
    return Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )


def test_trainer_predict_and_checkpoint_round_trip(tmp_path):
    dm = InteractionsDataModule(num_users=200, num_items=100, batch_size=512, eval_batch_size=64)
    model = SimpleXModule(g=0.8, **_SMALL)
    trainer = _trainer(tmp_path)
    trainer.fit(model, dm)
    users = torch.arange(200)
    expected = model.recommend(users, k=model.config.k)

    batches = trainer.predict(model, dataloaders=DataLoader(users, batch_size=64))
    assert len(batches) == 4 and all(isinstance(b, Recommendations) for b in batches)
    assert torch.equal(torch.cat([b.items for b in batches]), expected.items)
    torch.testing.assert_close(torch.cat([b.scores for b in batches]), expected.scores)
    model.predict_k = 5
    batches = trainer.predict(model, dataloaders=DataLoader(TensorDataset(users[:10]), batch_size=4))
    assert torch.equal(torch.cat([b.items for b in batches]), expected.items[:10, :5])

    # the datamodule's test batches exclude their own known items: training + validation
    batches = trainer.predict(model, dataloaders=dm.test_dataloader())
    test_users = torch.cat([b["users"] for b in dm.test_dataloader()])
    known = merge_csr(dm.train_csr, dm.val_csr)
    want = model.recommend(test_users, k=5, known=known)
    assert torch.equal(torch.cat([b.items for b in batches]), want.items)
    # the datamodule's own predict batches: every user, every interaction of the data excluded (as recommend does)
    batches = trainer.predict(model, datamodule=dm)
    want = model.recommend(users, k=5)
    assert torch.equal(want.items, model.recommend(users, k=5, known=dm.known_csr).items)
    assert torch.equal(torch.cat([b.items for b in batches]), want.items)

    ckpt = tmp_path / "model.ckpt"
    trainer.save_checkpoint(ckpt)
    loaded = SimpleXModule.load_from_checkpoint(ckpt)
    again = loaded.recommend(users, k=model.config.k)
    assert torch.equal(again.items, expected.items)
    torch.testing.assert_close(again.scores, expected.scores, rtol=0, atol=0)
    batches = _trainer(tmp_path).predict(loaded, dataloaders=DataLoader(users, batch_size=100))
    assert torch.equal(torch.cat([b.items for b in batches]), expected.items)


def test_raw_ids_of_a_csv_file_both_ways_and_through_a_checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    raw_users = 10**12 + 7 * np.arange(60)  # sparse ids, never rows
    raw_items = 5000 + 13 * np.arange(40)
    lines = ["user_id,item_id"]
    for u in raw_users:
        lines += [f"{u},{i}" for i in rng.choice(raw_items, 8, replace=False)]
    path = tmp_path / "ratings.csv"
    path.write_text("\n".join(lines) + "\n")
    dm = InteractionsDataModule(str(path), batch_size=128, eval_batch_size=32)
    model = SimpleXModule(**_SMALL)
    trainer = _trainer(tmp_path)
    trainer.fit(model, dm)

    asked = [int(raw_users[3]), int(raw_users[59])]
    mine = model.recommend(asked, k=5, raw_ids=True)
    rows = model.recommend([3, 59], k=5)
    assert torch.equal(mine.items, torch.from_numpy(raw_items)[rows.items])
    assert torch.equal(mine.scores, rows.scores)
    assert np.isin(mine.items.numpy(), raw_items).all()
    with pytest.raises(ValueError, match=r"not in the training data \(e.g. \[42\]\)"):
        model.recommend([asked[0], 42], raw_ids=True)
    with pytest.raises(ValueError, match="pass raw_ids=True"):
        model.recommend(asked)

    ckpt = tmp_path / "model.ckpt"
    trainer.save_checkpoint(ckpt)
    loaded = SimpleXModule.load_from_checkpoint(ckpt)
    assert torch.equal(loaded.raw_item_ids, torch.from_numpy(raw_items))
    assert torch.equal(loaded.recommend(asked, k=5, raw_ids=True).items, mine.items)
