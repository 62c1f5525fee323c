import itertools

import numpy as np
import pytest

from lightning_sdp.datamodules.solar.buffer import BeladyBuffer, make_buffer, parse_size
from lightning_sdp.datamodules.solar.schedule import SolarSchedule, epoch_overlap_matrix, order_epochs


def _all_ids(schedule, epoch):
    return np.concatenate([rs.indices for sp in schedule.epoch_plan(epoch) for rs in sp.ranks])


def _digest(schedule, epochs):
    parts = []
    for e in range(epochs):
        for sp in schedule.epoch_plan(e):
            for rs in sp.ranks:
                parts += [rs.indices, rs.hit.astype(np.int64), rs.inserts, rs.evicts, np.array([-1])]
    return np.concatenate(parts)


def test_reproducible_from_seed_and_seed_matters():
    kw = dict(num_samples=300, num_epochs=3, world_size=2, local_batch_size=8, buffer_size=60)
    a, b = SolarSchedule(seed=5, **kw), SolarSchedule(seed=5, **kw)
    assert np.array_equal(_digest(a, 3), _digest(b, 3))
    assert a.schedule_hash == b.schedule_hash
    c = SolarSchedule(seed=6, **kw)
    assert not np.array_equal(a.permutation(0), c.permutation(0))
    assert a.schedule_hash != c.schedule_hash


