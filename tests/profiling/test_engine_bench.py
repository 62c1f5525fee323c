"""Engine microbenchmarks: device profile, per-device cache, roofline and the ``engine-bench`` command.

Sizes are tiny and timings are only checked for sanity (> 0): the machine is shared.
"""

from __future__ import annotations

import json

import pytest
import torch

import lightning_sdp.profiling.engine_bench as eb
from lightning_sdp.profiling.breakdown import CategoryBreakdown
from lightning_sdp.profiling.categories import CATEGORIES
from lightning_sdp.profiling.engine_bench import (
    VECTOR_KERNELS,
    DeviceProfile,
    cache_path,
    cached_engine_peaks,
    measure_engine_peaks,
    plot_roofline,
)
from lightning_sdp.profiling.flops import WorkCount
from lightning_sdp.profiling.report import build_report, roofline_points
from lightning_sdp.profiling.results import DeviceInfo, EngineReport, ModelDims


def _report() -> EngineReport:
    """A report of one window: 1 GFLOP of matrix work in 0.2 ms, 1 M vector elements in 0.1 ms."""
    times = {c: 0.0 for c in CATEGORIES}
    times.update(matrix=200.0, vector=100.0)
    work = WorkCount(matrix_flops=1_000_000_000)
    work.elements["vector"] = 1_000_000
    work.bytes.update(matrix=10_000_000, vector=8_000_000)
    return build_report(
        breakdown=CategoryBreakdown(span_us=300.0, times_us=times),
        steps=1,
        device=DeviceInfo(type="cpu"),
        work=work,
        peaks={"matrix_tflops": None, "vector_tflops": None, "mem_gbps": None},
        batch_shapes=[],
        model_dims=ModelDims(),
    )


TINY = {
    "gemm_shapes": [(32, 32, 32), (64, 16, 32)],
    "vector_sizes": [1 << 10],
    "min_time_s": 1e-4,
    "repeats": 1,
}


@pytest.fixture
def tiny_defaults(monkeypatch):
    """Make the quick mode's default sizes tiny (for the cache and CLI paths, which use the defaults)."""
    monkeypatch.setitem(eb._GEMMS, ("cpu", True), ((32, 32, 32),))
    monkeypatch.setitem(eb._VECTOR_SIZES, ("cpu", True), (1 << 10,))
    monkeypatch.setitem(eb._MIN_TIME_S, True, 1e-4)
    monkeypatch.setitem(eb._REPEATS, True, 1)


def test_measure_reports_matrix_and_vector_ceilings():
    threads = torch.get_num_threads()
    p = measure_engine_peaks("cpu", num_threads=1, dtypes=["fp32", "bf16"], quick=True, **TINY)
    assert torch.get_num_threads() == threads  # restored
    assert p.device_type == "cpu" and p.num_threads == 1 and p.device_name
    assert set(p.matrix) == {"fp32", "bf16"}
    assert [(r["m"], r["n"], r["k"]) for r in p.matrix["fp32"]["shapes"]] == TINY["gemm_shapes"]
    assert p.matrix["fp32"]["tflops"] == max(r["tflops"] for r in p.matrix["fp32"]["shapes"]) > 0
    assert tuple(p.vector) == VECTOR_KERNELS
    assert all(row["gbps"] > 0 and row["gelem_per_s"] > 0 for rows in p.vector.values() for row in rows)
    peaks = p.peaks("fp32")
    assert peaks["matrix_tflops"] > 0 and peaks["vector_tflops"] > 0 and peaks["mem_gbps"] > 0
    assert p.peaks("fp8")["matrix_tflops"] is None  # not measured: unknown, not guessed


def test_unsupported_dtype_is_recorded_not_dropped():
    with pytest.warns(UserWarning, match="tf32 matmul skipped"):
        p = measure_engine_peaks("cpu", dtypes=["fp32", "tf32"], vector=False, **TINY)
    assert "tf32" not in p.matrix and "CUDA" in p.skipped["tf32"]
    with pytest.raises(ValueError, match="num_threads"):
        measure_engine_peaks("cpu", num_threads=0)


