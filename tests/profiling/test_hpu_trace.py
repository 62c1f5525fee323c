"""HPU (Gaudi) engine-overlap maths on hand-made traces with known answers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from lightning_sdp.profiling.hpu_trace import (
    STATES,
    analyze_trace,
    engine_of_lane,
    load_trace,
    overlap_reference,
    overlap_sweep,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "hpu_traces"


def test_small_trace_known_states():
    ov = analyze_trace(DATA / "gaudi_small.json")
    assert ov.window_us == pytest.approx(100.0)
    expected = {"both": 10, "mme_only": 30, "tpc_only": 25, "dma_only": 15, "other_only": 5, "idle": 15}
    assert ov.states_us == pytest.approx(expected)
    assert sum(ov.states_us.values()) == pytest.approx(ov.window_us)
    assert ov.busy_us["mme"] == pytest.approx(40)
    assert ov.busy_us["tpc"] == pytest.approx(35)
    assert ov.busy_us["dma"] == pytest.approx(15)
    assert ov.busy_us["nic"] == pytest.approx(5)
    assert ov.matrix_on_tpc_us == pytest.approx(5)
    # The host lane is not an engine.
    assert all(not lane.startswith("python3") for lane in ov.lanes)
    cats = ov.categories_us()
    assert cats["matrix"] == pytest.approx(40) and cats["vector"] == pytest.approx(25)
    assert cats["memory"] == pytest.approx(15) and cats["host_other"] == pytest.approx(15)
    assert sum(cats.values()) == pytest.approx(100)


def test_begin_end_gzip_trace():
    ov = analyze_trace(DATA / "gaudi_begin_end.json.gz")
    assert ov.states_us == pytest.approx(
        {"both": 40, "mme_only": 20, "tpc_only": 30, "dma_only": 0, "other_only": 0, "idle": 10}
    )
    fr = ov.state_fractions()
    assert sum(fr.values()) == pytest.approx(1.0)
    assert fr["both"] == pytest.approx(0.4)


def test_explicit_window_clips_and_counts_idle():
    # Window 0..200 on the small trace: the extra 100 us are idle.
    ov = analyze_trace(DATA / "gaudi_small.json", window=(0, 200))
    assert ov.window_us == 200
    assert ov.states_us["idle"] == pytest.approx(115)
    ov2 = analyze_trace(DATA / "gaudi_small.json", window=(20, 45))
    # MME busy over [20,45); TPC from 40 -> both [40,45)=5, mme_only [20,40)=20.
    assert ov2.states_us["both"] == pytest.approx(5)
    assert ov2.states_us["mme_only"] == pytest.approx(20)
    assert sum(ov2.states_us.values()) == pytest.approx(25)


def test_sweep_matches_grid_reference_on_random_intervals():
    rng = random.Random(0)
    for _ in range(20):
        ivs = {}
        for engine in ("mme", "tpc", "dma", "nic"):
            lst = []
            for _ in range(rng.randint(0, 6)):
                s = rng.randint(0, 90)
                lst.append((s, s + rng.randint(1, 15)))
            ivs[engine] = lst
        states, busy, length = overlap_sweep(ivs, window=(0, 110))
        ref = overlap_reference(ivs, (0, 110), resolution=1.0)
        assert states == pytest.approx(ref)
        assert length == 110
        for engine, lst in ivs.items():
            covered = {t for s, e in lst for t in range(s, e)}
            assert busy[engine] == pytest.approx(len(covered))


def test_back_to_back_kernels_do_not_overlap():
    states, _, _ = overlap_sweep({"mme": [(0, 10)], "tpc": [(10, 20)]})
    assert states["both"] == 0
    assert states["mme_only"] == 10 and states["tpc_only"] == 10


def test_lane_names():
    assert engine_of_lane("MME0") == "mme"
    assert engine_of_lane("TPC 12") == "tpc"
    assert engine_of_lane("EDMA3") == "dma"
    assert engine_of_lane("TPC_DMA") == "dma"
    assert engine_of_lane("NIC1") == "nic"
    assert engine_of_lane("thread 7 (python3)") is None


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="no device engine lanes"):
        analyze_trace(DATA / "host_only.json")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable"):
        load_trace(bad)
    nolist = tmp_path / "nolist.json"
    nolist.write_text(json.dumps({"foo": 1}))
    with pytest.raises(ValueError, match="traceEvents"):
        load_trace(nolist)
    with pytest.raises(ValueError, match="ends before"):
        overlap_sweep({"mme": [(5, 1)]})
    with pytest.raises(ValueError, match="unknown engine"):
        overlap_sweep({"gpu": [(0, 1)]})
    unmatched = tmp_path / "unmatched.json"
    unmatched.write_text(
        json.dumps(
            {
                "traceEvents": [
                    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 0, "args": {"name": "MME0"}},
                    {"ph": "E", "pid": 1, "tid": 0, "ts": 5},
                ]
            }
        )
    )
    with pytest.raises(ValueError, match="without a matching 'B'"):
        analyze_trace(unmatched)


def test_states_constant():
    assert STATES == ("both", "mme_only", "tpc_only", "dma_only", "other_only", "idle")
