"""EngineProfiler's results as types: one window's (or one rank's combined) report, and the merge over ranks.

:class:`EngineReport` is what :func:`~lightning_sdp.profiling.report.build_report` returns and
:func:`~lightning_sdp.profiling.report.combine_windows` combines; :class:`MergedReport` is the summary over ranks.
Maps over a fixed set of names stay maps (shares per category in ``fractions``, throughput per engine, peaks per
kind). ``to_dict()`` gives the JSON the callback writes (the keys of the dict reports of earlier releases, so their
result files stay readable with ``from_dict()``); the objects pickle as they are for ``all_gather_object``.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from lightning_sdp.profiling.flops import WorkCount
from lightning_sdp.profiling.hpu_trace import EngineOverlap
from lightning_sdp.profiling.memory import StepMemory


@dataclass
class DeviceInfo:
    """The profiled device.

    Attributes:
        type: ``trainer.strategy.root_device.type`` (``cpu``, ``cuda``, ``hpu``...).
        name: marketing name of the accelerator, or the CPU model from the device profile; ``None`` if unknown.
        key: entry of the datasheet table :data:`~lightning_sdp.profiling.peaks.PEAKS`, or ``None``.
        precision: the Trainer's precision string.
        matrix_dtype: peak-table dtype of the matrix work (``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp8``).
        profile: the measured device profile used (``name``, ``num_threads``, ``quick``, ``file``), or ``None``.
    """

    type: str
    name: str | None = None
    key: str | None = None
    precision: str | None = None
    matrix_dtype: str = "fp32"
    profile: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return _drop_none(asdict(self), ("profile",))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceInfo:
        return cls(**_known(cls, data))


@dataclass
class ModelDims:
    """Model dimensions for the analytic attention model (``None`` where unknown)."""

    d_model: int | None = None
    n_heads: int | None = None
    attention: str | None = None
    seq_len: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelDims:
        return cls(**_known(cls, data))


@dataclass
class ModuleShare:
    """Time of one module group per step.

    Attributes:
        time_s: seconds per step.
        frac: share of the step time.
        by_category_s: seconds per step per engine category.
        frac_range: ``[min, max]`` of ``frac`` over the windows of a combined report; ``None`` on one window.
    """

    time_s: float
    frac: float
    by_category_s: dict[str, float] = field(default_factory=dict)
    frac_range: list[float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return _drop_none(asdict(self), ("frac_range",))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModuleShare:
        return cls(**_known(cls, data))


@dataclass
class TopOp:
    """One of the most expensive operators: ``time_ms`` per step and its share of the step."""

    name: str
    category: str
    time_ms: float
    frac: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TopOp:
        return cls(**_known(cls, data))


@dataclass
class Finding:
    """An automated check that fired: its name, what was seen, and one sentence of advice."""

    check: str
    message: str
    advice: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        return cls(**_known(cls, data))


@dataclass
class AnalyticModel:
    """The Gaudi paper's analytic attention model for this model on this device.

    Attributes:
        softmax_k: element operations per attention score.
        crossover_seq_len: sequence length past which softmax-side vector time exceeds linear-layer matmul time.
        vector_to_matrix_attention_ratio: softmax-side over attention-matmul time per score.
        predicted_at_seq_len: predicted shares at the profiled sequence length (softmax attention only), or
            ``None``.
    """

    softmax_k: float
    crossover_seq_len: float
    vector_to_matrix_attention_ratio: float
    predicted_at_seq_len: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return _drop_none(asdict(self), ("predicted_at_seq_len",))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AnalyticModel:
        return cls(**_known(cls, data))


@dataclass
class CudaKernels:
    """CUDA kernel view: matrix-kernel time, the part on tensor cores, and how busy the host was."""

    tensor_core_us: float
    matrix_kernel_us: float
    tensor_core_frac: float | None
    host_busy_frac: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CudaKernels:
        return cls(**_known(cls, data))


@dataclass
class HpuEngines:
    """Gaudi engine overlap of the window (see :class:`~lightning_sdp.profiling.hpu_trace.EngineOverlap`).

    ``state_fractions`` is a field, not derived, so that a combined report can hold the medians over windows.
    """

    window_us: float
    states_us: dict[str, float]
    state_fractions: dict[str, float]
    busy_us: dict[str, float]
    busy_fractions: dict[str, float]
    lanes: dict[str, str]
    matrix_on_tpc_us: float

    @classmethod
    def from_overlap(cls, overlap: EngineOverlap) -> HpuEngines:
        return cls.from_dict(overlap.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HpuEngines:
        return cls(**_known(cls, data))


# Fields that only a combined report (several windows of one rank) has; a window's JSON leaves them out.
_COMBINED_FIELDS = (
    "windows",
    "cycles",
    "start_batches",
    "steps_total",
    "spread",
    "fractions_range",
    "findings_within_spread",
)


@dataclass
class EngineReport:
    """Report of one profiling window, or of one rank's windows combined (medians, with their spread).

    Per-step times are in seconds, shares are of the measured step time. Throughput keys: ``matrix_tflops``,
    ``attention_tflops``, ``total_tflops``, ``vector_gelem_per_s``, ``vector_gbps``, ``memory_gbps``; peak keys:
    ``matrix_tflops``, ``vector_tflops``, ``mem_gbps``; utilisation keys: ``matrix``, ``attention``,
    ``vector_bandwidth``, ``vector_compute`` (``None`` where unknown).

    Attributes:
        rank: global rank.
        world_size: number of ranks.
        cycle: index of the profiling window (the last one in a combined report).
        start_batch: index of the window's first active batch.
        device: the profiled device.
        steps: profiled (active) steps of the window.
        step_time_s: measured seconds per step.
        window_us: length of the analysed span (the Gaudi engine trace's window on HPU).
        batch_shapes: shapes of the batch tensors of each step seen.
        model: model dimensions of the analytic model.
        categories_s: seconds per step per engine category.
        fractions: share of the step per engine category (sums to 1 on a window).
        overlap_scale: factor (<= 1) applied when profiler events overlapped.
        modules: time per module group.
        top_ops: the most expensive operators.
        flops: FLOPs and vector work of one step (counted in the last warm-up step), or ``None``.
        throughput: achieved throughput per engine.
        peaks: peaks used for ``utilisation``.
        peak_sources: where each peak comes from (``user``, ``datasheet``, ``measured``), or ``None``.
        peaks_measured: ceilings measured on this device, or ``None``.
        utilisation: throughput over ``peaks``.
        utilisation_measured: throughput over ``peaks_measured``, or ``None``.
        analytic: the analytic attention model, or ``None`` (no dimensions or peaks).
        cuda: the CUDA kernel view, or ``None`` off CUDA.
        hpu: the Gaudi engine overlap, or ``None`` off HPU.
        findings: checks that fired, with advice.
        trace_file: the window's Chrome trace, or ``None`` when not exported.
        analysis_s: one-off seconds after the window (profiler stop, trace export, parsing, report).
        memory: the peak memory of each profiled step (all windows' steps in a combined report), or ``None`` where
            it cannot be measured.
        windows: combined reports: number of windows (``None`` on a window report).
        cycles: combined reports: the windows' cycles.
        start_batches: combined reports: the windows' first active batches.
        steps_total: combined reports: profiled steps over all windows.
        spread: combined reports: max - min over the windows per category, ``module_attention`` and
            ``imbalance``; ``None`` with one window.
        fractions_range: combined reports: ``[min, max]`` share per category; ``None`` with one window.
        findings_within_spread: combined reports: timing checks whose effect is within the spread.
    """

    rank: int
    world_size: int
    cycle: int
    start_batch: int
    device: DeviceInfo
    steps: int
    step_time_s: float
    window_us: float
    batch_shapes: list[list[list[int]]]
    model: ModelDims
    categories_s: dict[str, float]
    fractions: dict[str, float]
    overlap_scale: float
    modules: dict[str, ModuleShare]
    top_ops: list[TopOp]
    flops: WorkCount | None
    throughput: dict[str, float | None]
    peaks: dict[str, float | None]
    peak_sources: dict[str, str | None] | None
    peaks_measured: dict[str, float | None] | None
    utilisation: dict[str, float | None]
    utilisation_measured: dict[str, float | None] | None
    analytic: AnalyticModel | None
    cuda: CudaKernels | None
    hpu: HpuEngines | None
    findings: list[Finding] = field(default_factory=list)
    trace_file: str | None = None
    analysis_s: float | None = None
    memory: StepMemory | None = None
    windows: int | None = None
    cycles: list[int] | None = None
    start_batches: list[int] | None = None
    steps_total: int | None = None
    spread: dict[str, float] | None = None
    fractions_range: dict[str, list[float]] | None = None
    findings_within_spread: list[Finding] | None = None

    @property
    def combined(self) -> bool:
        """True for a report of :func:`~lightning_sdp.profiling.report.combine_windows`."""
        return self.windows is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with the keys of the dict reports of earlier releases."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in _COMBINED_FIELDS and not self.combined:
                continue
            out[f.name] = _jsonable(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineReport:
        """Rebuild a report from :meth:`to_dict` output (a per-rank JSON entry, or one of a summary's ``per_rank``).

        Raises:
            ValueError: ``data`` is not an EngineProfiler report (keys are missing).
        """
        required = [f.name for f in fields(cls) if f.name not in _COMBINED_FIELDS]
        required = [k for k in required if k not in ("findings", "trace_file", "analysis_s", "memory")]
        missing = [k for k in required if not isinstance(data, dict) or k not in data]
        if missing:
            raise ValueError(
                f"not an EngineProfiler report: missing {missing}; pass an entry of engine_profile-rank<R>.json "
                "or of engine_profile-summary.json's per_rank"
            )
        kw = _known(cls, data)
        kw["device"] = DeviceInfo.from_dict(data["device"])
        kw["model"] = ModelDims.from_dict(data["model"])
        kw["modules"] = {g: ModuleShare.from_dict(v) for g, v in data["modules"].items()}
        kw["top_ops"] = [TopOp.from_dict(t) for t in data["top_ops"]]
        kw["flops"] = None if data["flops"] is None else WorkCount.from_dict(data["flops"])
        kw["analytic"] = None if data["analytic"] is None else AnalyticModel.from_dict(data["analytic"])
        kw["cuda"] = None if data["cuda"] is None else CudaKernels.from_dict(data["cuda"])
        kw["hpu"] = None if data["hpu"] is None else HpuEngines.from_dict(data["hpu"])
        kw["findings"] = [Finding.from_dict(f) for f in data.get("findings") or []]
        kw["memory"] = None if data.get("memory") is None else StepMemory.from_dict(data["memory"])
        if data.get("findings_within_spread") is not None:
            kw["findings_within_spread"] = [Finding.from_dict(f) for f in data["findings_within_spread"]]
        return cls(**kw)

    def __getitem__(self, key: str) -> Any:
        """Dict-style read of the JSON view (``report["fractions"]``), as the dict reports of earlier releases.

        Deprecated: read the attributes (``report.fractions``).
        """
        warnings.warn(
            f"EngineProfiler reports are typed now: use report.{key} (or report.to_dict() for JSON) instead of "
            f"report[{key!r}]",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.to_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        """Deprecated dict-style read (``report.get("modules")``); see :meth:`__getitem__`."""
        try:
            return self[key]
        except KeyError:
            return default


@dataclass
class MergedReport:
    """One rank's combined report per rank, merged (rank 0's ``engine_profile-summary.json``).

    Attributes:
        world_size: number of ranks.
        ranks: the ranks merged.
        mean_fractions: share per category, mean over ranks.
        step_time_s: seconds per step per rank (keys are the ranks as strings, as in the JSON).
        max_step_time_s: the slowest rank's step time.
        slowest_rank: the slowest rank.
        matrix_tflops: achieved matrix TFLOPS per rank.
        findings: the union of the ranks' check names.
        windows: number of windows per rank.
        per_rank: each rank's combined report.
    """

    world_size: int
    ranks: list[int]
    mean_fractions: dict[str, float]
    step_time_s: dict[str, float]
    max_step_time_s: float
    slowest_rank: int
    matrix_tflops: dict[str, float | None]
    findings: list[str]
    windows: dict[str, int]
    per_rank: list[EngineReport]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MergedReport:
        """Rebuild a summary from :meth:`to_dict` output (``engine_profile-summary.json``)."""
        kw = _known(cls, data)
        kw["per_rank"] = [EngineReport.from_dict(r) for r in data["per_rank"]]
        return cls(**kw)


def _jsonable(value: Any) -> Any:
    """JSON form of a field: nested results through their ``to_dict``, containers element by element."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _drop_none(data: dict[str, Any], optional: tuple[str, ...]) -> dict[str, Any]:
    """``data`` without the ``optional`` keys whose value is ``None`` (the dict reports left them out)."""
    return {k: v for k, v in data.items() if not (k in optional and v is None)}


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``data`` that are fields of the dataclass ``cls``."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}
