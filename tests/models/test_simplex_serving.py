"""Serving a SimpleX model: every known interaction excluded, the final fit on all data, similar items, candidate
subsets, new users folded in, and per-interaction weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer

from lightning_sdp.datamodules.interactions import InteractionsDataModule, read_id_table
from lightning_sdp.kernels import cf_reference as ref
from lightning_sdp.models.simplex import SimpleXModule

_SMALL = {"num_negatives": 8, "negative_weight": 10.0, "margin": 0.5, "dim": 16, "backend": "reference"}


def _trainer(tmp_path: Path, **kwargs) -> Trainer:
    options = {
        "max_epochs": 1,
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "default_root_dir": str(tmp_path),
        **kwargs,
    }
    return Trainer(**options)


def _write_csv(path: Path, seed: int = 0, users: int = 80, items: int = 60, per_user: int = 12, counts: bool = False):
    """A ``user,item[,count]`` CSV with sparse raw ids; returns the raw ids of each user's rows."""
    rng = np.random.default_rng(seed)
    raw_users = 10**9 + 17 * np.arange(users)
    raw_items = 500 + 11 * np.arange(items)
    lines = ["user,item,plays" if counts else "user,item"]
    rows: dict[int, set[int]] = {}
    for u in raw_users:
        chosen = rng.choice(raw_items, per_user, replace=False)
        rows[int(u)] = {int(i) for i in chosen}
        for i in chosen:
            lines.append(f"{u},{i},{int(rng.integers(1, 500))}" if counts else f"{u},{i}")
    path.write_text("\n".join(lines) + "\n")
    return rows


# ---------------------------------------------------------------------------------------------- known interactions
@pytest.mark.parametrize("backend", ["reference", pytest.param("fused", marks=pytest.mark.numba)])
def test_recommend_never_returns_an_interaction_of_the_csv_after_fit_and_after_loading(tmp_path, backend):
    path = tmp_path / "interactions.csv"
    rows = _write_csv(path)
    dm = InteractionsDataModule(str(path), batch_size=128, eval_batch_size=32, val_fraction=0.2, test_fraction=0.3)
    model = SimpleXModule(**{**_SMALL, "backend": backend})
    trainer = _trainer(tmp_path)
    trainer.fit(model, dm)
    users = list(rows)
    k = 60 - 12  # every item but the user's own: any known item would have to come back
    ckpt = tmp_path / "model.ckpt"
    trainer.save_checkpoint(ckpt)
    for served in (model, SimpleXModule.load_from_checkpoint(ckpt)):
        items = served.recommend(users, k=k, raw_ids=True).items
        returned_known = sum(len(rows[u] & set(items[r].tolist())) for r, u in enumerate(users))
        assert returned_known == 0
        assert (items >= 0).all()
    # asking for the known items back still works
    everything = model.recommend(users[:2], k=60, raw_ids=True, exclude_known=False).items
    assert rows[users[0]] <= set(everything[0].tolist())


def test_known_interactions_are_those_of_every_split(tmp_path):
    path = tmp_path / "interactions.csv"
    _write_csv(path, seed=1)
    dm = InteractionsDataModule(str(path), val_fraction=0.2, test_fraction=0.3)
    dm.setup()
    pairs = read_id_table(path)
    assert len(dm.known_csr.indices) == len(pairs.users)
    counts = [len(dm.train_csr.indices), len(dm.val_csr.indices), len(dm.test_csr.indices)]
    assert sum(counts) == len(pairs.users) and min(counts) > 0
    # without a datamodule the model falls back to its training interactions
    model = SimpleXModule(dm.num_users, dm.num_items, **_SMALL)
    model.set_interactions(*dm.train_csr)
    held_out = model.recommend(torch.arange(dm.num_users), k=60 - 12 + 4, exclude_known=True).items
    assert any(
        set(held_out[u].tolist()) & set(dm.test_csr.indices[dm.test_csr.indptr[u] : dm.test_csr.indptr[u + 1]])
        for u in range(dm.num_users)
    )
    model.set_known(*dm.known_csr)
    served = model.recommend(torch.arange(dm.num_users), k=60 - 12, exclude_known=True).items
    for u in range(dm.num_users):
        assert not set(served[u].tolist()) & set(
            dm.known_csr.indices[dm.known_csr.indptr[u] : dm.known_csr.indptr[u + 1]]
        )


