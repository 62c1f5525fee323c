"""Peak table, overrides and the analytic attention model."""

from __future__ import annotations

import pytest

from lightning_sdp.profiling.peaks import (
    PEAKS,
    attention_model,
    calibrate_cpu,
    crossover_seq_len,
    device_key,
    matrix_dtype_key,
    resolve_peaks,
)


def test_device_names():
    assert device_key("NVIDIA A100-SXM4-80GB") == "a100"
    assert device_key("NVIDIA H100 80GB HBM3") == "h100"
    assert device_key("NVIDIA H200") == "h200"
    assert device_key("GAUDI2") == "gaudi2"
    assert device_key("HL-325L") == "gaudi3"
    assert device_key("GAUDI") == "gaudi1"
    assert device_key("Intel Xeon") is None
    assert device_key(None) is None
    for key in ("a100", "h100", "h200", "gaudi1", "gaudi2", "gaudi3"):
        assert key in PEAKS


def test_dtype_keys():
    assert matrix_dtype_key("bf16-mixed") == "bf16"
    assert matrix_dtype_key("16-mixed") == "fp16"
    assert matrix_dtype_key("32-true") == "fp32"
    assert matrix_dtype_key("32-true", allow_tf32=True) == "tf32"


def test_resolve_and_override():
    p = resolve_peaks("NVIDIA H100 80GB HBM3", "bf16")
    assert p == {"matrix_tflops": 989.0, "vector_tflops": 67.0, "mem_gbps": 3350.0}
    assert resolve_peaks("cpu", "fp32") == {"matrix_tflops": None, "vector_tflops": None, "mem_gbps": None}
    o = resolve_peaks(None, "fp32", {"matrix_tflops": 1.5, "vector_tflops": 0.1})
    assert o["matrix_tflops"] == 1.5 and o["vector_tflops"] == 0.1 and o["mem_gbps"] is None
    with pytest.raises(ValueError, match="unknown peak"):
        resolve_peaks(None, "fp32", {"tflops": 1.0})
    with pytest.raises(ValueError, match="positive"):
        resolve_peaks(None, "fp32", {"mem_gbps": -3})


def test_crossover_matches_the_spec_numbers():
    # d = 768, h = 12, k = 6: about 3.1k tokens on Gaudi 3 and 12k on A100.
    g3 = PEAKS["gaudi3"]
    a100 = PEAKS["a100"]
    assert crossover_seq_len(768, 12, g3["matrix_bf16"], g3["vector"], 6) == pytest.approx(3075, rel=0.01)
    assert crossover_seq_len(768, 12, a100["matrix_bf16"], a100["vector"], 6) == pytest.approx(12288, rel=0.01)
    with pytest.raises(ValueError):
        crossover_seq_len(0, 12, 1.0, 1.0)


def test_attention_model_shares():
    d, h, pm, pv = 768, 12, 312.0, 19.5
    n_star = crossover_seq_len(d, h, pm, pv, 6)
    at = attention_model(round(n_star), d, h, pm, pv, 6)
    # At the crossover the softmax side equals the linear-layer matmul time.
    t_lin = 24 * d * d / pm
    t_soft = 6 * h * round(n_star) / pv
    assert t_soft == pytest.approx(t_lin, rel=1e-3)
    assert at["matrix_share"] + at["vector_share"] == pytest.approx(1.0)
    short, long = attention_model(64, d, h, pm, pv), attention_model(8192, d, h, pm, pv)
    assert long["attention_share"] > short["attention_share"]
    fused = attention_model(8192, d, h, pm, pv, fused=True)
    assert fused["vector_share"] == 0.0 and fused["attention_share"] < long["attention_share"]


def test_cpu_calibration_positive():
    c = calibrate_cpu(size=64, elements=1 << 12, repeats=1)
    assert c["matrix_tflops"] > 0 and c["vector_tflops"] > 0


def test_cuda_card_missing_from_the_table_takes_lightnings_matrix_peak(monkeypatch):
    import torch
    from lightning.fabric.utilities.throughput import get_available_flops

    from lightning_sdp.profiling.peaks import effective_peaks

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L4")
    cuda = torch.device("cuda", 0)
    assert device_key("NVIDIA L4") is None  # not in our table
    peaks, sources = effective_peaks("NVIDIA L4", "bf16", device=cuda)
    assert peaks["matrix_tflops"] == pytest.approx(get_available_flops(cuda, torch.bfloat16) / 1e12)
    assert peaks["matrix_tflops"] > 0 and sources["matrix_tflops"] == "datasheet"
    assert peaks["vector_tflops"] is None and sources["vector_tflops"] is None  # Lightning has matrix peaks only
    # Our table still wins for the cards it has; user overrides win over both.
    h100, _ = effective_peaks("NVIDIA H100 80GB HBM3", "bf16", device=cuda)
    assert h100["matrix_tflops"] == PEAKS["h100"]["matrix_bf16"]
    user, src = effective_peaks("NVIDIA L4", "bf16", {"matrix_tflops": 7.0}, device=cuda)
    assert user["matrix_tflops"] == 7.0 and src["matrix_tflops"] == "user"
    # The same name without a CUDA device (e.g. a report read back on a CPU machine) has no peak.
    assert effective_peaks("NVIDIA L4", "bf16")[0]["matrix_tflops"] is None
