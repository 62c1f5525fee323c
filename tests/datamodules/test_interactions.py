"""InteractionsDataModule: LightGCN files, CSV split, synthetic data, validation split, loaders, bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_sdp.datamodules.interactions import (
    InteractionsDataModule,
    PositivePairs,
    split_validation,
    synthetic_interactions,
)
from lightning_sdp.datamodules.interactions.split import validation_counts


def _write_lightgcn(folder: Path, train: str, test: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.txt").write_text(train)
    (folder / "test.txt").write_text(test)
    return folder


def test_lightgcn_folder(tmp_path):
    folder = _write_lightgcn(tmp_path / "d", "0 1 2 3\n1 0 4\n2 5\n", "0 4\n1 2 3\n")
    dm = InteractionsDataModule(str(folder), batch_size=2, val_fraction=0)
    dm.setup("fit")
    assert (dm.num_users, dm.num_items) == (3, 6)
    indptr, indices = dm.train_csr
    np.testing.assert_array_equal(indptr, [0, 3, 5, 6])
    np.testing.assert_array_equal(indices, [1, 2, 3, 0, 4, 5])
    t_ptr, t_idx = dm.test_csr
    np.testing.assert_array_equal(t_ptr, [0, 1, 3, 3])
    np.testing.assert_array_equal(t_idx, [4, 2, 3])
    pairs = sorted(zip(*(torch.cat(x).tolist() for x in zip(*dm.train_dataloader(), strict=False)), strict=False))
    assert pairs == [(0, 1), (0, 2), (0, 3), (1, 0), (1, 4), (2, 5)]
    assert list(dm.val_dataloader()) == []  # val_fraction=0: no validation, and never the test set instead
    (batch,) = list(dm.test_dataloader())
    assert batch["users"].tolist() == [0, 1]
    assert batch["test_indptr"].tolist() == [0, 1, 3]
    assert batch["test_items"].tolist() == [4, 2, 3]
    assert batch["known_indptr"].tolist() == [0, 3, 5]
    assert batch["known_items"].tolist() == [1, 2, 3, 0, 4]


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
    rows = ["user_id,item_id,rating"] + [f"{u},{i},5" for u in range(20) for i in rng.choice(30, 10, replace=False)]
    path = tmp_path / "ratings.csv"
    path.write_text("\n".join(rows) + "\n")
    a = InteractionsDataModule(str(path), test_fraction=0.2, val_fraction=0, seed=1)
    b = InteractionsDataModule(str(path), test_fraction=0.2, val_fraction=0, seed=1)
    c = InteractionsDataModule(str(path), test_fraction=0.2, val_fraction=0, seed=2)
    for dm in (a, b, c):
        dm.setup()
    assert a.num_users == 20 and a.num_items <= 30
    np.testing.assert_array_equal(np.diff(a.test_csr[0]), 2)  # 20% of 10 items per user
    np.testing.assert_array_equal(np.diff(a.train_csr[0]), 8)
    np.testing.assert_array_equal(a.test_csr[1], b.test_csr[1])
    assert not np.array_equal(a.test_csr[1], c.test_csr[1])
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
    np.testing.assert_array_equal(dm.raw_user_ids, [10, 20])


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
        ("0 1 x\n", "0 1\n", {}, "train.txt:1: id 'x' is not a non-negative decimal integer"),
        ("0 1 2\n1 2.0\n", "0 1\n", {}, "train.txt:2: id '2.0' is not"),
        ("0 1 2\n", "0 +1\n", {}, "test.txt:1: id '\\+1' is not"),
        ("0 1\n1 1000000000000\n", "0 1\n", {}, "train.txt:2: item id 1000000000000 would make a table"),
        ("0 1\n1000000000000 1\n", "0 1\n", {}, "train.txt:2: user id 1000000000000 would make a table"),
        ("0 1 2\n", "0 3\n", {"num_items": 3}, "test.txt:1: item id 3 is out of range for num_items=3"),
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
        _ = InteractionsDataModule().train_csr


@pytest.mark.shared_data
@pytest.mark.slow
def test_gowalla_sizes(shared_data):
    dm = InteractionsDataModule(str(shared_data / "gowalla"))
    dm.setup()
    assert (dm.num_users, dm.num_items) == (29858, 40981)
    assert dm.num_train_interactions + len(dm.val_indices) == 810128
    assert len(dm.val_indices) == int(validation_counts(np.diff(dm.val_indptr + dm.train_indptr), 0.1).sum())
    assert len(dm.test_indices) == 217242


@pytest.mark.shared_data
def test_lastfm_sizes_with_its_two_cold_test_users_left_out(shared_data, caplog):
    with pytest.raises(ValueError, match="2 test user.s. have no training items.*drop_cold_test_users=True"):
        InteractionsDataModule(str(shared_data / "lastfm")).setup()
    dm = InteractionsDataModule(str(shared_data / "lastfm"), drop_cold_test_users=True)
    dm.setup()
    assert (dm.num_users, dm.num_items) == (1892, 4489)
    assert dm.num_train_interactions + len(dm.val_indices) == 42135
    assert len(dm.test_indices) == 10533 - 3 and "left 2 test user(s)" in caplog.text
    assert len(dm.known_csr.indices) == 42135 + 10533  # their test items are still known interactions


def test_cold_test_users_are_left_out_on_request(tmp_path, caplog):
    (tmp_path / "train.txt").write_text("0 1 2\n1 0\n")
    (tmp_path / "test.txt").write_text("0 3\n2 1 3\n")
    dm = InteractionsDataModule(str(tmp_path), num_users=3, drop_cold_test_users=True, val_fraction=0.0)
    dm.setup()
    assert dm.test_csr.indices.tolist() == [3] and np.diff(dm.test_csr.indptr).tolist() == [1, 0, 0]
    assert "left 1 test user(s) with no training items out of the test set (e.g. user 2" in caplog.text
    assert set(dm.known_csr.indices[dm.known_csr.indptr[2] : dm.known_csr.indptr[3]].tolist()) == {1, 3}
    assert [int(b["users"][0]) for b in dm.test_dataloader()] == [0]


# ---------------------------------------------------------------------------------------------- validation split
def _rows(indptr: np.ndarray, indices: np.ndarray, u: int) -> set[int]:
    return set(indices[indptr[u] : indptr[u + 1]].tolist())


def test_validation_split_is_per_user_disjoint_and_seeded():
    rng = np.random.default_rng(0)
    counts = np.array([0, 1, 2, 3, 10, 25, 40])
    indptr = np.concatenate([[0], np.cumsum(counts)])
    indices = np.concatenate([np.sort(rng.choice(100, c, replace=False)) for c in counts]).astype(np.int64)
    (tr_ptr, tr_idx), (va_ptr, va_idx) = split_validation(indptr, indices, 0.1, seed=4)
    np.testing.assert_array_equal(np.diff(va_ptr), [0, 0, 1, 1, 1, 2, 4])  # round(n/10), >= 1 when n >= 2
    np.testing.assert_array_equal(np.diff(tr_ptr) + np.diff(va_ptr), counts)
    for u in range(len(counts)):
        tr, va = _rows(tr_ptr, tr_idx, u), _rows(va_ptr, va_idx, u)
        assert not tr & va and tr | va == _rows(indptr, indices, u)
        assert counts[u] == 0 or tr  # every user keeps a training item
    again = split_validation(indptr, indices, 0.1, seed=4)
    np.testing.assert_array_equal(again[1].indices, va_idx)
    other_seeds = [split_validation(indptr, indices, 0.1, seed=s)[1].indices for s in range(1, 6)]
    assert any(not np.array_equal(v, va_idx) for v in other_seeds)
    empty_tr, empty_va = split_validation(indptr, indices, 0.0, seed=4)
    np.testing.assert_array_equal(empty_tr.indices, indices)
    assert len(empty_va.indices) == 0 and empty_va.num_rows == len(counts)


def test_validation_split_refuses_bad_input():
    with pytest.raises(ValueError, match="fraction must be in"):
        split_validation(np.array([0, 1]), np.array([3]), 1.0, 0)
    with pytest.raises(ValueError, match="not a CSR matrix"):
        split_validation(np.array([0, 2]), np.array([3]), 0.1, 0)


def test_datamodule_validation_set_leaves_test_untouched(tmp_path):
    rng = np.random.default_rng(1)
    train = "".join(f"{u} " + " ".join(map(str, sorted(rng.choice(50, 12, replace=False)))) + "\n" for u in range(30))
    test = "".join(f"{u} {50 + u % 5}\n" for u in range(30))
    folder = _write_lightgcn(tmp_path / "v", train, test)
    plain = InteractionsDataModule(str(folder), val_fraction=0)
    dm = InteractionsDataModule(str(folder), val_fraction=0.25, seed=7)
    for d in (plain, dm):
        d.setup()
    np.testing.assert_array_equal(dm.test_csr.indptr, plain.test_csr.indptr)
    np.testing.assert_array_equal(dm.test_csr.indices, plain.test_csr.indices)
    np.testing.assert_array_equal(np.diff(dm.val_indptr), 3)  # round(12 * 0.25)
    assert dm.num_train_interactions == 30 * 9
    for u in range(30):
        tr, va = _rows(dm.train_indptr, dm.train_indices, u), _rows(dm.val_indptr, dm.val_indices, u)
        assert not tr & va and tr | va == _rows(plain.train_indptr, plain.train_indices, u)
    # the same split as the public function on the datamodule's own arguments (what benchmarks use)
    tr_csr, va_csr = split_validation(*plain.train_csr, 0.25, seed=7)
    np.testing.assert_array_equal(va_csr.indices, dm.val_csr.indices)
    np.testing.assert_array_equal(tr_csr.indices, dm.train_csr.indices)
    # training batches hold no validation item
    pairs = torch.cat([u * 1000 + i for u, i in dm.train_dataloader()]).tolist()
    val_pairs = {u * 1000 + i for u in range(30) for i in _rows(dm.val_indptr, dm.val_indices, u)}
    assert len(pairs) == 30 * 9 and not set(pairs) & val_pairs


def test_evaluation_batches_carry_the_items_never_to_rank():
    dm = InteractionsDataModule(num_users=80, num_items=60, eval_batch_size=16, val_fraction=0.2, seed=2)
    dm.setup()
    full = {u: _rows(dm.train_indptr, dm.train_indices, u) | _rows(dm.val_indptr, dm.val_indices, u) for u in range(80)}
    seen_val = []
    for batch in dm.val_dataloader():
        assert len(batch["users"]) <= 16
        for j, u in enumerate(batch["users"].tolist()):
            items = batch["test_items"][batch["test_indptr"][j] : batch["test_indptr"][j + 1]].tolist()
            known = batch["known_items"][batch["known_indptr"][j] : batch["known_indptr"][j + 1]].tolist()
            assert set(items) == _rows(dm.val_indptr, dm.val_indices, u)
            assert set(known) == _rows(dm.train_indptr, dm.train_indices, u)
            seen_val.append(u)
    assert seen_val == np.flatnonzero(np.diff(dm.val_indptr)).tolist()
    seen_test = []
    for batch in dm.test_dataloader():
        for j, u in enumerate(batch["users"].tolist()):
            items = batch["test_items"][batch["test_indptr"][j] : batch["test_indptr"][j + 1]].tolist()
            known = batch["known_items"][batch["known_indptr"][j] : batch["known_indptr"][j + 1]].tolist()
            assert set(items) == _rows(dm.test_indptr, dm.test_indices, u)
            assert set(known) == full[u]  # training and validation items
            seen_test.append(u)
    assert seen_test == np.flatnonzero(np.diff(dm.test_indptr)).tolist()


class _CountingModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.val_batches = 0

    def training_step(self, batch, batch_idx):
        return self.layer(torch.ones(1, 1)).sum()

    def validation_step(self, batch, batch_idx):
        self.val_batches += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("val_fraction", [0.0, 0.2])
def test_trainer_runs_validation_only_with_a_validation_set(val_fraction):
    dm = InteractionsDataModule(num_users=40, num_items=30, batch_size=64, val_fraction=val_fraction)
    model = _CountingModule()
    trainer = Trainer(
        max_epochs=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, dm)
    assert model.val_batches == (0 if val_fraction == 0 else 1)


def test_csr_call_form_still_works_with_a_warning():
    dm = InteractionsDataModule(num_users=30, num_items=20)
    dm.setup()
    with pytest.warns(DeprecationWarning, match="properties now"):
        indptr, indices = dm.train_csr()
    np.testing.assert_array_equal(indices, dm.train_indices)


# ---------------------------------------------------------------------------------------------- ids in CSV / TSV
@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("1,2\n" * 1500 + "3,x\n", r"t.csv:1501: item id 'x' is not a non-negative decimal integer"),
        ("user,item\n1,2\nabc,4\n", r"t.csv:3: user id 'abc' is not"),
        ("1,2\n-3,4\n", r"t.csv:2: negative user id '-3'"),
        ("1,2\n3,4.0\n", r"t.csv:2: item id '4.0' is not"),
        ("1,2\n3,1e3\n", r"t.csv:2: item id '1e3' is not"),
        ("1,2\n3\n", r"t.csv:2: expected `user,item`"),
        ("user,item\n", r"t.csv: no interactions"),
        ("1,2\n3," + "9" * 19 + "\n", r"t.csv:2: item id '9{19}' is not"),
    ],
)
def test_csv_ids_follow_one_rule(tmp_path, body, match):
    path = tmp_path / "t.csv"
    path.write_text(body)
    with pytest.raises(ValueError, match=match):
        InteractionsDataModule(str(path)).setup()


def test_csv_ids_are_integers_and_remapped_compactly(tmp_path):
    path = tmp_path / "t.csv"
    rows = [f"{u},{i}" for u in (7, 1_000_000_000_000) for i in (1, 2, 3, 4, 5)] + ["07,6", "0007,7"]
    path.write_text("user,item\n" + "\n".join(rows) + "\n")
    dm = InteractionsDataModule(str(path), test_fraction=0.2, val_fraction=0)
    dm.setup()
    assert (dm.num_users, dm.num_items) == (2, 7)  # '7' == '07' == '0007'; 10**12 takes one row, not a huge table
    np.testing.assert_array_equal(dm.raw_user_ids, [7, 1_000_000_000_000])
    assert np.diff(dm.train_indptr)[0] + np.diff(dm.test_indptr)[0] == 7
    with pytest.raises(ValueError, match="has 2 distinct users but num_users=1"):
        InteractionsDataModule(str(path), num_users=1).setup()


# ---------------------------------------------------------------------------------------------- evaluation memory
def test_auto_eval_batch_size_follows_the_item_count():
    from lightning_sdp.datamodules.interactions import auto_eval_batch_size

    gib = 2**30
    assert auto_eval_batch_size(40_981, memory_mib=256, available=64 * gib) == 256 * 2**20 // (6 * 40_981)
    assert auto_eval_batch_size(1_000_000, memory_mib=256, available=64 * gib) == 44  # 6 B x 44 x 1M < 256 MiB
    assert auto_eval_batch_size(1_000_000, memory_mib=256, available=100 * 2**20) == 8  # held to half the memory
    with pytest.raises(ValueError, match="raise eval_memory_mib"):
        auto_eval_batch_size(100_000_000, memory_mib=256, available=64 * gib)
    dm = InteractionsDataModule(num_users=50, num_items=40, eval_memory_mib=0.001)
    dm.setup()
    assert dm.resolved_eval_batch_size == int(0.001 * 2**20) // (6 * 40)
    assert max(len(b["users"]) for b in dm.test_dataloader()) == dm.resolved_eval_batch_size


def test_explicit_eval_batch_size_is_checked_against_memory(monkeypatch):
    from lightning_sdp.datamodules.interactions import check_eval_batch_size, eval_memory

    check_eval_batch_size(1024, 40_981, available=2**30)
    with pytest.raises(ValueError, match=r"eval_batch_size=1024 .* set eval_batch_size <= 43 or eval_batch_size='auto"):
        check_eval_batch_size(1024, 1_000_000, available=500 * 2**20)
    monkeypatch.setattr(eval_memory, "available_memory_bytes", lambda: 10 * 2**20)
    with pytest.raises(ValueError, match="eval_batch_size=1000000"):
        InteractionsDataModule(num_users=50, num_items=40, eval_batch_size=1_000_000).setup()
    with pytest.raises(ValueError, match="positive int or 'auto'"):
        InteractionsDataModule(eval_batch_size=0)


def test_positive_pairs_from_a_csr_hold_every_positive_user_by_user() -> None:
    from lightning_sdp.datamodules.interactions import PositivePairs

    indptr, indices = np.array([0, 2, 2, 5]), np.array([4, 1, 0, 3, 2])
    pairs = PositivePairs.from_csr(indptr, indices)
    users, items = pairs[np.arange(len(pairs))]
    assert users.tolist() == [0, 0, 2, 2, 2] and items.tolist() == [4, 1, 0, 3, 2]
    assert users.dtype == items.dtype == torch.int64


def test_merge_csr_undoes_split_validation() -> None:
    from lightning_sdp.datamodules.interactions import merge_csr, to_csr

    rng = np.random.default_rng(7)
    users = rng.integers(0, 50, 600)
    items = rng.integers(0, 80, 600)
    full = to_csr(users, items, 50)
    train, val = split_validation(full.indptr, full.indices, 0.3, seed=3)
    merged = merge_csr(train, val)
    np.testing.assert_array_equal(merged.indptr, full.indptr)
    np.testing.assert_array_equal(merged.indices, full.indices)
    with pytest.raises(ValueError, match="same rows"):
        merge_csr(train, (np.array([0, 0]), np.array([], dtype=np.int64)))


# ---------------------------------------------------------------------------------------------- duplicates
_DM_LOGGER = "lightning_sdp.datamodules.interactions.datamodule"


def _pairs_of(indptr: np.ndarray, indices: np.ndarray) -> set[tuple[int, int]]:
    users = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    return set(zip(users.tolist(), indices.tolist(), strict=True))


def test_csv_duplicates_are_dropped_before_the_split(tmp_path, caplog):
    # every row written twice: split first, and most test pairs would also be training pairs
    rng = np.random.default_rng(0)
    rows = [f"{u},{i},5" for u in range(200) for i in rng.choice(30, 10, replace=False)]
    path = tmp_path / "ratings.csv"
    path.write_text("user_id,item_id,rating\n" + "\n".join(rows + rows) + "\n")
    dm = InteractionsDataModule(str(path), test_fraction=0.2, val_fraction=0.1, seed=1)
    with caplog.at_level("WARNING", logger=_DM_LOGGER):
        dm.setup()
    (record,) = [r for r in caplog.records if r.name == _DM_LOGGER]
    message = record.getMessage()
    assert str(path) in message and "2000 (user, item) pair(s) more than once" in message
    assert f"at {path}:2002, first at {path}:2" in message  # the first occurrence is the one kept
    train = _pairs_of(*dm.train_csr) | _pairs_of(*dm.val_csr)
    test = _pairs_of(*dm.test_csr)
    assert not train & test
    assert len(train) == 200 * 8 and len(test) == 200 * 2  # 10 distinct items per user, 20% to test


def test_csv_without_duplicates_logs_nothing_and_splits_as_before(tmp_path, caplog):
    path = tmp_path / "x.tsv"
    path.write_text("".join(f"{u}\t{i}\n" for u in (10, 20) for i in (1, 2, 3, 4, 5)))
    with caplog.at_level("WARNING", logger=_DM_LOGGER):
        dm = InteractionsDataModule(str(path), test_fraction=0.4)
        dm.setup()
    assert not [r for r in caplog.records if r.name == _DM_LOGGER]
    assert len(dm.test_indices) == 4


def test_lightgcn_pairs_in_train_and_test_are_refused(tmp_path):
    folder = _write_lightgcn(tmp_path / "d", "0 1 2 3\n1 0 4\n2 5\n", "0 4\n1 2 4\n2 1\n")
    with pytest.raises(ValueError) as info:
        InteractionsDataModule(str(folder)).setup()
    message = str(info.value)
    assert "1 (user, item) pair(s) of" in message and "test.txt are also in" in message
    assert f"user 1, item 4 at {folder / 'test.txt'}:2, also at {folder / 'train.txt'}:2" in message
    assert f"Remove those pairs from {folder / 'test.txt'}" in message


def test_lightgcn_duplicates_within_a_file_are_dropped_with_a_warning(tmp_path, caplog):
    folder = _write_lightgcn(tmp_path / "d", "0 1 2 1\n1 0 4\n2 5\n0 2\n", "0 4\n1 2 3\n1 3\n")
    with caplog.at_level("WARNING", logger=_DM_LOGGER):
        dm = InteractionsDataModule(str(folder), val_fraction=0)
        dm.setup()
    messages = [r.getMessage() for r in caplog.records if r.name == _DM_LOGGER]
    assert len(messages) == 2
    assert f"{folder / 'train.txt'} lists 2 (user, item) pair(s) more than once" in messages[0]
    assert f"{folder / 'test.txt'} lists 1 (user, item) pair(s) more than once" in messages[1]
    assert f"user 1, item 3 at {folder / 'test.txt'}:3, first at {folder / 'test.txt'}:2" in messages[1]
    assert _pairs_of(*dm.train_csr) == {(0, 1), (0, 2), (1, 0), (1, 4), (2, 5)}
    assert _pairs_of(*dm.test_csr) == {(0, 4), (1, 2), (1, 3)}
    assert len(PositivePairs.from_csr(*dm.train_csr)) == 5  # each positive once per epoch


def test_synthetic_pairs_are_unique_and_the_splits_disjoint(caplog):
    users, items = synthetic_interactions(300, 200, 20, 0.8, 20, seed=4)
    assert len(set(zip(users.tolist(), items.tolist(), strict=True))) == len(users)
    dm = InteractionsDataModule(num_users=300, num_items=200, val_fraction=0.1, seed=4)
    with caplog.at_level("WARNING", logger=_DM_LOGGER):
        dm.setup()
    assert not [r for r in caplog.records if r.name == _DM_LOGGER]
    train, val, test = _pairs_of(*dm.train_csr), _pairs_of(*dm.val_csr), _pairs_of(*dm.test_csr)
    assert not train & val and not train & test and not val & test
    assert len(train) + len(val) + len(test) == len(users)


def test_csv_duplicates_of_18_digit_ids_are_found(tmp_path, caplog):
    big = 10**18 - 1  # pair keys of this size overflow int64: the pairs are compared column by column
    path = tmp_path / "big.csv"
    path.write_text("".join(f"{u},{i}\n" for u in (big, 3) for i in (big, 5, 6, big - 1, 5)))
    with caplog.at_level("WARNING", logger=_DM_LOGGER):
        dm = InteractionsDataModule(str(path), test_fraction=0.25, val_fraction=0)
        dm.setup()
    (message,) = [r.getMessage() for r in caplog.records if r.name == _DM_LOGGER]
    assert f"lists 2 (user, item) pair(s) more than once (e.g. user {big}, item 5 at {path}:5, first at {path}:2)" in (
        message
    )
    assert dm.num_train_interactions + len(dm.test_indices) == 8
