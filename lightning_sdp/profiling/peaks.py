"""Per-device peak table and the analytic attention model of the Gaudi study.

Peaks are dense (no sparsity) datasheet numbers in TFLOPS (matrix engine per dtype, vector engines) and memory
bandwidth in GB/s. ``None`` means "not known to us": utilisation is then not reported for that entry; pass
``peaks=`` to :class:`~lightning_sdp.callbacks.EngineProfiler` to fill or override any value. For a CUDA card that
:data:`PEAKS` lacks, the matrix peak comes from Lightning's table
(``lightning.fabric.utilities.throughput.get_available_flops``, the numbers ``ThroughputMonitor`` uses).

Analytic model (per Transformer layer, sequence length ``n``, width ``d``, ``h`` heads, unfused attention):
linear layers cost ``24·d²`` FLOPs per token on the matrix engine, the two attention matmuls ``4·n·d`` per token,
and the softmax side (scale, mask, max, exp, sum, divide, dropout) about ``k·h·n`` element operations per token on
the vector engines (``k`` ≈ 5-8). The score-matrix vector work overtakes all linear-layer matmul time past

    n* = 24·d²·P_vec / (k·h·P_mat).
"""

from __future__ import annotations

import time

import torch

# Datasheet numbers (dense). Keys of each entry:
#   matrix_<dtype>: matrix-engine TFLOPS for that dtype; vector: vector-engine TFLOPS (fp32 on GPUs, bf16 on Gaudi
#   where the datasheet states it); mem_gbps: memory bandwidth.
PEAKS: dict[str, dict[str, float | None]] = {
    "a100": {
        "matrix_bf16": 312.0,
        "matrix_fp16": 312.0,
        "matrix_tf32": 156.0,
        "matrix_fp32": 19.5,
        "matrix_fp8": None,
        "vector": 19.5,
        "mem_gbps": 2039.0,
    },
    "h100": {
        "matrix_bf16": 989.0,
        "matrix_fp16": 989.0,
        "matrix_tf32": 494.0,
        "matrix_fp32": 67.0,
        "matrix_fp8": 1979.0,
        "vector": 67.0,
        "mem_gbps": 3350.0,
    },
    "h200": {
        "matrix_bf16": 989.0,
        "matrix_fp16": 989.0,
        "matrix_tf32": 494.0,
        "matrix_fp32": 67.0,
        "matrix_fp8": 1979.0,
        "vector": 67.0,
        "mem_gbps": 4800.0,
    },
    "gaudi1": {
        "matrix_bf16": None,
        "matrix_fp32": None,
        "vector": None,
        "mem_gbps": 1000.0,
    },
    "gaudi2": {
        "matrix_bf16": 432.0,
        "matrix_fp8": 865.0,
        "matrix_fp32": None,
        "vector": None,
        "mem_gbps": 2450.0,
    },
    "gaudi3": {
        "matrix_bf16": 1835.0,
        "matrix_fp8": 1835.0,
        "matrix_fp32": None,
        "vector": 28.7,
        "mem_gbps": 3700.0,
    },
}

_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    ("h200", "h200"),
    ("h100", "h100"),
    ("a100", "a100"),
    ("gaudi3", "gaudi3"),
    ("hl-325", "gaudi3"),
    ("gaudi2", "gaudi2"),
    ("hl-225", "gaudi2"),
    ("gaudi", "gaudi1"),
    ("hl-205", "gaudi1"),
)


def device_key(device_name: str | None) -> str | None:
    """Key of :data:`PEAKS` for a device name such as ``"NVIDIA H100 80GB HBM3"`` or ``"GAUDI2"``; else ``None``."""
    if not device_name:
        return None
    low = device_name.lower().replace(" ", "")
    for pattern, key in _NAME_PATTERNS:
        if pattern in low:
            return key
    return None


