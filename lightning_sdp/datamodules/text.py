"""Character-level language-modelling data from any UTF-8 text file, or from a built-in offline corpus."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override


class CharWindows(Dataset):
    """Windows of ``block_size + 1`` characters: input ``x = data[i:i+T]``, target ``y = data[i+1:i+T+1]``.

    Args:
        data: 1-D tensor of token ids.
        block_size: window length ``T``.
        stride: distance between window starts (1 for training: every offset; ``T`` for evaluation).
    """

    def __init__(self, data: Tensor, block_size: int, stride: int = 1) -> None:
        if len(data) < block_size + 1:
            raise ValueError(f"Text of {len(data)} characters is too short for block_size={block_size}.")
        self.data, self.block_size, self.stride = data, block_size, stride

    def __len__(self) -> int:
        return (len(self.data) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = i * self.stride
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def builtin_corpus() -> str:
    """English text available offline on any machine: the Python documentation topics shipped with CPython
    (``pydoc_data``, about 0.7 MB). Where a distribution strips ``pydoc_data``, a seeded generated corpus is used."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - depends on the Python build
        return _generated_corpus()
    return "\n\n".join(topics[key] for key in sorted(topics))


def _generated_corpus(n_sentences: int = 20000, seed: int = 0) -> str:
    rng = random.Random(seed)
    subjects = ["the king", "a fool", "my lord", "the queen", "good friar", "this soldier", "her father", "the duke"]
    verbs = ["speaks of", "forgets", "betrays", "remembers", "loves", "fears", "awaits", "commands"]
    objects = ["the crown", "his honour", "the sea", "a letter", "the night", "our quarrel", "thy sword", "the moon"]
    tails = [".", "!", "?", ", and weeps.", ", yet smiles.", " at dawn."]
    lines = []
    for _ in range(n_sentences):
        s = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}{rng.choice(tails)}"
        lines.append(s[0].upper() + s[1:])
    return "\n".join(lines) + "\n"


def read_text(path: str | Path) -> str:
    """Read a UTF-8 text file, with errors that say what was wrong."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"Text file {str(p)!r} does not exist. Pass the path of a UTF-8 text file, "
            "or no path for the built-in corpus."
        )
    if not p.is_file():
        raise ValueError(f"{str(p)!r} is not a file. Pass the path of a UTF-8 text file.")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{str(p)!r} is not valid UTF-8 (byte {err.start}: {raw[err.start : err.start + 1]!r}). Convert it, e.g. "
            f"`iconv -f latin1 -t utf-8 in.txt > out.txt`."
        ) from err
    if not text:
        raise ValueError(f"{str(p)!r} is empty. A character-level model needs some text to learn from.")
    return text


class CharTextDataModule(LightningDataModule):
    """Character-level text for language models, from a UTF-8 file or the built-in corpus.

    The vocabulary (sorted set of characters) is built from the whole text and saved in checkpoints through
    ``state_dict``, so a resumed run encodes the text exactly as before. The split is deterministic: the first
    ``1 - val_fraction`` of the text trains, the rest validates (as in nanoGPT).

    Args:
        path: UTF-8 text file. ``None`` uses :func:`builtin_corpus` (offline on any machine).
        block_size: characters per training window (default 64); must fit in both splits.
        batch_size: windows per batch per process (default 12).
        val_fraction: fraction of the text held out for validation (default 0.1).
        num_workers: DataLoader workers (default 0).
        seed: seed of the training shuffle (default 1337).
    """

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 64,
        batch_size: int = 12,
        val_fraction: float = 0.1,
        num_workers: int = 0,
        seed: int = 1337,
    ) -> None:
        super().__init__()
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}.")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
        if path is not None and not Path(path).expanduser().exists():
            # Fail at construction, before a Trainer is built, with the path the user typed.
            read_text(path)
        self.save_hyperparameters()
        self.path = path
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.seed = seed
        self.chars: list[str] | None = None
        self._stoi: dict[str, int] = {}
        self.train_data: Tensor | None = None
        self.val_data: Tensor | None = None

    @property
    def vocab_size(self) -> int | None:
        return None if self.chars is None else len(self.chars)

    def encode(self, text: str) -> Tensor:
        """Token ids of ``text``; characters outside the vocabulary raise a ``ValueError``."""
        try:
            return torch.tensor([self._stoi[c] for c in text], dtype=torch.long)
        except KeyError as err:
            raise ValueError(f"Character {err.args[0]!r} is not in the vocabulary of this data module.") from None

    def decode(self, ids: Tensor | list[int]) -> str:
        assert self.chars is not None
        return "".join(self.chars[int(i)] for i in ids)

    def _set_vocab(self, chars: list[str]) -> None:
        self.chars = chars
        self._stoi = {c: i for i, c in enumerate(chars)}

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_data is not None:
            return
        text = builtin_corpus() if self.path is None else read_text(self.path)
        chars = self.chars
        if chars is None:
            chars = sorted(set(text))
            self._set_vocab(chars)
        data = self.encode(text)
        n_train = int(len(data) * (1.0 - self.val_fraction))
        need = self.block_size + 1
        if n_train < need or len(data) - n_train < need:
            raise ValueError(
                f"block_size={self.block_size} is too long for this text ({len(data)} characters, split into "
                f"{n_train} train / {len(data) - n_train} validation): each split needs at least block_size + 1 "
                f"characters. Use a smaller block_size or a longer text."
            )
        dtype = torch.uint8 if len(chars) <= 256 else torch.int32
        self.train_data, self.val_data = data[:n_train].to(dtype), data[n_train:].to(dtype)

    @override
    def train_dataloader(self) -> DataLoader:
        assert self.train_data is not None, "call setup() first"
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            CharWindows(self.train_data, self.block_size, stride=1),
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            generator=generator,
            num_workers=self.num_workers,
        )

    @override
    def val_dataloader(self) -> DataLoader:
        assert self.val_data is not None, "call setup() first"
        return DataLoader(
            CharWindows(self.val_data, self.block_size, stride=self.block_size),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
        )

    @override
    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"chars": "".join(self.chars) if self.chars is not None else None, "path": self.path}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("chars")
        if saved is None:
            return
        saved_chars = list(saved)
        if self.chars is not None and self.chars != saved_chars:
            if self.train_data is not None and not set(self.chars) <= set(saved_chars):
                missing = "".join(sorted(set(self.chars) - set(saved_chars)))
                raise ValueError(
                    f"The checkpoint's vocabulary ({len(saved_chars)} characters) lacks characters of this text: "
                    f"{missing!r}. Resume with the text the checkpoint was trained on."
                )
        self._set_vocab(saved_chars)
        if self.train_data is not None:  # re-encode with the checkpoint's vocabulary
            self.train_data = None
            self.setup()