@pytest.mark.parametrize("world_size,batch,drop", [(1, 7, False), (3, 5, False), (4, 8, False), (2, 16, True)])
@pytest.mark.parametrize("eviction", ["belady", "lru"])
def test_each_sample_once_per_epoch(world_size, batch, drop, eviction):
    n = 203
    s = SolarSchedule(n, 3, world_size, batch, buffer_size=50, eviction=eviction, drop_last=drop)
    for e in range(3):
        ids = _all_ids(s, e)
        if drop:
            assert len(ids) == (n // (world_size * batch)) * world_size * batch
            assert len(np.unique(ids)) == len(ids)
        else:
            assert np.array_equal(np.sort(ids), np.arange(n))


@pytest.mark.parametrize("world_size,batch", [(1, 16), (2, 8), (4, 4)])
def test_global_batch_membership_is_plain_shuffling(world_size, batch):
    n, seed = 150, 3
    s = SolarSchedule(n, 3, world_size, batch, buffer_size=40, seed=seed)
    children = np.random.SeedSequence(seed).spawn(3)
    g = world_size * batch
    for e in range(3):
        plain = np.random.default_rng(children[e]).permutation(n)  # plain shuffling with the same seed
        assert np.array_equal(s.permutation(e), plain)
        for sp in s.epoch_plan(e):
            got = np.sort(np.concatenate([rs.indices for rs in sp.ranks]))
            stop = n if sp.step == s.steps_per_epoch - 1 else (sp.step + 1) * g  # the last step takes the tail
            assert np.array_equal(got, np.sort(plain[sp.step * g : stop]))
            assert sum(len(rs.indices) for rs in sp.ranks) == sp.global_batch_size
            assert sp.loss_scale == pytest.approx(world_size / sp.global_batch_size)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_belady_with_rerouting_reaches_the_bound_and_beats_lru(world_size):
    n, c = 2000, 500
    rates = {}
    for policy in ("belady", "lru", "fifo", "solar"):
        s = SolarSchedule(n, 3, world_size, 64 // world_size, buffer_size=c, eviction=policy, seed=1)
        rates[policy] = s.simulate().hit_rate
    assert rates["belady"][0] == 0.0
    for e in (1, 2):
        assert rates["belady"][e] == pytest.approx(c / n, abs=1e-12)
        for other in ("lru", "fifo", "solar"):
            assert rates["belady"][e] >= rates[other][e]
            assert rates[other][e] > 0
    if world_size > 1:
        no_reroute = SolarSchedule(n, 3, world_size, 64 // world_size, buffer_size=c, reroute=False, seed=1)
        assert max(no_reroute.simulate().hit_rate[1:]) < c / n - 0.01


def test_reads_are_balanced_and_local_batches_capped():
    s = SolarSchedule(1000, 3, 4, 16, buffer_size=500, max_local_batch=24, seed=2)
    report = s.simulate()
    unequal = 0
    for e in range(3):
        for sp in s.epoch_plan(e):
            reads = [len(rs.reads) for rs in sp.ranks]
            sizes = [len(rs.indices) for rs in sp.ranks]
            assert max(sizes) <= 24
            room = all(size < 24 for size in sizes)
            if room:
                assert max(reads) - min(reads) <= 1
            unequal += len(set(sizes)) > 1
            for rs in sp.ranks:  # hits are exactly the samples this rank buffered before the step
                assert rs.hit.dtype == bool
    assert unequal > 0  # local batch sizes do vary
    assert report.reads_per_rank.shape == (3, 4)
    # a tight cap can push a buffered sample to another rank (read again): never fewer than N - C reads
    assert np.all(report.reads_per_rank[1:].sum(1) >= 500)
    roomy = SolarSchedule(1000, 3, 4, 16, buffer_size=500, max_local_batch=64, seed=2).simulate()
    assert np.all(roomy.reads_per_rank[1:].sum(1) == 500)


def test_without_balance_local_batches_are_fixed():
    s = SolarSchedule(256, 2, 4, 8, buffer_size=100, balance=False)
    for e in range(2):
        for sp in s.epoch_plan(e):
            assert [len(rs.indices) for rs in sp.ranks] == [8, 8, 8, 8]


def test_buffer_zero_and_larger_than_data():
    none = SolarSchedule(100, 3, 2, 10, buffer_size=0).simulate()
    assert none.hit_rate == [0.0, 0.0, 0.0]
    assert none.reads_per_rank.sum() == 300
    everything = SolarSchedule(100, 3, 2, 10, buffer_size=1000).simulate()
    assert everything.hit_rate == [0.0, 1.0, 1.0]


def test_a_tail_smaller_than_the_world_joins_the_step_before():
    s = SolarSchedule(9, 1, 4, 2, buffer_size=0, balance=False)  # the last global batch would be 1 sample for 4 ranks
    assert s.steps_per_epoch == 1
    (step,) = s.epoch_plan(0)
    assert sorted(len(rs.indices) for rs in step.ranks) == [2, 2, 2, 3]
    assert step.loss_scale == pytest.approx(4 / 9)
    assert SolarSchedule(12, 1, 4, 2).steps_per_epoch == 2  # a tail of 4 samples for 4 ranks stays a step


@pytest.mark.parametrize(
    "n,world_size,batch,buffer,balance",
    [(193, 2, 32, 0, False), (193, 2, 32, 96, True), (9, 4, 2, 0, True), (193, 3, 4, 48, True), (97, 4, 4, 97, True)],
)
def test_no_rank_gets_an_empty_batch(n, world_size, batch, buffer, balance):
    # the last two: re-routing put a whole step's buffered samples on the ranks that hold them
    s = SolarSchedule(n, 3, world_size, batch, buffer, balance=balance)
    for e in range(3):
        assert min(len(rs.indices) for sp in s.epoch_plan(e) for rs in sp.ranks) >= 1
        assert np.array_equal(np.sort(_all_ids(s, e)), np.arange(n))
    with pytest.raises(ValueError, match="cannot give each of 4 ranks a sample"):
        SolarSchedule(3, 1, 4, 2)


def _naive_belady(capacity, accesses):
    """Reference: a dict and a linear scan for the farthest next use."""
    held, log = {}, []
    for x, nu in accesses:
        if x in held:
            held[x] = nu
            log.append(("hit", None))
            continue
        if capacity == 0:
            log.append((False, None))
        elif len(held) < capacity:
            held[x] = nu
            log.append((True, None))
        else:
            victim = max(held, key=lambda k: (held[k], k))
            if nu >= held[victim]:
                log.append((False, None))
            else:
                del held[victim]
                held[x] = nu
                log.append((True, victim))
    return log, set(held)


@pytest.mark.parametrize("capacity", [0, 1, 5, 17])
def test_heap_belady_matches_naive_reference(capacity):
    rng = np.random.default_rng(capacity)
    accesses, next_uses = [], {}
    for t in range(600):
        x = int(rng.integers(0, 40))
        nu = t + 1 + int(rng.permutation(10_000)[0])  # distinct future positions
        accesses.append((x, nu * 10_000 + t))
    buf = BeladyBuffer(capacity)
    log = []
    for x, nu in accesses:
        if x in buf:
            buf.hit(x, nu)
            log.append(("hit", None))
        else:
            log.append(buf.offer(x, nu))
    ref_log, ref_held = _naive_belady(capacity, accesses)
    assert log == ref_log
    assert buf.contents() == ref_held
    del next_uses


def test_lru_fifo_and_artifact_eviction_orders():
    lru, fifo, art = make_buffer("lru", 2), make_buffer("fifo", 2), make_buffer("solar", 2)
    for b in (lru, fifo, art):
        b.offer(1, 0)
        b.offer(2, 0)
        b.hit(1, 0)
    assert lru.offer(3, 0) == (True, 2)
    assert fifo.offer(3, 0) == (True, 1)
    art.hit(2, 0)
    assert art.offer(3, 0) == (True, 2)  # the consumed sample goes first
    with pytest.raises(ValueError, match="unknown eviction"):
        make_buffer("mru", 3)


def test_parse_size():
    assert parse_size(10, 100) == 10
    assert parse_size("1KB", 100) == 10
    assert parse_size("1 KiB", 100) == 10
    assert parse_size("8GB", 4 * 10**6) == 2000
    assert parse_size("12", 100) == 12
    with pytest.raises(ValueError, match="cannot parse"):
        parse_size("lots", 100)
    with pytest.raises(ValueError, match=">= 0"):
        parse_size(-1, 100)


def test_order_epochs_matches_brute_force():
    rng = np.random.default_rng(0)
    for n in (3, 5, 6):
        w = rng.integers(0, 20, size=(n, n))
        np.fill_diagonal(w, 0)
        best = max(sum(w[a, b] for a, b in itertools.pairwise(p)) for p in itertools.permutations(range(n)))
        path = order_epochs(w)
        assert sorted(path) == list(range(n))
        assert sum(w[a, b] for a, b in itertools.pairwise(path)) == best


def test_order_epochs_heuristic_for_many_epochs():
    rng = np.random.default_rng(1)
    w = rng.integers(0, 50, size=(12, 12))
    np.fill_diagonal(w, 0)
    path = order_epochs(w)
    assert sorted(path) == list(range(12))
    value = sum(w[a, b] for a, b in itertools.pairwise(path))
    assert value >= sum(w[a, b] for a, b in itertools.pairwise(range(12)))


def test_tsp_schedule_uses_the_best_overlap_order():
    s = SolarSchedule(400, 5, 1, 16, buffer_size=100, epoch_order="tsp", seed=4)
    perms = [s._raw_permutation(i) for i in range(5)]
    w = epoch_overlap_matrix(perms, 100)
    order = s._order
    assert sorted(order) == list(range(5))
    assert sum(w[a, b] for a, b in itertools.pairwise(order)) == max(
        sum(w[a, b] for a, b in itertools.pairwise(p)) for p in itertools.permutations(range(5))
    )
    assert np.array_equal(s.permutation(0), perms[order[0]])
    with pytest.raises(ValueError, match="past the 5 epochs"):
        s.permutation(5)
    assert np.array_equal(np.sort(_all_ids(s, 4)), np.arange(400))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_samples": 0}, "num_samples"),
        ({"local_batch_size": 0}, "local_batch_size"),
        ({"buffer_size": -1}, "buffer_size"),
        ({"eviction": "random"}, "eviction"),
        ({"epoch_order": "sorted"}, "epoch_order"),
        ({"max_local_batch": 4}, "max_local_batch"),
        ({"drop_last": True, "num_samples": 10}, "drop_last"),
    ],
)
def test_bad_arguments(kwargs, match):
    base = dict(num_samples=100, num_epochs=2, world_size=2, local_batch_size=8)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        SolarSchedule(**base)


@pytest.mark.parametrize("sample", [0, 40, 48, 92])
def test_resume_at_a_sample_plans_the_rest_of_the_epoch_in_the_same_order(sample):
    two, four = SolarSchedule(100, 3, 2, 4, 24), SolarSchedule(100, 3, 4, 4, 24)
    assert two.order_hash == four.order_hash and two.schedule_hash != four.schedule_hash
    step = four.resume_at(1, sample)
    plan = [sp for sp in four.epoch_plan(1) if sp.step >= step]
    assert plan[0].step == step and plan[-1].step == four.steps_per_epoch - 1
    order = four.permutation(1)
    got = [np.sort(np.concatenate([rs.indices for rs in sp.ranks])) for sp in plan]
    for sp, ids in zip(plan, got, strict=True):
        start, stop = four.step_start(1, sp.step), four.step_start(1, sp.step + 1)
        assert np.array_equal(ids, np.sort(order[start:stop])) and min(len(rs.indices) for rs in sp.ranks) >= 1
    assert np.array_equal(np.sort(np.concatenate(got)), np.sort(order[sample:]))
    assert np.array_equal(np.sort(_all_ids(four, 2)), np.arange(100))  # the next epoch is whole
    assert four.resume_at(1, 32) == 2 and four.epoch_plan(1)[0].step == 0  # a step boundary: the plain epoch
    with pytest.raises(ValueError, match="1 samples left cannot give each of 4 ranks a sample"):
        four.resume_at(1, 99)
    tsp = dict(num_samples=100, num_epochs=4, local_batch_size=4, epoch_order="tsp")
    assert (
        SolarSchedule(world_size=2, buffer_size=20, **tsp).order_hash
        != SolarSchedule(world_size=4, buffer_size=40, **tsp).order_hash
    )