def device_name_of(device_type: str, index: int = 0) -> str | None:
    """Marketing name of the current accelerator, or ``None`` (CPU, or the name cannot be read)."""
    try:
        if device_type == "cuda":
            return torch.cuda.get_device_name(index)
        if device_type == "hpu":
            hpu = getattr(torch, "hpu", None)
            if hpu is not None and hasattr(hpu, "get_device_name"):
                return str(hpu.get_device_name())
            return "gaudi"
    except Exception:  # a name is a nicety; the caller handles None
        return None
    return None


def matrix_dtype_key(precision: str, allow_tf32: bool = False) -> str:
    """Peak-table dtype for a Lightning precision string (``"bf16-mixed"`` -> ``"bf16"``)."""
    p = str(precision)
    if "bf16" in p:
        return "bf16"
    if p.startswith("16") or "fp16" in p:
        return "fp16"
    if "transformer-engine" in p or "fp8" in p:
        return "fp8"
    return "tf32" if allow_tf32 else "fp32"


def resolve_peaks(
    device_name: str | None, dtype: str, overrides: dict[str, float] | None = None
) -> dict[str, float | None]:
    """Peaks for one device and matrix dtype: ``{"matrix_tflops", "vector_tflops", "mem_gbps"}``.

    Args:
        device_name: device name (see :func:`device_key`); ``None`` or unknown gives ``None`` peaks.
        dtype: matrix dtype key (``bf16``, ``fp16``, ``tf32``, ``fp32``, ``fp8``).
        overrides: user values for ``matrix_tflops``, ``vector_tflops``, ``mem_gbps`` (win over the table).
    """
    entry = PEAKS.get(device_key(device_name) or "", {})
    out: dict[str, float | None] = {
        "matrix_tflops": entry.get(f"matrix_{dtype}"),
        "vector_tflops": entry.get("vector"),
        "mem_gbps": entry.get("mem_gbps"),
    }
    for k, v in (overrides or {}).items():
        if k not in out:
            raise ValueError(f"unknown peak {k!r}; use one of {sorted(out)}")
        if v is not None and (not isinstance(v, (int, float)) or v <= 0):
            raise ValueError(f"peak {k!r} must be a positive number, got {v!r}")
        out[k] = None if v is None else float(v)
    return out


def effective_peaks(
    device_name: str | None,
    dtype: str,
    overrides: dict[str, float] | None = None,
    measured: dict[str, float | None] | None = None,
    device: torch.device | None = None,
) -> tuple[dict[str, float | None], dict[str, str | None]]:
    """Peaks used for utilisation, and where each comes from (``user``, ``datasheet``, ``measured`` or ``None``).

    User overrides win, then the datasheet table (:data:`PEAKS`, then for a CUDA ``device`` Lightning's matrix
    peaks, :func:`lightning_matrix_tflops`), then the ceilings measured on this device
    (:func:`~lightning_sdp.profiling.engine_bench.measure_engine_peaks`) for the values the tables lack (the CPU).

    Args:
        device_name: device name (see :func:`device_key`).
        dtype: matrix dtype key.
        overrides: user values (see :func:`resolve_peaks`).
        measured: measured ceilings ``{"matrix_tflops", "vector_tflops", "mem_gbps"}`` or ``None``.
        device: the profiled device; a CUDA device whose name :data:`PEAKS` lacks is looked up in Lightning's table.
    """
    table = resolve_peaks(device_name, dtype)
    if table["matrix_tflops"] is None and device is not None and device.type == "cuda":
        table["matrix_tflops"] = lightning_matrix_tflops(device, dtype)
    user = resolve_peaks(None, dtype, overrides)  # validates the overrides
    out = {k: user[k] if overrides and k in overrides else v for k, v in table.items()}
    sources: dict[str, str | None] = {}
    for k in list(out):
        if overrides and overrides.get(k) is not None:
            sources[k] = "user"
        elif table[k] is not None:
            sources[k] = "datasheet"
        elif measured and measured.get(k):
            out[k] = float(measured[k])  # type: ignore[arg-type]
            sources[k] = "measured"
        else:
            sources[k] = None
    return out, sources