# ---------------------------------------------------------------------------------------------- the final fit on all
def test_train_on_all_trains_on_every_interaction_with_the_split_ids(tmp_path):
    path = tmp_path / "interactions.csv"
    _write_csv(path, seed=2)
    split = InteractionsDataModule(str(path), val_fraction=0.1, test_fraction=0.2, batch_size=64)
    split.setup()
    final = InteractionsDataModule(str(path), val_fraction=0.1, test_fraction=0.2, batch_size=64, train_on_all=True)
    final.setup()
    assert (final.num_users, final.num_items) == (split.num_users, split.num_items)
    np.testing.assert_array_equal(final.raw_item_ids, split.raw_item_ids)
    np.testing.assert_array_equal(final.train_csr.indptr, split.known_csr.indptr)
    np.testing.assert_array_equal(final.train_csr.indices, split.known_csr.indices)
    assert len(final.val_csr.indices) == 0 and len(final.test_csr.indices) == 0
    assert final.val_dataloader() == []
    with pytest.raises(RuntimeError, match="holds nothing out"):
        final.test_dataloader()
    seen = sum(len(batch[0]) for batch in final.train_dataloader())
    assert seen == len(read_id_table(path).users)
    model = SimpleXModule(**_SMALL)
    _trainer(tmp_path).fit(model, final)  # no validation, no error
    assert model.num_items == split.num_items


# ---------------------------------------------------------------------------------------------- plain-torch references
def _random_model(seed: int, g: float = 1.0, loss: str = "ccl", num_users: int = 30, num_items: int = 70):
    model = SimpleXModule(num_users, num_items, g=g, loss=loss, max_history=num_items, seed=seed, **_SMALL)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.user_embedding.weight.copy_(torch.randn(num_users, 16, generator=gen))
        model.item_embedding.weight.copy_(torch.randn(num_items, 16, generator=gen))
        model.aggregator.copy_(torch.eye(16) + 0.3 * torch.randn(16, 16, generator=gen))
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 10, num_users)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    indices = np.concatenate([np.sort(rng.choice(num_items, c, replace=False)) for c in counts]).astype(np.int64)
    model.set_interactions(indptr, indices)
    return model


@pytest.mark.parametrize("seed", [0, 1])
def test_similar_items_equal_plain_torch_cosine_neighbours(seed):
    model = _random_model(seed)
    table = model.item_embedding.weight.detach()
    queries = [3, 0, 69, 3]
    got = model.similar_items(queries, k=7, item_chunk=9)
    normalized = table / table.norm(dim=1, keepdim=True)
    cosine = normalized[queries] @ normalized.T
    cosine[torch.arange(4), torch.tensor(queries)] = -float("inf")
    want = cosine.topk(7, dim=1)
    assert torch.equal(got.items, want.indices)
    torch.testing.assert_close(got.scores, want.values)
    assert not (got.items == torch.tensor(queries)[:, None]).any()
    with pytest.raises(ValueError, match="k <= 69"):
        model.similar_items([0], k=70)


def test_recommend_within_a_subset_equals_plain_torch_restricted_ranking():
    model = _random_model(2, g=0.7)
    users = torch.tensor([0, 4, 29])
    subset = torch.tensor([65, 3, 8, 8, 21, 40, 41, 42, 50, 11, 60, 1])
    got = model.recommend(users, k=4, items=subset, item_chunk=5)
    scores = model.score(users)
    allowed = torch.zeros(70, dtype=torch.bool)
    allowed[subset] = True
    history = model.histories()
    for row, u in enumerate(users.tolist()):
        scores[
            row, torch.from_numpy(history.train_indices[history.train_indptr[u] : history.train_indptr[u + 1]])
        ] = -float("inf")
    scores[:, ~allowed] = -float("inf")
    want = scores.topk(4, dim=1)
    assert torch.equal(got.items, want.indices)
    torch.testing.assert_close(got.scores, want.values)
    assert set(got.items.flatten().tolist()) <= set(subset.tolist())
    with pytest.raises(ValueError, match=r"item ids must be rows in \[0, 70\)"):
        model.recommend(users, k=2, items=[1, 70])
    with pytest.raises(ValueError, match="candidate items"):
        model.recommend(users, k=12, items=subset)


