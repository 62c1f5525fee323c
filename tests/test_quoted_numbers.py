"""Every measured number the README and the guides quote is in the results file they link.

A *quoted number* is a decimal (``0.93``), a ratio (``6.75x``) or a share (``36.1%``) in prose or a table, outside
code, link targets and the guides' "Options" and "How it works" sections (defaults and the algorithm's constants,
not measurements). It belongs to the paragraph, list item or table it stands in. Every such block must link at
least one ``benchmarks/results/<stem>.md`` (or ``.png``) unless it quotes a paper (it says "paper"), and every number in it
must be written in one of the linked result pages (``.md``, rendered from the run's json), as the guide writes it or
with more decimals that round to it. A block without links of its own takes those of its section (a table's caption,
a list's introduction). A block right after ``<!-- computed by tests/<file>.py -->`` is that test's to check. So a rerun that moves a number breaks this test until the text follows.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXEMPT_SECTIONS = re.compile(r"^#+\s*(options|how it works)\b", re.IGNORECASE)

_LINK = re.compile(r"\]\((?:\.\./)?benchmarks/results/([\w./-]+?)\.(?:md|png|json)(?:#[^)]*)?\)")
_COMPUTED = re.compile(r"<!-- computed by (tests/[\w/.-]+\.py) -->")
_NUMBER = re.compile(r"(?<![\w.,/])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(\s?[x%])?(?![\w]|\.\d)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    text: str
    links: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _raw_blocks(path: Path) -> Iterator[tuple[int, str, int]]:
    """(first line, text, section) of every paragraph, list item and table outside code and exempt sections."""
    fence = exempt = table = False
    start, lines, section = 0, [], 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fence = not fence
            stripped = ""
        heading = stripped.startswith("#") and not fence
        new_item = bool(re.match(r"^([-*+]|\d+\.)\s", stripped))
        is_row = stripped.startswith("|")
        if fence or not stripped or heading or new_item or is_row != table:
            if lines and not exempt:
                yield start, " ".join(lines), section
            lines, table = [], False
        if heading:
            exempt = bool(EXEMPT_SECTIONS.match(stripped))
            section += 1
        if fence or not stripped or heading:
            continue
        if not lines:
            start, table = number, is_row
        lines.append(stripped)
    if lines and not exempt:
        yield start, " ".join(lines), section


def blocks(path: Path) -> list[Block]:
    """The blocks of ``path``, each with its own result links, or its section's when it has none."""
    raw = list(_raw_blocks(path))
    by_section: dict[int, list[str]] = {}
    for _, text, section in raw:
        by_section.setdefault(section, []).extend(_LINK.findall(text))
    found = []
    for i, (line, text, section) in enumerate(raw):
        computed = _COMPUTED.search(raw[i - 1][1]) if i else None
        if computed:  # the block after the marker is a test's output: that test checks it
            assert (ROOT / computed.group(1)).is_file(), f"{path}:{line} names a test that does not exist"
            continue
        links = _LINK.findall(text) or by_section[section]
        found.append(Block(path, line, text, tuple(dict.fromkeys(links))))
    return found


def quoted_numbers(text: str) -> list[str]:
    """The decimals, ratios and shares of ``text``, without code, link targets, HTML comments and arXiv ids."""
    text = re.sub(
        r"`[^`]*`|<!--.*?-->|\]\([^)]*\)|arXiv[: ]\s*\d+\.\d+|\b\d+e-?\d+\b|(Python|torch) \d+\.\d+", " ", text
    )
    numbers = []
    for match in _NUMBER.finditer(text):
        whole, fraction, suffix = match.groups()
        if fraction or suffix:
            numbers.append(whole + (fraction or ""))
    return numbers


@cache
def _written(stem: str) -> tuple[tuple[float, int], ...]:
    """Every number written in a result page, with its count of decimals."""
    text = (RESULTS / f"{stem}.md").read_text(encoding="utf-8").replace(",", "")
    return tuple((float(m.group()), len(m.group(1) or "")) for m in re.finditer(r"\d+(?:\.(\d+))?", text))


def is_in_results(number: str, stems: tuple[str, ...]) -> bool:
    """Whether a page of ``stems`` writes ``number``, or a number with at least as many decimals that rounds to it."""
    plain = number.replace(",", "")
    decimals = len(plain.partition(".")[2])
    for stem in stems:
        for value, written_decimals in _written(stem):
            if value == float(plain) or (written_decimals >= decimals and f"{value:.{decimals}f}" == plain):
                return True
    return False


def _all_blocks() -> list[Block]:
    return [block for path in DOC_FILES for block in blocks(path) if quoted_numbers(block.text)]


@pytest.mark.parametrize("block", _all_blocks(), ids=str)
def test_quoted_numbers_are_in_the_linked_results(block: Block) -> None:
    missing_files = [stem for stem in block.links if not (RESULTS / f"{stem}.md").exists()]
    assert not missing_files, f"{block} links results that do not exist: {missing_files}"
    if not block.links:
        assert "paper" in block.text.lower(), (
            f"{block} quotes {quoted_numbers(block.text)} without linking the results file they come from "
            f"(benchmarks/results/<stem>.md): {block.text[:200]}"
        )
        return
    absent = [n for n in quoted_numbers(block.text) if not is_in_results(n, block.links)]
    assert not absent, f"{block}: {absent} are not in {list(block.links)}: {block.text[:200]}"


def test_the_checker_reads_numbers_blocks_and_results_as_documented(tmp_path: Path) -> None:
    assert quoted_numbers("6.75x DDP, 36.1% top-1, 1,189 tests, `lr=0.5`, 2 cores, arXiv 2211.00224, 1e-8") == [
        "6.75",
        "36.1",
    ]
    doc = tmp_path / "guide.md"
    doc.write_text(
        "# Guide\n\nIt ran 2.50x faster ([r](../benchmarks/results/gpu_checks.md)).\n\n"
        "| a | b |\n|---|---|\n| 0.25 | 1 |\n\nThe table above: [r](../benchmarks/results/gpu_checks.md).\n\n"
        "## Options\n\n- `lr`: 0.5 by default\n"
    )
    found = [block for block in blocks(doc) if quoted_numbers(block.text)]
    assert [block.line for block in found] == [3, 5]
    assert all(block.links == ("gpu_checks",) for block in found)
    # the headline run's page writes 8.05 and -0.1727 (a gap quoted as 0.17%), never 8.04 or 12345.678
    stems = ("sdp4bit_throughput",)
    assert is_in_results("8.05", stems) and is_in_results("0.17", stems)
    assert not is_in_results("8.04", stems) and not is_in_results("12345.678", stems)
