"""The guide's hit-rate table is what its own snippet computes (the table is not copied from a run)."""

from __future__ import annotations

import re
from pathlib import Path

from lightning_sdp.datamodules.solar import SolarSchedule

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "solar.md"
#: the table's columns after "ranks": (eviction, reroute)
COLUMNS = [("lru", True), ("fifo", True), ("solar", True), ("artifact_fifo", True), ("belady", False), ("belady", True)]


def _table_rows() -> dict[int, list[str]]:
    text = GUIDE.read_text(encoding="utf-8")
    caption = text.index("Mean hit rate over epochs 1-3")
    rows = {}
    for line in text[caption:].splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        cells = [cell.strip().strip("*") for cell in line.strip().strip("|").split("|")]
        if cells and cells[0].isdigit():
            rows[int(cells[0])] = cells[1:]
    return rows


def _mean_later_hit_rate(world_size: int, eviction: str, reroute: bool) -> float:
    schedule = SolarSchedule(
        num_samples=10_000,
        num_epochs=4,
        world_size=world_size,
        local_batch_size=16,
        buffer_size=2_500,
        eviction=eviction,
        reroute=reroute,
    )
    later = schedule.simulate(sample_nbytes=48 * 1024).hit_rate[1:]  # epoch 0 starts with an empty buffer
    return sum(later) / len(later)


def test_the_guides_hit_rate_table_is_what_the_schedule_computes() -> None:
    rows = _table_rows()
    assert set(rows) == {1, 4}, f"docs/solar.md: expected hit-rate rows for 1 and 4 ranks, found {sorted(rows)}"
    for ranks, cells in rows.items():
        assert len(cells) == len(COLUMNS)
        computed = [f"{_mean_later_hit_rate(ranks, eviction, reroute):.3f}" for eviction, reroute in COLUMNS]
        assert cells == computed, f"docs/solar.md hit rates at {ranks} ranks: the table says {cells}, now {computed}"
        assert all(re.fullmatch(r"\d\.\d{3}", cell) for cell in cells)