def _fold_in_objective(model: SimpleXModule, e: torch.Tensor, items: list[int]) -> torch.Tensor:
    """The fold-in loss written out in plain torch, one item at a time (mean aggregator, all items in history)."""
    c = model.config
    table = model.item_embedding.weight.detach()
    p = e
    if c.g < 1:
        h = table[items].mean(0)
        p = c.g * e + (1 - c.g) * (model.aggregator.detach() @ h)
    cos = torch.stack([torch.dot(p, table[j]) / (p.norm() * table[j].norm()) for j in range(model.num_items)])
    others = [j for j in range(model.num_items) if j not in items]
    terms = []
    for i in items:
        if c.loss_name == "softmax":
            denominator = (
                torch.exp(cos[i] / c.temperature) + c.num_negatives * torch.exp(cos[others] / c.temperature).mean()
            )
            terms.append(-torch.log(torch.exp(cos[i] / c.temperature) / denominator))
        else:
            terms.append(torch.relu(1 - cos[i]) + c.negative_weight * torch.relu(cos[others] - c.margin).mean())
    return torch.stack(terms).mean()


@pytest.mark.parametrize(("g", "loss"), [(1.0, "ccl"), (0.6, "ccl"), (1.0, "softmax"), (0.6, "softmax")])
def test_fold_in_minimises_the_plain_torch_objective_and_recommends_by_it(g, loss):
    model = _random_model(3, g=g, loss=loss)
    items = [2, 9, 33, 47]
    vector = model.fold_in(items)
    # recover the row e from p = g e + (1 - g) V h and check that it is a minimum of the written-out objective
    table = model.item_embedding.weight.detach()
    history_part = (1 - g) * (model.aggregator.detach() @ table[items].mean(0)) if g < 1 else 0.0
    e = ((vector - history_part) / g).double().requires_grad_(True)
    objective = _fold_in_objective(model, e.float(), items)
    if loss == "softmax":  # smooth: a minimum has no gradient (CCL's hinges have kinks; the checks below hold)
        (grad,) = torch.autograd.grad(objective, e)
        assert float(grad.norm()) < 1e-3 * max(1.0, float(objective))
    start = (
        F.normalize(F.normalize(table[items], dim=1).mean(0), dim=0) * model.user_embedding.weight.norm(dim=1).median()
    )
    assert float(objective) < float(_fold_in_objective(model, start, items)) - 1e-4
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):  # nearby rows are no better
        nearby = e.detach().float() + 0.05 * e.detach().float().norm() * torch.randn(16, generator=gen)
        assert float(objective) <= float(_fold_in_objective(model, nearby, items)) + 1e-6
    # the recommendations rank the items by the cosine of that vector, the user's items left out
    got = model.recommend_for_new_user(items, k=10)
    cosine = F.normalize(vector, dim=0) @ F.normalize(table, dim=1).T
    cosine[items] = -float("inf")
    want = cosine.topk(10)
    assert torch.equal(got.items, want.indices)
    torch.testing.assert_close(got.scores, want.values)
    subset = model.recommend_for_new_user(items, k=3, candidates=[1, 2, 5, 7, 60])
    assert set(subset.items.tolist()) <= {1, 5, 7, 60}


def test_fold_in_finds_a_trained_users_own_recommendations(tmp_path):
    dm = InteractionsDataModule(num_users=400, num_items=150, batch_size=256, val_fraction=0.0, seed=3)
    model = SimpleXModule(dim=16, num_negatives=16, backend="reference", optimizer="adam", lr=0.02, loss="softmax")
    _trainer(tmp_path, max_epochs=8, limit_val_batches=0).fit(model, dm)
    train = dm.train_csr
    overlaps = []
    for u in range(0, 400, 20):
        own = train.indices[train.indptr[u] : train.indptr[u + 1]]
        trained = set(model.recommend([u], k=10, known=train).items[0].tolist())
        folded = set(model.recommend_for_new_user(own, k=10).items.tolist())
        overlaps.append(len(trained & folded) / 10)
    # the folded user lands near where training put the user: random top-10 lists would share 0.07 of their items
    assert np.mean(overlaps) > 0.3