def test_profile_round_trips_through_json(tmp_path):
    p = measure_engine_peaks("cpu", dtypes=["fp32"], **TINY)
    path = p.save(tmp_path / "sub" / "profile.json")
    assert DeviceProfile.load(path) == p
    assert "| fp32 |" in p.table()
    with pytest.raises(ValueError, match="not a device profile"):
        DeviceProfile.from_dict({"version": -1})


def test_cache_is_keyed_per_device_and_reused(tmp_path, monkeypatch, tiny_defaults):
    p1, path, cached = cached_engine_peaks("cpu", num_threads=1, dtypes=["fp32"], cache_dir=tmp_path)
    assert not cached and path.is_file()
    assert path == cache_path("cpu", p1.device_name, 1, tmp_path)
    assert "-1t-" in path.name and torch.__version__ in path.name
    # A second run does not measure again.
    monkeypatch.setattr(eb, "measure_engine_peaks", lambda *a, **k: pytest.fail("measured again"))
    p2, path2, cached2 = cached_engine_peaks("cpu", num_threads=1, dtypes=["fp32"], cache_dir=tmp_path)
    assert cached2 and path2 == path and p2 == p1
    # Another thread count is another device key.
    assert cache_path("cpu", p1.device_name, 2, tmp_path) != path


def test_cache_adds_missing_dtypes_and_survives_a_corrupt_file(tmp_path, tiny_defaults):
    p1, path, _ = cached_engine_peaks("cpu", num_threads=1, dtypes=["fp32"], cache_dir=tmp_path)
    p2, _, cached = cached_engine_peaks("cpu", num_threads=1, dtypes=["fp32", "bf16"], cache_dir=tmp_path)
    assert not cached and set(p2.matrix) == {"fp32", "bf16"}
    assert p2.vector == p1.vector  # only the missing dtype was measured
    assert set(json.loads(path.read_text())["matrix"]) == {"fp32", "bf16"}
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable cache file"):
        p3, _, cached3 = cached_engine_peaks("cpu", num_threads=1, dtypes=["fp32"], cache_dir=tmp_path)
    assert not cached3 and p3.matrix["fp32"]["tflops"] > 0


def test_roofline_png_with_a_report(tmp_path):
    p = measure_engine_peaks("cpu", dtypes=["fp32"], **TINY)
    report = _report()
    # The model's engines on the roofline: FLOP (elements) per byte at the achieved rate.
    assert roofline_points(report) == [
        ("matrix", pytest.approx(100.0), pytest.approx(1e9 / 200e-6 / 1e9)),
        ("vector", pytest.approx(0.125), pytest.approx(1e6 / 100e-6 / 1e9)),
    ]
    out = plot_roofline(p, tmp_path / "roof.png", report=report, datasheet={"matrix_tflops": 1.0})
    assert out.stat().st_size > 0


def test_engine_bench_command_writes_profile_roofline_and_cache(tmp_path, tiny_defaults, capsys):
    from lightning_sdp.cli import main

    report = tmp_path / "engine_profile-rank0.json"
    report.write_text(json.dumps([_report().to_dict()]))
    out = tmp_path / "bench"
    code = main(
        [
            "engine-bench",
            "--quick",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--dtypes",
            "fp32",
            "--out",
            str(out),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--report",
            str(report),
        ]
    )
    assert code == 0
    profile = DeviceProfile.load(out / "device_profile.json")
    assert profile.num_threads == 1 and profile.matrix["fp32"]["tflops"] > 0
    assert (out / "roofline.png").stat().st_size > 0
    assert len(list((tmp_path / "cache").glob("cpu-*.json"))) == 1
    assert "matrix dtype" in capsys.readouterr().out
    main(["tools"])
    assert "engine-bench" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not an EngineProfiler report"):
        main(["engine-bench", "--quick", "--no-cache", "--out", str(out), "--report", str(bad)])
