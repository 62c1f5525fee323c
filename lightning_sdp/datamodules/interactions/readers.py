"""Readers of interaction files, and the seeded synthetic catalogue.

One rule for ids in every file (LightGCN and CSV/TSV alike): an id is a non-negative decimal integer of at most 18
digits (``0``, ``42``, ``007`` == ``7``), surrounded by optional whitespace. Anything else (``-1``, ``1.0``, ``1e3``,
``+4``, ``1_000``, ``u17``) is refused with the file and line. String ids are never guessed: map them to integers
first (for example with ``pandas.factorize``).
"""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

from lightning_sdp._files import naming_the_file, utf8_lines

ID_RULE = "ids must be non-negative decimal integers of at most 18 digits, e.g. 0 or 42 (as in LightGCN files)"
_ID = re.compile(r"[0-9]{1,18}")
_LIGHTGCN_LINE = re.compile(r"[0-9]{1,18}(?:[ \t]+[0-9]{1,18})*")


class Pairs(NamedTuple):
    """``(user, item)`` pairs read from ``path``, with the line each pair came from (for error messages) and, when a
    weight column was read, each pair's value in it."""

    users: np.ndarray
    items: np.ndarray
    lines: np.ndarray
    path: Path | None = None
    values: np.ndarray | None = None

    def keep(self, mask: np.ndarray) -> Pairs:
        """The pairs where ``mask`` is true."""
        values = None if self.values is None else self.values[mask]
        return Pairs(self.users[mask], self.items[mask], self.lines[mask], self.path, values)

    def where(self, position: int) -> str:
        """``file:line`` of the pair at ``position``."""
        return f"{self.path}:{int(self.lines[position])}" if self.path is not None else f"pair {position}"


def _empty(path: Path | None) -> Pairs:
    return Pairs(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), path)


def _bad_id(path: Path, lineno: int, token: str, what: str = "") -> ValueError:
    label = f"{what} id" if what else "id"
    token = token.strip()
    if token.startswith("-") and _ID.fullmatch(token[1:]):
        problem = f"negative {label} {token!r}"
    else:
        problem = f"{label} {token!r} is not a non-negative decimal integer"
    return ValueError(f"{path}:{lineno}: {problem}; {ID_RULE}. Map other ids to integers first.")


def read_lightgcn(path: Path) -> Pairs:
    """A LightGCN file: one line ``user item item ...`` per user, blank lines skipped.

    Args:
        path: ``train.txt`` or ``test.txt``.

    Raises:
        ValueError: naming the file and line, for an id that breaks the id rule (see the module docstring).
    """
    users: list[np.ndarray] = []
    items: list[np.ndarray] = []
    lines: list[np.ndarray] = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(utf8_lines(f, path), 1):
            text = line.strip()
            if not text:
                continue
            if not _LIGHTGCN_LINE.fullmatch(text):
                bad = next((t for t in text.split() if not _ID.fullmatch(t)), text)
                raise _bad_id(path, lineno, bad)
            ids = np.array(list(map(int, text.split())), dtype=np.int64)
            users.append(np.full(len(ids) - 1, ids[0], dtype=np.int64))
            items.append(ids[1:])
            lines.append(np.full(len(ids) - 1, lineno, dtype=np.int64))
    if not users:
        return _empty(path)
    return Pairs(np.concatenate(users), np.concatenate(items), np.concatenate(lines), path)