def test_serving_errors_name_the_problem():
    model = _random_model(4)
    with pytest.raises(ValueError, match="at least one item"):
        model.fold_in([])
    with pytest.raises(ValueError, match="no raw ids"):
        model.similar_items([1], raw_ids=True)
    with pytest.raises(ValueError, match=r"rows in \[0, 70\)"):
        model.similar_items([70])


def test_raw_ids_work_for_similar_items_subsets_and_new_users(tmp_path):
    path = tmp_path / "interactions.csv"
    rows = _write_csv(path, seed=5)
    dm = InteractionsDataModule(str(path), batch_size=128, eval_batch_size=32)
    model = SimpleXModule(**_SMALL)
    _trainer(tmp_path).fit(model, dm)
    raw_items = dm.raw_item_ids
    similar = model.similar_items([int(raw_items[4])], k=3, raw_ids=True)
    assert torch.equal(similar.items, torch.from_numpy(raw_items)[model.similar_items([4], k=3).items])
    user = next(iter(rows))
    subset = [int(i) for i in raw_items[:20]]
    within = model.recommend([user], k=3, items=subset, raw_ids=True).items
    assert set(within[0].tolist()) <= set(subset) and not set(within[0].tolist()) & rows[user]
    new = model.recommend_for_new_user(sorted(rows[user])[:5], k=4, raw_ids=True)
    assert set(new.items.tolist()) <= set(raw_items.tolist()) and not set(new.items.tolist()) & set(
        sorted(rows[user])[:5]
    )
    with pytest.raises(ValueError, match="not in the training data"):
        model.recommend_for_new_user([3], raw_ids=True)


# ---------------------------------------------------------------------------------------------- weights
def test_weight_column_gives_log_counts_of_mean_one_in_each_batch(tmp_path):
    path = tmp_path / "plays.csv"
    path.write_text("user,item,plays\n1,10,1\n1,11,9\n2,10,99\n2,12,4\n3,11,2\n3,12,7\n3,10,1\n")
    dm = InteractionsDataModule(str(path), weight_column="plays", train_on_all=True, batch_size=3)
    dm.setup()
    indptr, indices = dm.train_csr
    plays = {(1, 10): 1, (1, 11): 9, (2, 10): 99, (2, 12): 4, (3, 11): 2, (3, 12): 7, (3, 10): 1}
    users = np.repeat(np.arange(3), np.diff(indptr))
    raw = np.log1p(
        [plays[(int(dm.raw_user_ids[u]), int(dm.raw_item_ids[i]))] for u, i in zip(users, indices, strict=True)]
    )
    np.testing.assert_allclose(dm.train_weights, raw / raw.mean(), rtol=1e-6)
    assert abs(float(dm.train_weights.mean()) - 1.0) < 1e-6
    batches = list(dm.train_dataloader())
    assert all(len(b) == 3 for b in batches)
    seen = {(int(u), int(i)): float(w) for b in batches for u, i, w in zip(*b, strict=True)}
    for u, i, w in zip(users, indices, dm.train_weights, strict=True):
        assert seen[(int(u), int(i))] == pytest.approx(float(w))
    # the same by column index; a bad value or a missing column is named
    by_index = InteractionsDataModule(str(path), weight_column=2, train_on_all=True)
    by_index.setup()
    np.testing.assert_array_equal(by_index.train_weights, dm.train_weights)
    bad = tmp_path / "bad.csv"
    bad.write_text("user,item,plays\n1,10,3\n1,11,0\n")
    with pytest.raises(ValueError, match=r"bad.csv:3: the weight '0'"):
        InteractionsDataModule(str(bad), weight_column="plays").setup()
    with pytest.raises(ValueError, match="no column 'count'"):
        InteractionsDataModule(str(path), weight_column="count").setup()
    with pytest.raises(ValueError, match="LightGCN folders and synthetic data have no weights"):
        InteractionsDataModule(None, weight_column=2).setup()


