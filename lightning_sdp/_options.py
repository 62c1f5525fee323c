"""One way to check options: a frozen config dataclass checked from its own annotations.

Every plugin keeps its options in a frozen dataclass (``SimpleXConfig``, ``SDP4BitConfig``, ...). Its
``__post_init__`` calls :func:`check_options`, which reads each field's annotation (``Literal``, ``bool``, ``int``,
``float``, ``str``, ``None``, classes, and unions of these) and raises one of two errors, both naming the option and
what it accepts:

- ``TypeError`` for a value of the wrong type (``margin="0.9"`` where a float is expected);
- ``ValueError`` for a value of the right type that the option does not accept (``backend="fuse"``).

Ranges (positive, in [0, 1), ...) stay explicit checks in the config: an annotation cannot say them.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

__all__ = ["check_option", "check_options"]

_NONE_TYPE = type(None)


def check_options(config: Any, owner: str | None = None) -> None:
    """Check every field of the dataclass instance ``config`` against its annotation.

    Args:
        config: a dataclass instance whose annotations can be resolved (``typing.get_type_hints``).
        owner: prefix of the messages, e.g. ``"SimpleXModule"``; default: no prefix.

    Raises:
        TypeError: a field holds a value of a type its annotation does not admit.
        ValueError: a field holds a value of an admitted type that is not one of its ``Literal`` choices.
    """
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        check_option(field.name, getattr(config, field.name), hints[field.name], owner)


def check_option(name: str, value: Any, annotation: Any, owner: str | None = None) -> None:
    """Check one value against one annotation; see :func:`check_options` for the rules and errors."""
    choices, classes = _flatten(annotation)
    if any(_is_choice(value, choice) for choice in choices) or any(_is_instance(value, cls) for cls in classes):
        return
    prefix = f"{owner}: " if owner else ""
    accepted = _describe(choices, classes)
    if any(type(value) is type(choice) for choice in choices):
        raise ValueError(f"{prefix}{name} must be {accepted}, got {value!r}.")
    raise TypeError(f"{prefix}{name} must be {accepted}, got {value!r} ({type(value).__name__}).")


def _flatten(annotation: Any) -> tuple[list[Any], list[Any]]:
    """The ``Literal`` values and the classes an annotation admits (unions and ``Optional`` unfolded)."""
    origin = get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        choices: list[Any] = []
        classes: list[Any] = []
        for arg in get_args(annotation):
            more_choices, more_classes = _flatten(arg)
            choices += more_choices
            classes += more_classes
        return choices, classes
    if origin is Literal:
        return list(get_args(annotation)), []
    if annotation is None:
        return [], [_NONE_TYPE]
    return [], [origin or annotation]  # list[int] -> list: the container is checked, not its items


def _is_choice(value: Any, choice: Any) -> bool:
    # type first: True == 1 and 1 == 1.0, but a flag is not a count
    return type(value) is type(choice) and value == choice


def _is_instance(value: Any, cls: Any) -> bool:
    if cls is Any:
        return True
    if cls is bool:
        return isinstance(value, bool)
    if cls is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if cls is float:  # an int is a valid float, as in the typing rules
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(cls, type) and isinstance(value, cls)


_ARTICLES = {int: "an int", float: "a number", bool: "a bool (True or False)", str: "a string", _NONE_TYPE: "None"}


def _describe(choices: list[Any], classes: list[Any]) -> str:
    words = [repr(choice) for choice in choices]
    words += [_ARTICLES.get(cls, f"a {getattr(cls, '__name__', cls)}") for cls in classes if cls is not _NONE_TYPE]
    if _NONE_TYPE in classes:
        words.append("None")
    if len(words) == 1:
        return words[0]
    if not classes:
        return f"one of {', '.join(words)}"
    return f"{', '.join(words[:-1])} or {words[-1]}"
