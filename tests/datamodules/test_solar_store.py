"""SampleStore against a dict of per-sample tensors (what the loader held before), on random turnover."""

import numpy as np
import pytest
import torch

from lightning_sdp.datamodules.solar.store import MIN_BLOCK_SAMPLES, SampleStore

SHAPES = {"x": (1, 4, 4), "y": (2, 4, 4)}
DTYPES = {"x": np.dtype("float32"), "y": np.dtype("float16")}


def _sample(rng: np.random.Generator) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(rng.standard_normal(s).astype(DTYPES[k])) for k, s in SHAPES.items()}


@pytest.mark.parametrize("capacity", [0, 5, 40])
def test_store_holds_what_a_dict_of_tensors_holds_under_random_turnover(capacity):
    rng = np.random.default_rng(capacity)
    store, reference = SampleStore(SHAPES, DTYPES, capacity), {}
    for _ in range(600):
        sample = int(rng.integers(0, 60))
        if rng.random() < 0.55:
            rows = _sample(rng)
            store.put(sample, rows)
            reference[sample] = {k: v.clone() for k, v in rows.items()}
        else:
            store.pop(sample)
            reference.pop(sample, None)
        assert len(store) == len(reference)
    assert set(store) == set(reference)
    for sample, rows in reference.items():
        assert sample in store
        for key, value in rows.items():
            got = store.get(sample, key)
            assert got.dtype == value.dtype and got.shape == value.shape
            assert torch.equal(got, value)


def test_freed_slots_are_reused_before_the_store_grows():
    store = SampleStore(SHAPES, DTYPES, capacity=8)
    rng = np.random.default_rng(0)
    for step in range(200):  # a buffer of 8 turning over: one out, one in, every step
        store.pop(step - 8)
        store.put(step, _sample(rng))
    assert len(store) == 8
    assert store.allocated_samples == 8
    for extra in range(200, 209):  # one past the planned capacity grows the store by a block
        store.put(extra, _sample(rng))
    assert store.allocated_samples == 8 + MIN_BLOCK_SAMPLES
    store.clear()
    assert len(store) == 0 and store.allocated_samples == 0
    store.put(1, _sample(rng))
    assert store.allocated_samples == 8


def test_a_sample_put_again_overwrites_its_slot_and_bad_capacity_is_refused():
    store = SampleStore(SHAPES, DTYPES, capacity=2)
    rng = np.random.default_rng(1)
    first, second = _sample(rng), _sample(rng)
    store.put(3, first)
    store.put(3, second)
    assert len(store) == 1 and torch.equal(store.get(3, "y"), second["y"])
    store.pop(99)  # not held: nothing happens
    with pytest.raises(KeyError):
        store.get(99, "x")
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        SampleStore(SHAPES, DTYPES, capacity=-1)
