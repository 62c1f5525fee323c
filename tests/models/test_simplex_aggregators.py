"""SimpleXModule as published: attention aggregators, dropout, streamed evaluation, the linear schedule, the split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_sdp.datamodules.interactions import InteractionsDataModule
from lightning_sdp.metrics import NDCGAtK, RecallAtK, csr_rows_mask, topk_hits
from lightning_sdp.models.simplex import SimpleXConfig, SimpleXModule, batch_csr, rank_and_score
from lightning_sdp.schedules import LinearDecay

_SMALL = {"num_negatives": 8, "negative_weight": 10.0, "margin": 0.5, "dim": 16, "max_history": 20}


def _dm() -> InteractionsDataModule:
    dm = InteractionsDataModule(num_users=120, num_items=80, batch_size=256, eval_batch_size=64, seed=0)
    dm.setup()
    return dm


def _disjoint_batch(model: SimpleXModule, num_items: int, n: int = 8) -> tuple[torch.Tensor, ...]:
    """Three positives whose users, histories, positives and negatives share no row (per-sample == batch SGD)."""
    history = model.histories()
    users, items, used = [], [], set()
    for u in range(model.num_users):
        h = set(history.indices[history.indptr[u] : history.indptr[u + 1]].tolist())
        if len(h) > 1 and not h & used and len(users) < 3:
            users.append(u)
            items.append(sorted(h)[0])
            used |= h
    free = [i for i in range(num_items) if i not in used]
    return torch.tensor(users), torch.tensor(items), torch.tensor(free[: 3 * n]).reshape(3, n)


@pytest.mark.numba
@pytest.mark.parametrize("aggregator", ["user_attention", "self_attention"])
@pytest.mark.parametrize("dropout", [0.0, 0.4])
def test_fused_step_equals_reference_step_with_attention_and_dropout(aggregator, dropout):
    dm = _dm()
    model = SimpleXModule(dm.num_users, dm.num_items, g=0.5, aggregator=aggregator, dropout=dropout, **_SMALL)
    model.set_interactions(*dm.train_csr)
    users, items, negatives = _disjoint_batch(model, dm.num_items)
    masks = None
    if dropout > 0:
        masks = (torch.rand(3, 16, generator=torch.Generator().manual_seed(1)) >= dropout) / (1 - dropout)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    objective, per_sample = model.reference_loss(users, items, negatives, reduction="sum", dropout_mask=masks)
    objective.backward()
    lr = 0.1
    losses = model.fused_step(users, items, lr, negatives=negatives, num_threads=1, dropout_masks=masks)
    torch.testing.assert_close(losses, per_sample.detach(), rtol=1e-5, atol=1e-6)
    names = [name for name, _ in model.named_parameters()]
    assert "attention_weight" in names and "attention_bias" in names
    assert ("attention_query" in names) == (aggregator == "self_attention")
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(p.detach(), before[name] - lr * grad, rtol=1e-5, atol=1e-6, msg=name)
    assert (model.attention_weight - before["attention_weight"]).abs().max() > 1e-7


def test_attention_initialisation_follows_the_official_code():
    d = 64
    model = SimpleXModule(10, 20, dim=d, g=0.8, aggregator="self_attention")
    # xavier-normal: std sqrt(2 / (fan_in + fan_out)); W_q is (d x 1); biases start at 0; V starts at the identity
    assert model.attention_weight.std().item() == pytest.approx((2 / (2 * d)) ** 0.5, rel=0.05)
    assert model.attention_query.std().item() == pytest.approx((2 / (d + 1)) ** 0.5, rel=0.2)
    assert not model.attention_bias.any()
    torch.testing.assert_close(model.aggregator.detach(), torch.eye(d))
    # the tables do not depend on the aggregator (attention parameters have their own generator)
    mean = SimpleXModule(10, 20, dim=d, g=0.8)
    torch.testing.assert_close(mean.item_embedding.weight, model.item_embedding.weight, rtol=0, atol=0)
    assert not any(n.startswith("attention_") for n, _ in mean.named_parameters())


def test_reference_dropout_applies_only_in_training_and_keeps_the_stream_without_it():
    dm = _dm()
    users, items = next(iter(dm.train_dataloader()))
    losses, vectors = [], []
    for dropout in (0.0, 0.5):
        model = SimpleXModule(dm.num_users, dm.num_items, g=0.8, backend="reference", dropout=dropout, **_SMALL)
        model.set_interactions(*dm.train_csr)
        model.log = lambda *a, **k: None  # training_step outside a Trainer
        losses.append(model.training_step((users, items), 0))
        vectors.append(model.user_vectors(users[:5]))
        if dropout == 0.0:  # without dropout only the negatives are drawn: the random stream of earlier versions
            expected = torch.Generator().manual_seed(0)
            torch.randint(0, dm.num_items, (len(users), 8), generator=expected)
            assert torch.equal(model.generator.get_state(), expected.get_state())
    assert all(torch.isfinite(loss) for loss in losses)
    assert not torch.equal(losses[0], losses[1])  # the dropped coordinates changed the training loss
    torch.testing.assert_close(vectors[0], vectors[1])  # evaluation never drops


def _dense_scores(users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(users, dim=-1) @ torch.nn.functional.normalize(items, dim=-1).t()


@pytest.mark.parametrize("item_chunk", [7, 64, 1000])
def test_streamed_ranking_equals_dense_topk_hits(item_chunk):
    gen = torch.Generator().manual_seed(0)
    batch, num_items, d, k = 9, 50, 6, 5
    users, items = torch.randn(batch, d, generator=gen), torch.randn(num_items, d, generator=gen)
    rng = np.random.default_rng(0)
    known = [np.sort(rng.choice(num_items, rng.integers(0, 12), replace=False)) for _ in range(batch)]
    test = [np.sort(rng.choice(num_items, rng.integers(1, 8), replace=False)) for _ in range(batch)]
    test[0] = known[0][:2] if len(known[0]) >= 2 else test[0]  # held-out items that are also known never count

    def csr(rows):
        indptr = np.zeros(batch + 1, np.int64)
        np.cumsum([len(r) for r in rows], out=indptr[1:])
        return indptr, np.concatenate(rows).astype(np.int64)

    known_indptr, known_items = csr(known)
    test_indptr, test_items = csr(test)
    exclude = csr_rows_mask(known_indptr, known_items, np.arange(batch), num_items)
    target = csr_rows_mask(test_indptr, test_items, np.arange(batch), num_items)
    dense_hits, dense_relevant = topk_hits(_dense_scores(users, items), target, k, exclude)
    hits, relevant = rank_and_score(
        users,
        torch.nn.functional.normalize(items, dim=-1),
        torch.from_numpy(test_indptr),
        torch.from_numpy(test_items),
        torch.from_numpy(known_indptr),
        torch.from_numpy(known_items),
        k,
        item_chunk=item_chunk,
    )
    torch.testing.assert_close(hits, dense_hits)
    torch.testing.assert_close(relevant, dense_relevant)
    assert hits.any() and (relevant < torch.tensor([len(t) for t in test])).any()
    with pytest.raises(ValueError, match="offsets"):
        rank_and_score(
            users,
            items,
            torch.zeros(3, dtype=torch.long),
            torch.from_numpy(test_items),
            torch.from_numpy(known_indptr),
            torch.from_numpy(known_items),
            k,
        )


def test_evaluate_batch_masks_the_batch_known_items_and_falls_back_to_training_items():
    dm = _dm()
    model = SimpleXModule(dm.num_users, dm.num_items, g=0.8, **_SMALL)
    model.set_interactions(*dm.train_csr)
    batch = next(iter(dm.test_dataloader()))
    assert "known_indptr" in batch  # the datamodule names the items never to rank

    def score(b):
        recall, ndcg = RecallAtK(20), NDCGAtK(20)
        model.evaluate_batch(b, recall, ndcg)
        return recall.compute().item(), ndcg.compute().item()

    with_known = score(batch)
    # the same known items given as the training CSR (the fallback) give the same numbers when they are the same
    history = model.histories()
    own = {
        **batch,
        **dict(
            zip(
                ("known_indptr", "known_items"),
                batch_csr(history.train_indptr, history.train_indices, batch["users"]),
                strict=True,
            )
        ),
    }
    fallback = {key: v for key, v in batch.items() if not key.startswith("known_")}
    assert score(own) == pytest.approx(score(fallback), abs=0)
    # the test batch's known items also hold the validation items, so they differ from the training items only
    if not torch.equal(own["known_items"], batch["known_items"]):
        assert with_known != score(fallback)
    # nothing known: training items are ranked too and take top slots, so recall cannot be the same
    empty = {
        **batch,
        "known_indptr": torch.zeros_like(batch["known_indptr"]),
        "known_items": torch.zeros(0, dtype=torch.long),
    }
    assert score(empty) != with_known


def test_linear_schedule_is_the_shared_linear_decay_with_the_same_numbers(tmp_path):
    from lightning.pytorch import Trainer

    model = SimpleXModule(lr=0.4, lr_schedule="linear", **_SMALL)
    trainer = Trainer(
        max_steps=10,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    model.trainer = trainer
    model._build_tables(5, 7)  # tables without a datamodule
    config = model.configure_optimizers()
    factor = config["lr_scheduler"]["scheduler"].lr_lambdas[0]
    assert isinstance(factor, LinearDecay)
    for step in (0, 1, 5, 9, 10, 11):
        assert factor(step) == max(0.0, 1.0 - step / 10)  # the former lambda, number for number


def test_config_validates_and_resolves_defaults():
    assert SimpleXConfig(backend="reference").optimizer_name == "adam"
    assert SimpleXConfig(backend="reference").learning_rate == 1e-4
    assert SimpleXConfig().initial_std == 0.1
    with pytest.raises(ValueError, match="dropout"):
        SimpleXModule(dropout=1.0)
    with pytest.raises(ValueError, match="aggregator must be"):
        SimpleXModule(aggregator="max")
    with pytest.raises(ValueError, match="use optimizer='sgd'"):
        SimpleXModule(backend="fused", optimizer="adam")
    model = SimpleXModule(backend="reference")
    assert model.backend.name == "reference" and model.automatic_optimization


def test_checkpoint_of_another_aggregator_fails_clearly():
    attention = SimpleXModule(10, 20, dim=8, g=0.8, aggregator="user_attention")
    checkpoint = {"state_dict": attention.state_dict()}
    with pytest.raises(ValueError, match="aggregator='mean'"):
        SimpleXModule(10, 20, dim=8, g=0.8).on_load_checkpoint(checkpoint)
    mean = {"state_dict": SimpleXModule(10, 20, dim=8, g=0.8).state_dict()}
    with pytest.raises(ValueError, match="attention_weight"):
        SimpleXModule(10, 20, dim=8, g=0.8, aggregator="self_attention").on_load_checkpoint(mean)