def test_a_weight_multiplies_the_samples_loss_in_the_reference():
    model = _random_model(6, g=0.7)
    users, items = torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7])
    negatives = torch.tensor([[10, 11], [12, 13], [14, 15]])
    weights = torch.tensor([0.5, 2.0, 1.25])
    _, plain = model.reference_loss(users, items, negatives, reduction="sum")
    objective, weighted = model.reference_loss(users, items, negatives, reduction="sum", weights=weights)
    torch.testing.assert_close(weighted, plain * weights)
    torch.testing.assert_close(objective, (plain * weights).sum())


@pytest.mark.numba
@pytest.mark.parametrize(("loss", "grad_clip"), [("ccl", None), ("softmax", 0.05), ("ccl", 0.05)])
@pytest.mark.parametrize("g", [1.0, 0.7])
def test_fused_weighted_step_equals_the_weighted_reference_gradient(loss, grad_clip, g):
    from lightning_sdp.kernels import cf_numba
    from tests.kernels.test_cf_kernels import _fused, _problem

    problem = _problem(81 + int(10 * g))
    user_emb, item_emb, V, users, items, negatives, indptr, indices = problem
    weights = np.array([0.4, 2.5, 1.3], np.float32)
    tensors = {k: torch.tensor(a, requires_grad=True) for k, a in (("user", user_emb), ("item", item_emb), ("V", V))}
    objective, per_sample = ref.simplex_loss(
        tensors["user"],
        tensors["item"],
        tensors["V"],
        torch.tensor(users),
        torch.tensor(items),
        torch.tensor(negatives),
        g,
        0.1,
        3.0,
        ref.padded_history(indptr, indices),
        weight_decay=0.01,
        reduction="sum",
        loss=loss,
        temperature=0.2,
        grad_clip=grad_clip,
        sample_weight=torch.from_numpy(weights),
    )
    objective.backward()
    lr = 0.05
    options = {"loss": cf_numba.LOSSES[loss], "temperature": 0.2, "grad_clip": grad_clip or 0.0}
    ue, ie, v, losses, _ = _fused(*problem, g=g, margin=0.1, w=3.0, lr=lr, wd=0.01, weights=weights, **options)
    np.testing.assert_allclose(losses, per_sample.detach().numpy(), rtol=1e-5, atol=1e-6)
    for name, got in (("user", ue), ("item", ie), ("V", v)):
        start = {"user": user_emb, "item": item_emb, "V": V}[name]
        grad = tensors[name].grad
        step = 0.0 if grad is None else lr * grad.numpy()
        np.testing.assert_allclose(got, start - step, rtol=1e-5, atol=1e-6)
    unweighted = _fused(*problem, g=g, margin=0.1, w=3.0, lr=lr, wd=0.01, **options)
    assert np.abs(unweighted[1] - ie).max() > 1e-4  # the weights mattered


@pytest.mark.parametrize("backend", ["reference", pytest.param("fused", marks=pytest.mark.numba)])
def test_a_weighted_csv_trains_through_the_trainer(tmp_path, backend):
    path = tmp_path / "plays.csv"
    _write_csv(path, seed=7, counts=True)
    dm = InteractionsDataModule(str(path), weight_column="plays", batch_size=100, eval_batch_size=32)
    model = SimpleXModule(**{**_SMALL, "backend": backend})
    trainer = _trainer(tmp_path)
    trainer.fit(model, dm)
    assert trainer.global_step > 0 and np.isfinite(float(trainer.callback_metrics["val/recall@20"]))


