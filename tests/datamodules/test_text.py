from __future__ import annotations

import pytest
import torch

from lightning_sdp.datamodules.text import CharTextDataModule, CharWindows, builtin_corpus


def test_windows_are_shifted_by_one():
    data = torch.arange(20)
    ds = CharWindows(data, block_size=5, stride=5)
    assert len(ds) == 3
    x, y = ds[1]
    assert x.tolist() == [5, 6, 7, 8, 9] and y.tolist() == [6, 7, 8, 9, 10]
    assert len(CharWindows(data, 5, stride=1)) == 15


def test_builtin_corpus_is_offline_text():
    text = builtin_corpus()
    assert len(text) > 100_000 and text == builtin_corpus()


def test_builtin_split_is_deterministic_and_roundtrips():
    a, b = CharTextDataModule(block_size=16), CharTextDataModule(block_size=16)
    a.setup("fit")
    b.setup("fit")
    assert a.vocab_size == b.vocab_size and torch.equal(a.val_data, b.val_data)
    n = len(a.train_data) + len(a.val_data)
    assert len(a.val_data) == n - int(n * 0.9)
    assert a.decode(a.encode("Hello, world")) == "Hello, world"
    x, y = next(iter(a.train_dataloader()))
    assert x.shape == y.shape == (12, 16) and x.dtype == torch.long
    x2, _ = next(iter(b.train_dataloader()))
    assert torch.equal(x, x2), "the training shuffle is seeded"


def test_vocabulary_is_restored_from_state_dict(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("hello world, hello there " * 10)
    dm = CharTextDataModule(str(p), block_size=4, batch_size=2)
    dm.setup()
    state = dm.state_dict()
    other = CharTextDataModule(str(p), block_size=4, batch_size=2)
    other.load_state_dict({"chars": state["chars"][::-1]})  # a different order
    other.setup()
    assert other.chars == list(state["chars"][::-1])
    assert other.decode(other.train_data[:5]) == "hello"
    # A checkpoint whose vocabulary lacks characters of the text is refused.
    with pytest.raises(ValueError, match="lacks characters"):
        dm.load_state_dict({"chars": "helo"})


def test_bad_input_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CharTextDataModule(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        CharTextDataModule(str(empty)).setup()
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match="not valid UTF-8.*iconv"):
        CharTextDataModule(str(latin)).setup()
    short = tmp_path / "short.txt"
    short.write_text("x" * 100)
    with pytest.raises(ValueError, match="block_size=64 is too long"):
        CharTextDataModule(str(short), block_size=64).setup()
    with pytest.raises(ValueError, match="val_fraction"):
        CharTextDataModule(val_fraction=1.5)
