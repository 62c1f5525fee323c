"""InteractionsDataModule: LightGCN files, CSV split, synthetic data, loaders, bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_sdp.datamodules.interactions import InteractionsDataModule


def _write_lightgcn(folder: Path, train: str, test: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.txt").write_text(train)
    (folder / "test.txt").write_text(test)
    return folder


def test_lightgcn_folder(tmp_path):
    folder = _write_lightgcn(tmp_path / "d", "0 1 2 3\n1 0 4\n2 5\n", "0 4\n1 2 3\n")
    dm = InteractionsDataModule(str(folder), batch_size=2)
    dm.setup("fit")
    assert (dm.num_users, dm.num_items) == (3, 6)
    indptr, indices = dm.train_csr()
    np.testing.assert_array_equal(indptr, [0, 3, 5, 6])
    np.testing.assert_array_equal(indices, [1, 2, 3, 0, 4, 5])
    t_ptr, t_idx = dm.test_csr()
    np.testing.assert_array_equal(t_ptr, [0, 1, 3, 3])
    np.testing.assert_array_equal(t_idx, [4, 2, 3])
    pairs = sorted(zip(*(torch.cat(x).tolist() for x in zip(*dm.train_dataloader(), strict=False)), strict=False))
    assert pairs == [(0, 1), (0, 2), (0, 3), (1, 0), (1, 4), (2, 5)]
    (batch,) = list(dm.val_dataloader())
    assert batch["users"].tolist() == [0, 1]
    assert batch["test_indptr"].tolist() == [0, 1, 3]
    assert batch["test_items"].tolist() == [4, 2, 3]


def test_train_order_is_seeded_per_epoch(tmp_path):
    dm = InteractionsDataModule(num_users=60, num_items=40, batch_size=16, seed=3)
    dm.setup()
    loader = dm.train_dataloader()

    def order(epoch: int) -> list[int]:
        loader.sampler.set_epoch(epoch)
        return torch.cat([u * 1000 + i for u, i in loader]).tolist()

    e0, e1 = order(0), order(1)
    assert e0 == order(0)
    assert e0 != e1 and sorted(e0) == sorted(e1)
    assert len(e0) == dm.num_train_interactions == len(set(e0))


def test_csv_split_is_seeded_and_per_user(tmp_path):
    rng = np.random.default_rng(0)
    rows = ["user_id,item_id,rating"] + [f"u{u},i{i},5" for u in range(20) for i in rng.choice(30, 10, replace=False)]
    path = tmp_path / "ratings.csv"
    path.write_text("\n".join(rows) + "\n")
    a = InteractionsDataModule(str(path), test_fraction=0.2, seed=1)
    b = InteractionsDataModule(str(path), test_fraction=0.2, seed=1)
    c = InteractionsDataModule(str(path), test_fraction=0.2, seed=2)
    for dm in (a, b, c):
        dm.setup()
    assert a.num_users == 20 and a.num_items <= 30
    np.testing.assert_array_equal(np.diff(a.test_csr()[0]), 2)  # 20% of 10 items per user
    np.testing.assert_array_equal(np.diff(a.train_csr()[0]), 8)
    np.testing.assert_array_equal(a.test_csr()[1], b.test_csr()[1])
    assert not np.array_equal(a.test_csr()[1], c.test_csr()[1])
    for u in range(20):  # train and test are disjoint per user
        tr = set(a.train_indices[a.train_indptr[u] : a.train_indptr[u + 1]])
        te = set(a.test_indices[a.test_indptr[u] : a.test_indptr[u + 1]])
        assert not tr & te and len(tr | te) == 10


def test_tsv_integer_ids(tmp_path):
    path = tmp_path / "x.tsv"
    path.write_text("".join(f"{u}\t{i}\n" for u in (10, 20) for i in (1, 2, 3, 4, 5)))
    dm = InteractionsDataModule(str(path), test_fraction=0.4)
    dm.setup()
    assert (dm.num_users, dm.num_items) == (2, 5)
    assert len(dm.test_indices) == 4


def test_synthetic_is_seeded_power_law():
    a = InteractionsDataModule(num_users=300, num_items=200, seed=5)
    b = InteractionsDataModule(num_users=300, num_items=200, seed=5)
    a.setup()
    b.setup()
    np.testing.assert_array_equal(a.train_indices, b.train_indices)
    pop = np.sort(np.bincount(a.train_indices, minlength=200))[::-1]
    assert pop[:20].sum() > 3 * pop[-20:].sum()  # skewed popularity
    assert (np.diff(a.train_indptr) >= 1).all()


@pytest.mark.parametrize(
    ("train", "test", "kwargs", "match"),
    [
        ("0 1 -2\n", "0 1\n", {}, "negative id"),
        ("0 1 2\n", "0 3\n", {"num_items": 3}, "item id 3 is out of range"),
        ("0 1 2\n", "1 3\n", {"num_users": 1}, "user id 1 is out of range"),
        ("0 1 2\n", "1 2\n", {}, "have no training items"),
        ("0 1 2\n", "\n", {}, "test set is empty"),
        ("0 1 x\n", "0 1\n", {}, "integer ids"),
    ],
)
def test_bad_input(tmp_path, train, test, kwargs, match):
    folder = _write_lightgcn(tmp_path / "bad", train, test)
    with pytest.raises(ValueError, match=match):
        InteractionsDataModule(str(folder), **kwargs).setup()


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        InteractionsDataModule(str(tmp_path / "nope")).setup()
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "train.txt").write_text("0 1\n")
    with pytest.raises(FileNotFoundError, match="test.txt"):
        InteractionsDataModule(str(tmp_path / "only")).setup()
    with pytest.raises(RuntimeError, match="setup"):
        InteractionsDataModule().train_csr()


@pytest.mark.shared_data
def test_gowalla_sizes(shared_data):
    dm = InteractionsDataModule(str(shared_data / "gowalla"))
    dm.setup()
    assert (dm.num_users, dm.num_items) == (29858, 40981)
    assert dm.num_train_interactions == 810128
    assert len(dm.test_indices) == 217242
