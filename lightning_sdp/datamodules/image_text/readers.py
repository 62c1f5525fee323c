"""Readers of image-caption pairs on disk: OpenCLIP's CSV convention and an image folder with a captions file."""

from __future__ import annotations

import csv
from pathlib import Path

from lightning_sdp._files import naming_the_file, utf8_lines


def read_csv_pairs(
    path: str | Path, img_key: str = "filepath", caption_key: str = "title", separator: str = "\t"
) -> tuple[list[Path], list[str]]:
    """Read OpenCLIP's CSV convention: one row per pair, an image-path column and a caption column.

    Relative image paths are resolved against the CSV file's folder.

    Args:
        path: CSV/TSV file.
        img_key: image path column. Default ``filepath``.
        caption_key: caption column. Default ``title``.
        separator: column separator. Default tab.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"CSV file not found: {path}")
    with path.open("rb") as f:
        reader = csv.DictReader(utf8_lines(f, path), delimiter=separator)
        with naming_the_file(path, line=lambda: reader.line_num, hint="Check csv_separator and the file's quoting."):
            fields = reader.fieldnames or []
            for key in (img_key, caption_key):
                if key not in fields:
                    raise KeyError(
                        f"Column {key!r} not in {path} (columns: {fields}). Set csv_img_key/csv_caption_key/"
                        "csv_separator."
                    )
            rows = list(reader)
    for line, r in enumerate(rows, 2):
        for key in (img_key, caption_key):
            if r.get(key) is None:
                raise ValueError(
                    f"{path}:{line}: the row has no {key!r} value (it has fewer columns than the header "
                    f"{fields}). Fix the row, or check csv_separator ({separator!r})."
                )
    return [_resolve(path.parent, r[img_key]) for r in rows], [r[caption_key] for r in rows]


def read_folder_pairs(folder: str | Path, captions_file: str = "captions.tsv") -> tuple[list[Path], list[str]]:
    """Read an image folder with a captions file of ``file_name<TAB>caption`` lines.

    Args:
        folder: the image folder.
        captions_file: captions file inside ``folder``. Default ``captions.tsv``.
    """
    folder = Path(folder)
    cap = folder / captions_file
    if not cap.is_file():
        raise FileNotFoundError(f"Captions file not found: {cap} (expected lines 'file_name<TAB>caption').")
    paths, captions = [], []
    with cap.open("rb") as f:
        lines = list(utf8_lines(f, cap))
    for n, line in enumerate((raw.rstrip("\r\n") for raw in lines), 1):
        if not line.strip():
            continue
        if "\t" not in line:
            raise ValueError(f"{cap}:{n}: expected 'file_name<TAB>caption', got {line!r}.")
        name, caption = line.split("\t", 1)
        paths.append(_resolve(folder, name))
        captions.append(caption.strip())
    return paths, captions


def _resolve(base: Path, name: str) -> Path:
    p = Path(name)
    return p if p.is_absolute() else base / p


__all__ = ["read_csv_pairs", "read_folder_pairs"]