def lightning_matrix_tflops(device: torch.device, dtype: str) -> float | None:
    """Matrix peak (TFLOPS) of a CUDA device from Lightning's table, or ``None`` (unknown card or dtype).

    Lightning picks its fp32 or TF32 figure from ``torch.get_float32_matmul_precision()``; a figure of the other
    kind than ``dtype`` asks for is not used.

    Args:
        device: a CUDA device.
        dtype: matrix dtype key (``bf16``, ``fp16``, ``tf32``, ``fp32``; ``fp8`` is not in Lightning's table).
    """
    from lightning.fabric.utilities.throughput import get_available_flops

    # Lightning's table keys TF32 by the string "tfloat32" (torch has no such dtype), the others by torch dtypes.
    lightning_dtypes: dict[str, torch.dtype | str] = {
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "tf32": "tfloat32",
        "fp32": torch.float32,
    }
    torch_dtype = lightning_dtypes.get(dtype)
    if torch_dtype is None:
        return None
    if dtype == "fp32" and torch.get_float32_matmul_precision() != "highest":
        return None  # Lightning would answer with its TF32 figure
    flops = get_available_flops(device, torch_dtype)
    return None if flops is None else flops / 1e12


def crossover_seq_len(d_model: int, n_heads: int, p_matrix: float, p_vector: float, k: float = 6.0) -> float:
    """Sequence length past which softmax-side vector time exceeds all linear-layer matmul time.

    ``n* = 24·d²·P_vec / (k·h·P_mat)`` (any consistent units for the two peaks).

    Args:
        d_model: model width ``d``.
        n_heads: number of heads ``h``.
        p_matrix: matrix-engine throughput.
        p_vector: vector-engine throughput.
        k: element operations per score entry on the softmax side (about 5-8 unfused).
    """
    if min(d_model, n_heads) <= 0 or p_matrix <= 0 or p_vector <= 0 or k <= 0:
        raise ValueError("crossover_seq_len needs positive d_model, n_heads, peaks and k")
    return 24.0 * d_model**2 * p_vector / (k * n_heads * p_matrix)


def attention_model(
    seq_len: int,
    d_model: int,
    n_heads: int,
    p_matrix: float,
    p_vector: float,
    k: float = 6.0,
    fused: bool = False,
) -> dict[str, float]:
    """Predicted per-token time shares of one layer under the analytic model.

    Returns ``matrix_share`` (linear layers + attention matmuls), ``vector_share`` (softmax side) and
    ``attention_share`` (attention matmuls + softmax side). With ``fused=True`` the softmax side runs inside the
    fused kernel at matrix-engine speed (flash attention keeps scores on chip), so it counts as attention work at
    ``p_matrix``.
    """
    n, d, h = float(seq_len), float(d_model), float(n_heads)
    t_linear = 24.0 * d * d / p_matrix
    t_att_mm = 4.0 * n * d / p_matrix
    t_soft = k * h * n / (p_matrix if fused else p_vector)
    total = t_linear + t_att_mm + t_soft
    return {
        "matrix_share": (t_linear + t_att_mm + (t_soft if fused else 0.0)) / total,
        "vector_share": 0.0 if fused else t_soft / total,
        "attention_share": (t_att_mm + t_soft) / total,
    }


def calibrate_cpu(size: int = 384, elements: int = 1 << 21, repeats: int = 5) -> dict[str, float]:
    """Measure this host's matrix and vector throughput (the CPU has no datasheet peak in the table).

    Matrix: best of ``repeats`` fp32 ``size×size`` matmuls. Vector: best of ``repeats`` ``exp`` + ``mul`` passes
    over ``elements`` floats (2 element operations each). Returns ``{"matrix_tflops", "vector_tflops"}``.
    """
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    x = torch.randn(elements)
    best_mm = best_vec = float("inf")
    torch.mm(a, b)
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best_mm = min(best_mm, time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.exp(x).mul_(0.5)
        best_vec = min(best_vec, time.perf_counter() - t0)
    return {
        "matrix_tflops": 2.0 * size**3 / best_mm / 1e12,
        "vector_tflops": 2.0 * elements / best_vec / 1e12,
    }
