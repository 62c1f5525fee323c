"""The package's one file writer: whole files or none, open()'s modes without touching the umask, errors that name
the file; and the readers' errors that name the file."""

from __future__ import annotations

import ast
import errno
import os
from pathlib import Path

import pytest

import lightning_sdp
from lightning_sdp import _files
from lightning_sdp._files import atomic_path, naming_the_file, write_text_atomic
from tests._full_disk import small_disk

PACKAGE = Path(lightning_sdp.__file__).parent


def test_nothing_in_the_package_reads_or_sets_the_umask():
    """``os.umask`` reads the mask only by setting it: meanwhile other threads create files with the wrong mode."""
    calls = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "umask":
                calls.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert calls == []


def _calls_atomic_primitives(path: Path) -> bool:
    """Whether ``path`` calls ``os.replace``, ``os.rename`` or ``tempfile.mkstemp`` (the parts of an atomic write)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
            continue
        if node.value.id in ("os", "tempfile") and node.attr in ("replace", "rename", "mkstemp"):
            return True
    return False


def test_one_atomic_writer_in_the_repository():
    """``os.replace`` (the atomic rename) appears only in the one writer, ``lightning_sdp/_files.py``: the benchmarks
    and their tools write through it too."""
    root = PACKAGE.parent
    files = [p for folder in ("lightning_sdp", "benchmarks", "examples") for p in (root / folder).rglob("*.py")]
    users = sorted(str(p.relative_to(root)) for p in files if _calls_atomic_primitives(p))
    assert users == ["lightning_sdp/_files.py"]


@pytest.fixture
def umask_027():
    old = os.umask(0o027)  # the test sets it; the package must only respect it
    try:
        yield
    finally:
        os.umask(old)


def test_new_files_get_the_mode_open_gives_them(tmp_path, umask_027, monkeypatch):
    def no_umask(mask: int) -> int:
        raise AssertionError("os.umask was called")

    monkeypatch.setattr(os, "umask", no_umask)
    plain = write_text_atomic(tmp_path / "report.json", "{}\n")
    private = write_text_atomic(tmp_path / "config.json", "{}\n", private=True)
    with open(tmp_path / "by_open.json", "w") as fh:
        fh.write("{}\n")
    assert plain.stat().st_mode & 0o777 == (tmp_path / "by_open.json").stat().st_mode & 0o777 == 0o640
    assert private.stat().st_mode & 0o777 == 0o600
    from lightning_sdp.datamodules.solar.ptycho import make_ptycho_h5

    h5 = make_ptycho_h5(tmp_path / "p.h5", num_samples=4, size=8)
    assert h5.stat().st_mode & 0o777 == 0o640
    assert sorted(os.listdir(tmp_path)) == ["by_open.json", "config.json", "p.h5", "report.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing_else(tmp_path, monkeypatch):
    path = write_text_atomic(tmp_path / "report.json", '{"run": 1}\n')

    def failing_replace(src, dst):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_files.os, "replace", failing_replace)
    with pytest.raises(OSError, match=rf"Input/output error \(writing {path}\)"):
        write_text_atomic(path, '{"run": 2}\n')
    assert path.read_text() == '{"run": 1}\n'
    assert os.listdir(tmp_path) == ["report.json"]
    with pytest.raises(KeyboardInterrupt), atomic_path(path) as tmp:  # an interrupt mid-write
        tmp.write_text("half")
        raise KeyboardInterrupt
    assert os.listdir(tmp_path) == ["report.json"]


def test_full_disk_gives_an_error_naming_the_file_and_no_partial_file(tmp_path, monkeypatch):
    with small_disk(tmp_path, 64) as disk:
        folder = disk if disk is not None else tmp_path / "emulated"
        folder.mkdir(exist_ok=True)
        path = write_text_atomic(folder / "report.json", '{"run": 1}\n')
        if disk is None:  # not root here: the write itself reports the full disk

            def full(self, data):
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(Path, "write_bytes", full)
        with pytest.raises(OSError, match=rf"No space left on device \(writing {path}\)"):
            write_text_atomic(path, "x" * (1 << 20))
        assert path.read_text() == '{"run": 1}\n'
        assert os.listdir(folder) == ["report.json"]


def test_naming_the_file_names_it_for_decoding_and_csv_errors(tmp_path):
    import csv

    path = tmp_path / "pairs.csv"
    path.write_bytes("filepath\ttitle\na.png\tcaf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{path}: not UTF-8 .*latin-1"), naming_the_file(path):
        path.read_text(encoding="utf-8")
    path.write_text('a\t"' + "x" * (csv.field_size_limit() + 10) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:1: cannot parse .*field limit.*unclosed quote"), path.open() as fh:
        reader = csv.reader(fh, delimiter="\t")
        with naming_the_file(path, line=lambda: reader.line_num):
            list(reader)


# ---------------------------------------------------------------- the readers name the file (and line)
def test_interaction_readers_name_file_and_line_for_latin1_and_csv_field_limit(tmp_path):
    import csv

    from lightning_sdp.datamodules.interactions.readers import read_id_table, read_lightgcn

    table = tmp_path / "ratings.csv"
    table.write_bytes(b"user,item\n1,2\n" * 2000 + "3,4 caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{table}:4001: not UTF-8 .*latin-1"):
        read_id_table(table)
    table.write_text('user,item\n1,2\n3,"' + "9" * (csv.field_size_limit() + 1) + "\n")
    with pytest.raises(ValueError, match=rf"{table}:\d+: cannot parse the file as CSV .*field limit"):
        read_id_table(table)
    lightgcn = tmp_path / "train.txt"
    lightgcn.write_bytes(b"0 1 2\n" + "1 3 \xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{lightgcn}:2: not UTF-8"):
        read_lightgcn(lightgcn)


def test_image_caption_readers_name_file_and_line(tmp_path):
    import csv

    from lightning_sdp.datamodules.image_text.readers import read_csv_pairs, read_folder_pairs

    pairs = tmp_path / "pairs.tsv"
    pairs.write_bytes("filepath\ttitle\na.png\tcaf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{pairs}:2: not UTF-8"):
        read_csv_pairs(pairs)
    pairs.write_text('filepath\ttitle\na.png\t"' + "x" * (csv.field_size_limit() + 1) + "\n")
    with pytest.raises(ValueError, match=rf"{pairs}:\d+: cannot parse .*field limit.*csv_separator"):
        read_csv_pairs(pairs)
    (tmp_path / "captions.tsv").write_bytes("a.png\tcaf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'captions.tsv'}:1: not UTF-8"):
        read_folder_pairs(tmp_path)
