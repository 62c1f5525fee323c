"""RecallAtK / NDCGAtK, their functional core and evaluate_ranking, against brute-force numpy and torchmetrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_sdp.metrics import NDCGAtK, RecallAtK, evaluate_ranking, ndcg_at_k, recall_at_k, topk_hits
from tests._distributed import run_distributed


def _brute_force(scores: np.ndarray, target: np.ndarray, exclude: np.ndarray, k: int) -> tuple[float, float]:
    recalls, ndcgs = [], []
    for s, t, e in zip(scores, target, exclude, strict=False):
        t = t & ~e
        if t.sum() == 0:
            continue
        ranked = [j for j in np.argsort(-s, kind="stable") if not e[j]][:k]
        hits = np.array([t[j] for j in ranked], dtype=float)
        recalls.append(hits.sum() / t.sum())
        dcg = sum(h / np.log2(r + 2) for r, h in enumerate(hits))
        idcg = sum(1 / np.log2(r + 2) for r in range(min(k, int(t.sum()))))
        ndcgs.append(dcg / idcg)
    return float(np.mean(recalls)), float(np.mean(ndcgs))


def _random_case(seed: int, users: int = 30, items: int = 50):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(users, items, generator=g) * 2 - 1  # cosine-like, many negative scores
    target = torch.rand(users, items, generator=g) < 0.1
    exclude = (torch.rand(users, items, generator=g) < 0.2) & ~target
    target[0] = False  # a user without test items is skipped
    return scores, target, exclude


@pytest.mark.parametrize("k", [1, 5, 20])
def test_metrics_match_brute_force_in_batches(k):
    scores, target, exclude = _random_case(k)
    recall, ndcg = RecallAtK(k), NDCGAtK(k)
    for lo in range(0, len(scores), 7):  # batches of users
        recall.update(scores[lo : lo + 7], target[lo : lo + 7], exclude[lo : lo + 7])
        ndcg.update(scores[lo : lo + 7], target[lo : lo + 7], exclude[lo : lo + 7])
    want_r, want_n = _brute_force(scores.numpy(), target.numpy(), exclude.numpy(), k)
    assert float(recall.compute()) == pytest.approx(want_r, rel=1e-5)
    assert float(ndcg.compute()) == pytest.approx(want_n, rel=1e-5)
    assert 0 < want_r < 1


def test_precomputed_topk_path_equals_dense_path():
    scores, target, exclude = _random_case(3)
    hits, n_rel = topk_hits(scores, target, 10, exclude)
    a, b = RecallAtK(10), NDCGAtK(10)
    a.update(topk_hits=hits, num_relevant=n_rel)
    b.update(topk_hits=hits, num_relevant=n_rel)
    c, d = RecallAtK(10), NDCGAtK(10)
    c.update(scores, target, exclude)
    d.update(scores, target, exclude)
    assert float(a.compute()) == float(c.compute())
    assert float(b.compute()) == float(d.compute())


def test_excluded_items_are_never_ranked():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.0]])
    target = torch.tensor([[False, False, True, True]])
    exclude = torch.tensor([[True, True, False, False]])
    recall = RecallAtK(2)
    recall.update(scores, target, exclude)
    assert float(recall.compute()) == 1.0
    recall2 = RecallAtK(2)
    recall2.update(scores, target)
    assert float(recall2.compute()) == 0.0


def test_against_torchmetrics_retrieval_on_positive_scores():
    from torchmetrics.retrieval import RetrievalNormalizedDCG, RetrievalRecall

    scores, target, _ = _random_case(11, users=12, items=25)
    shifted = scores + 2.0  # torchmetrics ignores hits with score <= 0
    keep = target.any(1)
    scores, shifted, target = scores[keep], shifted[keep], target[keep]
    indexes = torch.arange(len(scores)).unsqueeze(1).expand_as(scores)
    tm_r = RetrievalRecall(top_k=5)(shifted.flatten(), target.flatten(), indexes=indexes.flatten())
    tm_n = RetrievalNormalizedDCG(top_k=5)(shifted.flatten(), target.flatten(), indexes=indexes.flatten())
    recall, ndcg = RecallAtK(5), NDCGAtK(5)
    recall.update(scores, target)
    ndcg.update(scores, target)
    assert float(recall.compute()) == pytest.approx(float(tm_r), rel=1e-5)
    assert float(ndcg.compute()) == pytest.approx(float(tm_n), rel=1e-5)


def test_bad_input():
    with pytest.raises(ValueError, match="k must be positive"):
        RecallAtK(0)
    with pytest.raises(ValueError, match="num_users, num_items"):
        RecallAtK(5).update(torch.zeros(3, 4), torch.zeros(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="needs preds and target"):
        NDCGAtK(5).update(torch.zeros(3, 4))
    empty = RecallAtK(5)
    empty.update(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="test set is empty"):
        empty.compute()


def _ddp_worker(rank: int, world_size: int) -> tuple[float, float]:
    scores, target, exclude = _random_case(7)
    recall, ndcg = RecallAtK(5), NDCGAtK(5)
    rows = slice(rank, None, world_size)  # each rank sees other users, in uneven numbers of rows
    recall.update(scores[rows], target[rows], exclude[rows])
    ndcg.update(scores[rows], target[rows], exclude[rows])
    return float(recall.compute()), float(ndcg.compute())


@pytest.mark.slow
def test_metrics_are_exact_under_ddp():
    scores, target, exclude = _random_case(7)
    want = _brute_force(scores.numpy(), target.numpy(), exclude.numpy(), 5)
    results = run_distributed(_ddp_worker, 2)
    for r, n in results:
        assert r == pytest.approx(want[0], rel=1e-5)
        assert n == pytest.approx(want[1], rel=1e-5)


def test_csr_rows_mask_matches_a_python_loop():
    import numpy as np

    from lightning_sdp.metrics import csr_rows_mask

    rng = np.random.default_rng(0)
    counts = rng.integers(0, 6, size=30)
    indptr = np.concatenate([[0], np.cumsum(counts)])
    indices = np.concatenate([rng.choice(40, size=c, replace=False) for c in counts]).astype(np.int64)
    rows = rng.integers(0, 30, size=17)
    expected = torch.zeros(len(rows), 40, dtype=torch.bool)
    for i, u in enumerate(rows):
        for j in indices[indptr[u] : indptr[u + 1]]:
            expected[i, j] = True
    assert torch.equal(csr_rows_mask(indptr, indices, rows, 40), expected)


def test_topk_hits_takes_counts_from_the_caller_and_checks_their_shape():
    from lightning_sdp.metrics import topk_hits

    gen = torch.Generator().manual_seed(0)
    preds, target = torch.rand(6, 30, generator=gen), torch.rand(6, 30, generator=gen) < 0.2
    hits, counted = topk_hits(preds, target, 5)
    given = torch.arange(6)
    same_hits, passed = topk_hits(preds, target, 5, num_relevant=given)
    assert torch.equal(hits, same_hits) and passed is given
    with pytest.raises(ValueError, match="num_relevant"):
        topk_hits(preds, target, 5, num_relevant=counted[:3])


def test_functional_core_scores_each_user_as_brute_force_does() -> None:
    scores, target, exclude = _random_case(5)
    hits, n_rel = topk_hits(scores, target, 5, exclude)
    recall, ndcg = recall_at_k(hits, n_rel), ndcg_at_k(hits, n_rel)
    assert recall.dtype == ndcg.dtype == torch.float64 and recall.shape == ndcg.shape == (len(scores),)
    for user in range(len(scores)):
        if n_rel[user] == 0:
            assert recall[user] == 0.0 and ndcg[user] == 0.0
            continue
        one = slice(user, user + 1)
        want_r, want_n = _brute_force(scores[one].numpy(), target[one].numpy(), exclude[one].numpy(), 5)
        assert float(recall[user]) == pytest.approx(want_r, rel=1e-9)
        assert float(ndcg[user]) == pytest.approx(want_n, rel=1e-9)


def test_evaluate_ranking_of_a_perfect_scorer_is_one() -> None:
    known = (np.array([0, 1, 2]), np.array([0, 1]))
    target = (np.array([0, 1, 2]), np.array([2, 3]))
    perfect = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    recall, ndcg = evaluate_ranking(lambda users: perfect[users], known, target, 4, k=1)
    assert recall == pytest.approx(1.0) and ndcg == pytest.approx(1.0)
    recall, _ = evaluate_ranking(lambda users: -perfect[users], known, target, 4, k=1)
    assert recall == 0.0


def _random_csr(rng: np.random.Generator, users: int, items: int, per_user: int) -> tuple[np.ndarray, np.ndarray]:
    counts = rng.integers(0, per_user, users)
    indptr = np.concatenate([[0], np.cumsum(counts)])
    return indptr, rng.integers(0, items, int(indptr[-1]))  # duplicates and overlaps with other CSRs included


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_evaluate_ranking_equals_the_dense_metrics(seed: int) -> None:
    from lightning_sdp.metrics import csr_rows_mask

    rng = np.random.default_rng(seed)
    users, items = 70, 50
    known, target = _random_csr(rng, users, items, 12), _random_csr(rng, users, items, 6)
    scores = torch.from_numpy(rng.standard_normal((users, items)).astype(np.float32))
    recall, ndcg = evaluate_ranking(lambda u: scores[u], known, target, items, k=5, batch_size=16)
    all_users = np.arange(users)
    exclude, relevant = csr_rows_mask(*known, all_users, items), csr_rows_mask(*target, all_users, items)
    keep = torch.from_numpy(np.diff(target[0]) > 0)  # users with a target item, as evaluate_ranking scores
    reference_recall, reference_ndcg = RecallAtK(5), NDCGAtK(5)
    for metric in (reference_recall, reference_ndcg):
        metric.update(scores[keep], relevant[keep], exclude=exclude[keep])
    assert recall == pytest.approx(float(reference_recall.compute()), rel=1e-6)
    assert ndcg == pytest.approx(float(reference_ndcg.compute()), rel=1e-6)


def test_evaluate_ranking_says_what_is_wrong() -> None:
    known = (np.array([0, 1, 2]), np.array([0, 1]))
    no_target = (np.array([0, 0, 0]), np.array([], dtype=np.int64))
    with pytest.raises(ValueError, match="no user has a target item"):
        evaluate_ranking(lambda users: torch.zeros(len(users), 4), known, no_target, 4)
    target = (np.array([0, 1, 2]), np.array([2, 3]))
    with pytest.raises(ValueError, match=r"score\(\) returned \(2, 3\), expected \(2, 4\)"):
        evaluate_ranking(lambda users: torch.zeros(len(users), 3), known, target, 4)
