"""The one option checker: every config dataclass of the package is checked from its annotations by it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from lightning_sdp._options import check_option, check_options


@dataclass(frozen=True)
class _Options:
    backend: Literal["fused", "reference"] = "fused"
    margin: float = 0.9
    count: int = 64
    flag: bool = True
    clip: float | Literal["auto"] | None = "auto"
    path: str | Path = "data.h5"
    size: int | None = None

    def __post_init__(self) -> None:
        check_options(self, "Thing")


def test_defaults_and_admitted_values_pass():
    _Options()
    _Options(backend="reference", margin=1, count=3, flag=False, clip=0.5, path=Path("x"), size=None)
    _Options(clip=None, size=7)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"margin": "0.9"}, "Thing: margin must be a number, got '0.9' (str)."),
        ({"count": "64"}, "Thing: count must be an int, got '64' (str)."),
        ({"count": 64.0}, "Thing: count must be an int, got 64.0 (float)."),
        ({"count": True}, "Thing: count must be an int, got True (bool)."),
        ({"flag": 1}, "Thing: flag must be a bool (True or False), got 1 (int)."),
        ({"clip": [1]}, "Thing: clip must be 'auto', a number or None, got [1] (list)."),
        ({"size": 2.5}, "Thing: size must be an int or None, got 2.5 (float)."),
    ],
)
def test_wrong_types_raise_type_error_naming_the_option(kwargs, words):
    with pytest.raises(TypeError) as info:
        _Options(**kwargs)
    assert str(info.value) == words


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"backend": "fuse"}, "Thing: backend must be one of 'fused', 'reference', got 'fuse'."),
        ({"clip": "none"}, "Thing: clip must be 'auto', a number or None, got 'none'."),
    ],
)
def test_wrong_choices_raise_value_error_naming_what_is_accepted(kwargs, words):
    with pytest.raises(ValueError) as info:
        _Options(**kwargs)
    assert str(info.value) == words


def test_a_single_option_without_owner():
    check_option("mode", "a", Literal["a", "b"])
    with pytest.raises(ValueError, match=r"^mode must be one of 'a', 'b', got 'c'\.$"):
        check_option("mode", "c", Literal["a", "b"])
    with pytest.raises(TypeError, match=r"^items must be a list, got \(1,\) \(tuple\)\.$"):
        check_option("items", (1,), list[int])