def read_id_table(path: Path, weight_column: int | str | None = None) -> Pairs:
    """A ``user,item`` table: comma-separated for ``.csv``, tab-separated otherwise; extra columns are ignored.

    The first non-empty row is a header when neither of its first two fields is an id (``user_id,item_id``);
    every other row must hold two ids that follow the id rule (see the module docstring). The ids are returned as
    read; :class:`InteractionsDataModule` re-maps them to ``0..n-1``.

    Args:
        path: the file.
        weight_column: also read this column (0-based index, or its name in the header) as each pair's value,
            a positive number (e.g. a play count); ``None`` reads none. Default ``None``.

    Raises:
        ValueError: naming the file and line, for a short row, an id that breaks the rule or a value that is not a
            positive number; when the file has no interactions; or for a weight column the header does not name.
    """
    delimiter = "," if path.suffix.lower() == ".csv" else "\t"
    users: list[int] = []
    items: list[int] = []
    lines: list[int] = []
    values: list[float] = []
    column = weight_column if isinstance(weight_column, int) else None
    first = True
    with open(path, "rb") as f:
        reader = csv.reader(utf8_lines(f, path), delimiter=delimiter)
        with naming_the_file(path, line=lambda: reader.line_num):
            rows = list(enumerate(reader, 1))
        for lineno, row in rows:
            if not row or not "".join(row).strip():
                continue
            if len(row) < 2:
                raise ValueError(f"{path}:{lineno}: expected `user{delimiter}item`, got {delimiter.join(row)!r}.")
            user, item = row[0].strip(), row[1].strip()
            user_ok, item_ok = bool(_ID.fullmatch(user)), bool(_ID.fullmatch(item))
            if first and not user_ok and not item_ok:
                first = False
                if isinstance(weight_column, str):
                    column = _header_column(path, row, weight_column)
                continue  # header
            first = False
            if not user_ok:
                raise _bad_id(path, lineno, user, "user")
            if not item_ok:
                raise _bad_id(path, lineno, item, "item")
            users.append(int(user))
            items.append(int(item))
            lines.append(lineno)
            if weight_column is not None:
                values.append(_weight_value(path, lineno, row, column, weight_column))
    if not users:
        raise ValueError(f"{path}: no interactions found (expected rows `user{delimiter}item`).")
    read = np.array(values, np.float64) if weight_column is not None else None
    return Pairs(np.array(users, np.int64), np.array(items, np.int64), np.array(lines, np.int64), path, read)


def _header_column(path: Path, header: list[str], name: str) -> int:
    names = [h.strip() for h in header]
    if name not in names:
        raise ValueError(f"{path}: the header {names} has no column {name!r} (weight_column); name one of them.")
    return names.index(name)


def _weight_value(path: Path, lineno: int, row: list[str], column: int | None, asked: int | str) -> float:
    """The weight column's value on one row: a positive finite number."""
    if column is None:
        raise ValueError(f"{path}: weight_column={asked!r} names a header column, but the file has no header row.")
    if column < 2 or column >= len(row):
        raise ValueError(
            f"{path}:{lineno}: weight_column={asked!r} is column {column}, but the row has columns 0-{len(row) - 1} "
            "and columns 0 and 1 are the user and item ids."
        )
    text = row[column].strip()
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (np.isfinite(value) and value > 0):
        raise ValueError(
            f"{path}:{lineno}: the weight {text!r} (column {column}) is not a positive number; a weight must be > 0 "
            "(drop rows of zero interactions, they carry no signal)."
        )
    return value


def synthetic_interactions(
    num_users: int, num_items: int, interactions_per_user: int, alpha: float, num_clusters: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """A seeded synthetic catalogue: power-law item popularity and user taste clusters.

    Each user belongs to one of ``num_clusters`` taste clusters; 80% of their items come from their cluster's items
    and 20% from the whole catalogue, both with Zipf-like popularity ``rank^-alpha``. The number of items per user
    is geometric-like around ``interactions_per_user`` (at least 2).

    Returns:
        ``(users, items)`` int64 arrays of unique pairs.
    """
    rng = np.random.default_rng(seed)
    pop = np.arange(1, num_items + 1, dtype=np.float64) ** (-alpha)
    pop = pop[rng.permutation(num_items)]
    item_cluster = rng.integers(0, num_clusters, num_items)
    user_cluster = rng.integers(0, num_clusters, num_users)
    cluster_items = [np.flatnonzero(item_cluster == c) for c in range(num_clusters)]
    cluster_p = [pop[ci] / pop[ci].sum() if len(ci) else None for ci in cluster_items]
    all_p = pop / pop.sum()
    counts = np.maximum(2, rng.geometric(1.0 / max(interactions_per_user, 1), num_users))
    counts = np.minimum(counts, max(2, num_items // 2))
    users, items = [], []
    for u in range(num_users):
        c = user_cluster[u]
        k = int(counts[u])
        n_in = rng.binomial(k, 0.8) if cluster_p[c] is not None else 0
        chosen = []
        if n_in:
            chosen.append(rng.choice(cluster_items[c], size=n_in, p=cluster_p[c]))
        chosen.append(rng.choice(num_items, size=k - n_in, p=all_p))
        its = np.unique(np.concatenate(chosen))
        users.append(np.full(len(its), u, dtype=np.int64))
        items.append(its.astype(np.int64))
    return np.concatenate(users), np.concatenate(items)


__all__ = ["ID_RULE", "Pairs", "read_id_table", "read_lightgcn", "synthetic_interactions"]
