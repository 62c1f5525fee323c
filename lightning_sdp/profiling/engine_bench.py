"""Engine microbenchmarks: what this device's matrix and vector engines actually deliver.

The first step of the Gaudi study (Zhang et al., arXiv 2309.16976), on whatever device the user has: measure the
achievable matrix throughput (GEMMs over a range of shapes, per supported dtype) and vector throughput (elementwise
bandwidth, reductions, softmax, layer norm), so that "matrix x % of the step" comes with "at y % of what this
machine's matrix units can do". :class:`~lightning_sdp.callbacks.EngineProfiler` uses these measured ceilings where
no datasheet peak exists (the CPU) and shows them next to the datasheet where both exist.

Python::

    from lightning_sdp.profiling.engine_bench import measure_engine_peaks
    profile = measure_engine_peaks("cpu", num_threads=2, quick=True)
    profile.peaks("fp32")   # {"matrix_tflops": ..., "vector_tflops": ..., "mem_gbps": ...}

Command line (``lightning-sdp engine-bench``): writes ``device_profile.json`` and ``roofline.png`` to ``--out`` and
stores the profile in the per-device cache (:func:`cached_engine_peaks`), so the callback reuses it.

Ceilings: ``matrix_tflops`` per dtype is the best GEMM over the shapes; ``vector_tflops`` is the best rate of output
elements per second (one element operation each, in units of 10^12/s) of the elementwise kernels (``add``,
``exp``); ``mem_gbps`` is the best bytes read + written per second of the streaming kernels (``copy``, ``add``,
``exp``) over the sizes measured (the largest size is the DRAM figure; smaller sizes may run from cache, which is
what the tensors of a small model do too). Each is the best of a few timed repetitions.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_sdp._files import write_text_atomic
from lightning_sdp.profiling.report import roofline_points, save_figure
from lightning_sdp.profiling.results import EngineReport

PROFILE_VERSION = 1
MATRIX_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
DEFAULT_DTYPES: dict[str, tuple[str, ...]] = {
    "cpu": ("fp32", "bf16"),
    "cuda": ("fp32", "tf32", "bf16", "fp16"),
    "hpu": ("fp32", "bf16"),
}
VECTOR_KERNELS = ("copy", "add", "exp", "sum", "softmax", "layernorm")
_ELEMENTWISE = ("add", "exp")  # the vector ceiling (element operations per second)
_STREAMING = ("copy", "add", "exp")  # the bandwidth ceiling
_ROW = 1024  # row length of softmax and layer norm

# (m, n, k) GEMM shapes and vector sizes (elements) per device type and mode.
_GEMMS: dict[tuple[str, bool], tuple[tuple[int, int, int], ...]] = {
    ("cpu", True): ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 256, 512)),
    ("cpu", False): (
        (256, 256, 256),
        (512, 512, 512),
        (1024, 1024, 1024),
        (2048, 2048, 2048),
        (4096, 768, 768),
        (4096, 3072, 768),
        (4096, 768, 3072),
    ),
    ("gpu", True): ((1024, 1024, 1024), (4096, 4096, 4096), (8192, 1024, 4096)),
    ("gpu", False): (
        (1024, 1024, 1024),
        (2048, 2048, 2048),
        (4096, 4096, 4096),
        (8192, 8192, 8192),
        (16384, 4096, 1024),
        (16384, 1024, 4096),
    ),
}
_VECTOR_SIZES: dict[tuple[str, bool], tuple[int, ...]] = {
    ("cpu", True): (1 << 16, 1 << 22),
    ("cpu", False): (1 << 16, 1 << 20, 1 << 24),
    ("gpu", True): (1 << 20, 1 << 26),
    ("gpu", False): (1 << 20, 1 << 24, 1 << 28),
}
_MIN_TIME_S = {True: 0.02, False: 0.1}  # per timed repetition
_REPEATS = {True: 3, False: 5}


@dataclass
class DeviceProfile:
    """Measured engine throughput of one device (see the module docstring for what each ceiling is).

    Attributes:
        device_type: ``"cpu"``, ``"cuda"`` or ``"hpu"``.
        device_name: marketing name (GPU/HPU) or the CPU model.
        num_threads: torch intra-op threads during the measurement (CPU), else ``None``.
        torch_version: ``torch.__version__``.
        quick: measured in quick mode (small sizes, short repetitions).
        matrix: per dtype, ``{"tflops": best, "shapes": [{"m", "n", "k", "seconds", "tflops"}, ...]}``.
        vector: per kernel, ``[{"numel", "seconds", "gelem_per_s", "gbps"}, ...]`` (fp32).
        skipped: dtypes that could not run on this device, with the reason.
        elapsed_s: wall time of the measurement.
        created: UTC time of the measurement (ISO 8601).
        load_avg: the host's 1-minute load average when the measurement started (``None`` where unknown); a busy
            host measures low ceilings, so a value above the core count says to measure again on a quiet machine.
        cpu_count: logical cores of the host.
    """

    device_type: str
    device_name: str
    num_threads: int | None
    torch_version: str
    quick: bool
    matrix: dict[str, dict[str, Any]] = field(default_factory=dict)
    vector: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0
    created: str = ""
    load_avg: float | None = None
    cpu_count: int | None = None
    version: int = PROFILE_VERSION

    @property
    def vector_gelem_per_s(self) -> float | None:
        """Best elementwise output rate (Gelem/s) over the elementwise kernels and sizes."""
        rates = [row["gelem_per_s"] for k in _ELEMENTWISE for row in self.vector.get(k, [])]
        return max(rates) if rates else None

    @property
    def mem_gbps(self) -> float | None:
        """Best streaming bandwidth (GB/s, bytes read + written) over the streaming kernels and sizes."""
        rates = [row["gbps"] for k in _STREAMING for row in self.vector.get(k, [])]
        return max(rates) if rates else None

    def matrix_tflops(self, dtype: str) -> float | None:
        """Best measured GEMM TFLOPS for a dtype key (``fp32``, ``tf32``, ``bf16``, ``fp16``), or ``None``."""
        entry = self.matrix.get(dtype)
        return None if entry is None else entry.get("tflops")

    def peaks(self, dtype: str) -> dict[str, float | None]:
        """Measured ceilings in the form of :func:`~lightning_sdp.profiling.peaks.resolve_peaks`."""
        vec = self.vector_gelem_per_s
        return {
            "matrix_tflops": self.matrix_tflops(dtype),
            "vector_tflops": None if vec is None else vec / 1e3,
            "mem_gbps": self.mem_gbps,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceProfile:
        """Rebuild a profile from :meth:`to_dict` output; raises ``ValueError`` on another format."""
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            raise ValueError(f"not a device profile of version {PROFILE_VERSION}")
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in names})

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON (atomically: a temporary file in the same folder, then a rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> DeviceProfile:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def table(self) -> str:
        """Human-readable summary (markdown)."""
        threads = f", {self.num_threads} threads" if self.num_threads else ""
        lines = [
            f"Device profile: {self.device_type} ({self.device_name}{threads}), torch {self.torch_version}, "
            f"{'quick' if self.quick else 'full'} mode, {self.elapsed_s:.1f} s"
            + (f", load average {self.load_avg:.1f} on {self.cpu_count} cores" if self.load_avg is not None else ""),
            "",
            "| matrix dtype | best TFLOPS | at shape (m, n, k) |",
            "|---|---|---|",
        ]
        for dtype, entry in self.matrix.items():
            best = max(entry["shapes"], key=lambda r: r["tflops"])
            lines.append(f"| {dtype} | {entry['tflops']:.4g} | {best['m']}x{best['n']}x{best['k']} |")
        for dtype, why in self.skipped.items():
            lines.append(f"| {dtype} | skipped | {why} |")
        lines += ["", "| vector kernel (fp32) | elements | Gelem/s | GB/s |", "|---|---|---|---|"]
        for kernel, rows in self.vector.items():
            for row in rows:
                lines.append(f"| {kernel} | {row['numel']:,} | {row['gelem_per_s']:.4g} | {row['gbps']:.4g} |")
        vec, bw = self.vector_gelem_per_s, self.mem_gbps
        lines += [
            "",
            f"ceilings: vector {vec:.4g} Gelem/s, bandwidth {bw:.4g} GB/s"
            if vec is not None and bw is not None
            else "ceilings: no vector kernels measured",
        ]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- measuring


def device_description(device: torch.device) -> str:
    """Name of a device: the GPU/HPU name, or the CPU model from ``/proc/cpuinfo`` (else ``platform``)."""
    from lightning_sdp.profiling.peaks import device_name_of

    if device.type != "cpu":
        return device_name_of(device.type, device.index or 0) or device.type
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "hpu":
        hpu = getattr(torch, "hpu", None)
        if hpu is not None and hasattr(hpu, "synchronize"):
            return hpu.synchronize
    return lambda: None


def _best_seconds(fn: Callable[[], Any], sync: Callable[[], None], min_time_s: float, repeats: int) -> float:
    """Best time per call: calls are batched so that one repetition lasts at least ``min_time_s``."""
    fn()
    sync()
    calls = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        dt = time.perf_counter() - t0
        if dt >= min_time_s or calls >= 1 << 16:
            break
        calls = max(calls * 2, int(calls * min_time_s / max(dt, 1e-9) * 1.2))
    best = dt / calls
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _measure_gemms(
    device: torch.device,
    dtype_key: str,
    shapes: Sequence[tuple[int, int, int]],
    sync: Callable[[], None],
    min_time_s: float,
    repeats: int,
) -> dict[str, Any]:
    dtype = MATRIX_DTYPES[dtype_key]
    rows = []
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32 if device.type == "cuda" else None
    try:
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = dtype_key == "tf32"
        for m, n, k in shapes:
            a = torch.randn(m, k, device=device).to(dtype)
            b = torch.randn(k, n, device=device).to(dtype)
            out = torch.empty(m, n, device=device, dtype=dtype)
            s = _best_seconds(functools.partial(torch.mm, a, b, out=out), sync, min_time_s, repeats)
            rows.append({"m": m, "n": n, "k": k, "seconds": s, "tflops": 2.0 * m * n * k / s / 1e12})
            del a, b, out
    finally:
        if prev_tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    return {"tflops": max(r["tflops"] for r in rows), "shapes": rows}


def _vector_fn(kernel: str, numel: int, device: torch.device) -> tuple[Callable[[], Any], int]:
    """The kernel as a closure and the bytes it reads + writes per call (fp32)."""
    import torch.nn.functional as F

    a = torch.rand(numel, device=device)
    b = torch.rand(numel, device=device)
    out = torch.empty(numel, device=device)
    esize = 4
    if kernel == "copy":
        return (lambda: out.copy_(a)), 2 * numel * esize
    if kernel == "add":
        return (lambda: torch.add(a, b, out=out)), 3 * numel * esize
    if kernel == "exp":
        return (lambda: torch.exp(a, out=out)), 2 * numel * esize
    if kernel == "sum":
        return (lambda: a.sum()), numel * esize
    rows = max(1, numel // _ROW)
    a2 = a[: rows * _ROW].view(rows, _ROW)
    if kernel == "softmax":
        return (lambda: torch.softmax(a2, dim=-1)), 2 * rows * _ROW * esize
    if kernel == "layernorm":
        return (lambda: F.layer_norm(a2, (_ROW,))), 2 * rows * _ROW * esize
    raise ValueError(f"unknown vector kernel {kernel!r}; use one of {VECTOR_KERNELS}")


def _dtype_error(device: torch.device, dtype_key: str) -> str | None:
    """Why a matrix dtype cannot run here, or ``None`` when a tiny matmul works."""
    if dtype_key not in MATRIX_DTYPES:
        return f"unknown matrix dtype {dtype_key!r} (use {sorted(MATRIX_DTYPES)})"
    if dtype_key == "tf32" and device.type != "cuda":
        return "TF32 exists on CUDA devices only"
    try:
        x = torch.ones(8, 8, device=device, dtype=MATRIX_DTYPES[dtype_key])
        torch.mm(x, x)
    except Exception as err:  # the reason is recorded in the profile
        return f"{type(err).__name__}: {err}"
    return None


def measure_engine_peaks(
    device: str | torch.device | None = None,
    num_threads: int | None = None,
    dtypes: Sequence[str] | None = None,
    quick: bool = False,
    *,
    gemm_shapes: Sequence[tuple[int, int, int]] | None = None,
    vector_sizes: Sequence[int] | None = None,
    vector: bool = True,
    min_time_s: float | None = None,
    repeats: int | None = None,
) -> DeviceProfile:
    """Measure the achievable matrix and vector throughput of a device.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"hpu"``...; default CUDA if available, else HPU, else CPU.
        num_threads: torch intra-op threads for a CPU measurement (restored afterwards); default the current
            ``torch.get_num_threads()`` (inside a Trainer: the Trainer's thread count).
        dtypes: matrix dtypes (``fp32``, ``tf32``, ``bf16``, ``fp16``); default per device type
            (:data:`DEFAULT_DTYPES`). Dtypes the device cannot run are recorded in ``skipped`` with a warning.
        quick: small sizes and short repetitions (about a second or two on a CPU); the full mode takes longer.
        gemm_shapes: ``(m, n, k)`` shapes instead of the mode's defaults (tests use tiny ones).
        vector_sizes: vector sizes in elements instead of the mode's defaults.
        vector: measure the vector kernels too. Default True.
        min_time_s: minimum duration of one timed repetition. Default 0.02 s quick, 0.1 s full.
        repeats: timed repetitions (the best counts). Default 3 quick, 5 full.
    """
    dev = _resolve_device(device)
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise ValueError(f"num_threads must be a positive integer, got {num_threads!r}")
    kind = "cpu" if dev.type == "cpu" else "gpu"
    dtypes = tuple(dtypes) if dtypes is not None else DEFAULT_DTYPES.get(dev.type, ("fp32",))
    shapes = tuple(gemm_shapes) if gemm_shapes is not None else _GEMMS[(kind, quick)]
    sizes = tuple(vector_sizes) if vector_sizes is not None else _VECTOR_SIZES[(kind, quick)]
    min_time_s = _MIN_TIME_S[quick] if min_time_s is None else min_time_s
    repeats = _REPEATS[quick] if repeats is None else max(1, repeats)
    sync = _synchronizer(dev)

    prev_threads = torch.get_num_threads()
    if dev.type == "cpu" and num_threads is not None:
        torch.set_num_threads(num_threads)
    t0 = time.perf_counter()
    try:
        profile = DeviceProfile(
            device_type=dev.type,
            device_name=device_description(dev),
            num_threads=torch.get_num_threads() if dev.type == "cpu" else None,
            torch_version=torch.__version__,
            quick=quick,
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            load_avg=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            cpu_count=os.cpu_count(),
        )
        with torch.no_grad():
            for dtype_key in dtypes:
                why = _dtype_error(dev, dtype_key)
                if why is not None:
                    warnings.warn(f"engine-bench: {dtype_key} matmul skipped on {dev}: {why}", stacklevel=2)
                    profile.skipped[dtype_key] = why
                    continue
                profile.matrix[dtype_key] = _measure_gemms(dev, dtype_key, shapes, sync, min_time_s, repeats)
            if vector:
                for kernel in VECTOR_KERNELS:
                    rows = []
                    for numel in sizes:
                        fn, nbytes = _vector_fn(kernel, numel, dev)
                        s = _best_seconds(fn, sync, min_time_s, repeats)
                        rows.append(
                            {
                                "numel": numel,
                                "seconds": s,
                                "gelem_per_s": numel / s / 1e9,
                                "gbps": nbytes / s / 1e9,
                            }
                        )
                    profile.vector[kernel] = rows
    finally:
        if dev.type == "cpu" and num_threads is not None:
            torch.set_num_threads(prev_threads)
    profile.elapsed_s = time.perf_counter() - t0
    return profile


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        hpu = getattr(torch, "hpu", None)
        if hpu is not None and getattr(hpu, "is_available", lambda: False)():
            return torch.device("hpu")
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here; use device='cpu'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


# ---------------------------------------------------------------------------------------------------- cache


def default_cache_dir() -> Path:
    """``$LIGHTNING_SDP_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightning_sdp/engine_peaks`` (``~/.cache/...``)."""
    env = os.environ.get("LIGHTNING_SDP_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightning_sdp" / "engine_peaks"


def cache_path(
    device_type: str, device_name: str, num_threads: int | None, cache_dir: str | Path | None = None
) -> Path:
    """Cache file of one device: keyed by device type and name, thread count (CPU) and torch version."""
    raw = f"{device_type}-{device_name}-{num_threads or 0}t-torch{torch.__version__}"
    key = re.sub(r"[^A-Za-z0-9._+-]+", "_", raw).strip("_")
    folder = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return folder / f"{key}.json"


def cached_engine_peaks(
    device: str | torch.device | None = None,
    num_threads: int | None = None,
    dtypes: Sequence[str] | None = None,
    quick: bool = True,
    cache_dir: str | Path | None = None,
    refresh: bool = False,
) -> tuple[DeviceProfile, Path, bool]:
    """The device profile from the per-device cache, measuring (and caching) it only when needed.

    A cached profile is used when it holds (or records as skipped) every requested dtype and was measured in full
    mode or ``quick`` is asked; missing dtypes alone are measured and added. Returns ``(profile, cache file,
    from_cache)``.

    Args:
        device: as :func:`measure_engine_peaks`.
        num_threads: CPU threads; default the current ``torch.get_num_threads()``.
        dtypes: matrix dtypes needed; default per device type.
        quick: measure in quick mode on a cache miss. Default True.
        cache_dir: cache folder; default :func:`default_cache_dir`.
        refresh: ignore the cache and measure again.
    """
    dev = _resolve_device(device)
    threads = (num_threads or torch.get_num_threads()) if dev.type == "cpu" else None
    dtypes = tuple(dtypes) if dtypes is not None else DEFAULT_DTYPES.get(dev.type, ("fp32",))
    path = cache_path(dev.type, device_description(dev), threads, cache_dir)
    cached: DeviceProfile | None = None
    if path.is_file() and not refresh:
        try:
            cached = DeviceProfile.load(path)
        except (OSError, ValueError, TypeError) as err:
            warnings.warn(
                f"engine-bench: ignoring the unreadable cache file {path} ({err}); measuring again.",
                stacklevel=2,
            )
    if cached is not None and (quick or not cached.quick):
        missing = [d for d in dtypes if d not in cached.matrix and d not in cached.skipped]
        if not missing:
            return cached, path, True
        extra = measure_engine_peaks(dev, threads, missing, quick=cached.quick, vector=False)
        cached.matrix.update(extra.matrix)
        cached.skipped.update(extra.skipped)
        cached.elapsed_s += extra.elapsed_s
        _save_quietly(cached, path)
        return cached, path, False
    profile = measure_engine_peaks(dev, threads, dtypes, quick=quick)
    _save_quietly(profile, path)
    return profile, path, False


def _save_quietly(profile: DeviceProfile, path: Path) -> None:
    try:
        profile.save(path)
    except OSError as err:
        warnings.warn(
            f"engine-bench: could not write the cache file {path} ({err}); the next run measures again. Set "
            "LIGHTNING_SDP_CACHE_DIR to a writable folder.",
            stacklevel=3,
        )


# ---------------------------------------------------------------------------------------------------- roofline


def plot_roofline(
    profile: DeviceProfile,
    path: str | Path,
    report: EngineReport | None = None,
    datasheet: dict[str, float | None] | None = None,
) -> Path:
    """PNG roofline: measured matrix ceilings (per dtype) and the vector ceiling, both under the measured bandwidth,
    the benchmark's own kernels as small points and, with ``report``, the profiled model's categories.

    Args:
        profile: the device profile.
        path: PNG file to write.
        report: an EngineProfiler report (one window or the combined one) whose categories are drawn.
        datasheet: datasheet peaks (``matrix_tflops``, ``vector_tflops``, ``mem_gbps``) drawn dotted when known.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    pts: list[tuple[str, float, float, str]] = []
    for dtype, entry in profile.matrix.items():
        esize = 4 if MATRIX_DTYPES[dtype] == torch.float32 else 2
        for r in entry["shapes"]:
            ai = 2.0 * r["m"] * r["n"] * r["k"] / ((r["m"] * r["k"] + r["k"] * r["n"] + r["m"] * r["n"]) * esize)
            pts.append((f"GEMM {dtype}", ai, r["tflops"] * 1e3, "o"))
    for kernel, rows in profile.vector.items():
        for row in rows:
            pts.append((f"{kernel}", row["gelem_per_s"] / row["gbps"], row["gelem_per_s"], "^"))
    model_pts = [(f"model {name}", x, y) for name, x, y in roofline_points(report)] if report is not None else []
    xs = [p[1] for p in pts] + [p[1] for p in model_pts] or [0.1, 100.0]
    xmin, xmax = min(xs) / 4, max(xs) * 4
    grid = [xmin * (xmax / xmin) ** (i / 80) for i in range(81)]
    bw = profile.mem_gbps
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (dtype, entry) in enumerate(profile.matrix.items()):
        peak = entry["tflops"] * 1e3
        ax.plot(
            grid,
            [min(peak, x * bw) if bw else peak for x in grid],
            "-",
            color=colors[i % len(colors)],
            lw=1.5,
            label=f"matrix ceiling {dtype} ({peak:.4g} GFLOP/s)",
        )
    vec = profile.vector_gelem_per_s
    if vec:
        ax.plot(
            grid,
            [min(vec, x * bw) if bw else vec for x in grid],
            "--",
            color="k",
            lw=1.5,
            label=f"vector ceiling ({vec:.3g} Gelem/s)",
        )
    if bw:
        ax.plot(grid, [x * bw for x in grid], ":", color="grey", lw=1, label=f"bandwidth {bw:.4g} GB/s")
    if datasheet:
        if matrix_tflops := datasheet.get("matrix_tflops"):
            ax.axhline(matrix_tflops * 1e3, color="tab:red", ls=":", lw=1, label="datasheet matrix")
        if vector_tflops := datasheet.get("vector_tflops"):
            ax.axhline(vector_tflops * 1e3, color="tab:purple", ls=":", lw=1, label="datasheet vector")
    for i, (_, x, y, marker) in enumerate(pts):
        label = "benchmark kernels (o GEMM, ^ vector)" if i == 0 else None
        ax.scatter([x], [y], s=14, marker=marker, alpha=0.6, color="grey", label=label)
    for name, x, y in model_pts:
        ax.scatter([x], [y], s=90, marker="*", label=name, zorder=5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("work per byte moved (FLOP/B; vector: elem/B)")
    ax.set_ylabel("GFLOP/s (vector: Gelem/s)")
    threads = f", {profile.num_threads} threads" if profile.num_threads else ""
    ax.set_title(f"measured roofline: {profile.device_name}{threads}", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    return save_figure(fig, path)


# ---------------------------------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-sdp engine-bench``: measure this device, write ``device_profile.json`` and ``roofline.png``."""
    p = argparse.ArgumentParser(
        prog="lightning-sdp engine-bench",
        description="Measure the achievable matrix (GEMM) and vector (elementwise, reductions, softmax, layer norm) "
        "throughput of this device; write a device profile (JSON) and a roofline (PNG), and store the profile in "
        "the cache EngineProfiler reads.",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, hpu (default: the accelerator if any, else cpu)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's current count)")
    p.add_argument("--dtypes", nargs="+", default=None, help=f"matrix dtypes among {sorted(MATRIX_DTYPES)}")
    p.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    p.add_argument("--out", default="engine_bench", help="output folder (default: engine_bench)")
    p.add_argument("--report", default=None, help="an EngineProfiler JSON report whose categories the roofline shows")
    p.add_argument("--cache-dir", default=None, help="cache folder (default: $LIGHTNING_SDP_CACHE_DIR or ~/.cache/...)")
    p.add_argument("--no-cache", action="store_true", help="measure, and do not write the cache")
    args = p.parse_args(list(argv) if argv is not None else None)

    report = None
    if args.report:
        report = _read_report(Path(args.report))
    if args.no_cache:
        profile = measure_engine_peaks(args.device, args.threads, args.dtypes, quick=args.quick)
        where = "not cached (--no-cache)"
    else:
        profile, path, _ = cached_engine_peaks(
            args.device, args.threads, args.dtypes, quick=args.quick, cache_dir=args.cache_dir, refresh=True
        )
        where = f"cached at {path}"
    out = Path(args.out)
    profile.save(out / "device_profile.json")
    datasheet = None
    if profile.device_type != "cpu":
        from lightning_sdp.profiling.peaks import resolve_peaks

        datasheet = resolve_peaks(profile.device_name, "bf16")
    plot_roofline(profile, out / "roofline.png", report=report, datasheet=datasheet)
    print(profile.table())
    print(f"wrote {out / 'device_profile.json'} and {out / 'roofline.png'}; profile {where}")
    return 0


def _read_report(path: Path) -> EngineReport:
    """One report out of an EngineProfiler file (per-rank list, summary or a single report)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"engine-bench: cannot read the report {path}: {err}") from err
    if isinstance(data, list) and data:
        data = data[-1]
    if isinstance(data, dict) and data.get("per_rank"):
        data = data["per_rank"][0]
    try:
        return EngineReport.from_dict(data)
    except ValueError as err:
        raise SystemExit(
            f"engine-bench: {path} is not an EngineProfiler report ({err}); pass engine_profile-rank0.json or "
            "engine_profile-summary.json."
        ) from err


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