# ---------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"margin": "0.9"}, TypeError, "SimpleXModule: margin must be a number, got '0.9' (str)."),
        ({"num_negatives": "64"}, TypeError, "SimpleXModule: num_negatives must be an int, got '64' (str)."),
        ({"negatives_exclude_positive": 1}, TypeError, "negatives_exclude_positive must be a bool"),
        ({"backend": "fuse"}, ValueError, "SimpleXModule: backend must be one of 'fused', 'reference', got 'fuse'."),
        ({"grad_clip_mode": "buffer"}, ValueError, "grad_clip_mode must be one of 'sample', 'row_buffer'"),
        ({"loss": "bpr"}, ValueError, "loss must be one of 'ccl', 'softmax', 'auto', got 'bpr'."),
        ({"num_negatives": 0}, ValueError, "num_negatives and k must be positive"),
    ],
)
def test_options_are_checked_by_the_one_checker_naming_the_option(kwargs, error, words):
    with pytest.raises(error) as info:
        SimpleXModule(**kwargs)
    assert words in str(info.value)


# ---------------------------------------------------------------------------------------------- SVD warm start
def test_svd_factors_are_the_truncated_svd_of_the_normalised_matrix():
    from lightning_sdp.models.simplex.svd_init import svd_factors

    rng = np.random.default_rng(0)
    dense = (rng.random((40, 30)) < 0.2).astype(np.float64)
    dense[:, 29] = 0.0  # an item nobody has
    dense[0] = 0.0  # a user without items
    indptr = np.concatenate([[0], np.cumsum(dense.sum(1))]).astype(np.int64)
    indices = np.nonzero(dense)[1].astype(np.int64)
    users, items = svd_factors(indptr, indices, 30, 8, seed=0)
    du, di = dense.sum(1, keepdims=True), dense.sum(0, keepdims=True)
    normalised = dense / np.sqrt(np.where(du > 0, du, 1)) / np.sqrt(np.where(di > 0, di, 1))
    u, s, vt = np.linalg.svd(normalised)
    best = (u[:, :8] * s[:8]) @ vt[:8]  # the best rank-8 approximation (Eckart-Young)
    got = (users @ items.T).double().numpy()
    # a randomized SVD: its error is within a few percent of the best rank-8 approximation's
    assert np.linalg.norm(normalised - got) <= 1.03 * np.linalg.norm(normalised - best)
    assert np.linalg.norm(normalised - got) < 0.9 * np.linalg.norm(normalised)
    assert not users[0].any() and not items[29].any()  # nothing to learn from: zero rows


def test_init_svd_warm_starts_the_rows_at_the_normal_inits_norm(tmp_path):
    from lightning_sdp.models.simplex.svd_init import svd_factors

    dm = InteractionsDataModule(num_users=120, num_items=80, batch_size=256, seed=5)
    dm.setup()
    model = SimpleXModule(dm.num_users, dm.num_items, init="svd", **{**_SMALL, "backend": "reference"})
    normal = model.item_embedding.weight.detach().clone()
    model.set_interactions(*dm.train_csr)
    users, items = svd_factors(*dm.train_csr, dm.num_items, 16, 0)
    table = model.item_embedding.weight.detach()
    has = items.norm(dim=1) > 0
    torch.testing.assert_close(F.normalize(table[has], dim=1), F.normalize(items[has], dim=1))
    torch.testing.assert_close(table[has].norm(dim=1), torch.full((int(has.sum()),), 1e-4 * 4.0))  # Adam's init_std
    assert torch.equal(table[~has], normal[~has])  # items without interactions keep their normal start
    ckpt = tmp_path / "svd.ckpt"
    trainer = _trainer(tmp_path)
    trainer.fit(model, dm)
    trainer.save_checkpoint(ckpt)
    loaded = SimpleXModule.load_from_checkpoint(ckpt)
    assert torch.equal(loaded.item_embedding.weight, model.item_embedding.weight)  # the warm start did not overwrite


def test_the_fused_backends_optimiser_only_carries_the_rates():
    from lightning_sdp.models.simplex.backends import LearningRates

    model = SimpleXModule(20, 10, dim=8, num_negatives=4, lr=0.3)
    opt = model._optimizer()
    assert isinstance(opt, LearningRates) and [g["lr"] for g in opt.param_groups] == [0.3, 0.3]
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # even with gradients, its step changes nothing: the kernel updated the rows
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / 10)
    opt.step()
    schedule.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.27)
