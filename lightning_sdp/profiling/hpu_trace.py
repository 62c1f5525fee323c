"""Engine lanes of a Gaudi (HPU) Chrome trace and the overlap of the engines.

With the Habana bridge, ``torch.profiler`` exports device activity into the Chrome trace: one process/thread
lane per engine (MME, TPC, DMA, NIC, ...), named by ``"ph": "M"`` metadata events (``process_name`` /
``thread_name``), with the engine's work as complete (``"ph": "X"``) or begin/end (``"B"``/``"E"``) events.
Engines run concurrently, so the shares are computed by a sweep over all interval end points: at every instant the
device is in exactly one state

- ``both``: MME and TPC busy,
- ``mme_only`` / ``tpc_only``: only that compute engine busy,
- ``dma_only``: no compute engine busy, a DMA engine busy,
- ``other_only``: only other engines (NIC, ...) busy,
- ``idle``: nothing busy,

and the states' durations sum to the window (first start to last end of device activity, unless a window is given).

This module reads plain JSON / gzip JSON and needs no Habana software, so it is tested on hand-made traces.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINES: tuple[str, ...] = ("mme", "tpc", "dma", "nic", "other")
STATES: tuple[str, ...] = ("both", "mme_only", "tpc_only", "dma_only", "other_only", "idle")

_ENGINE_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # DMA first: engine names such as "TPC_DMA" or "MME DMA" are copy engines.
    (re.compile(r"dma", re.IGNORECASE), "dma"),
    (re.compile(r"mme", re.IGNORECASE), "mme"),
    (re.compile(r"tpc", re.IGNORECASE), "tpc"),
    (re.compile(r"nic|scale.?out", re.IGNORECASE), "nic"),
    (re.compile(r"rotator|\bcme\b|decoder|\bvde\b|sync.?manager", re.IGNORECASE), "other"),
)
_TPC_MATRIX_RE = re.compile(r"(gemm|matmul|\bmm\b|batch_gemm|conv)", re.IGNORECASE)


def engine_of_lane(name: str) -> str | None:
    """Engine class of a lane name (``"MME0"`` -> ``"mme"``, ``"TPC 12"`` -> ``"tpc"``); ``None`` for host lanes."""
    if not name:
        return None
    for pattern, engine in _ENGINE_PATTERNS:
        if pattern.search(name):
            return engine
    return None


@dataclass
class EngineOverlap:
    """Result of the overlap sweep.

    Attributes:
        window_us: length of the analysed window.
        states_us: time per state (:data:`STATES`), summing to ``window_us``.
        busy_us: union busy time per engine class.
        lanes: engine class per lane name found in the trace.
        matrix_on_tpc_us: TPC time of kernels whose names say matrix work (GEMM on the vector engine).
        kernel_us: busy time per (engine, kernel name), summed over lanes (not a union).
    """

    window_us: float
    states_us: dict[str, float]
    busy_us: dict[str, float]
    lanes: dict[str, str] = field(default_factory=dict)
    matrix_on_tpc_us: float = 0.0
    kernel_us: dict[str, dict[str, float]] = field(default_factory=dict)

    def state_fractions(self) -> dict[str, float]:
        if self.window_us <= 0:
            return {s: 0.0 for s in STATES}
        return {s: self.states_us[s] / self.window_us for s in STATES}

    def busy_fractions(self) -> dict[str, float]:
        if self.window_us <= 0:
            return {e: 0.0 for e in ENGINES}
        return {e: self.busy_us.get(e, 0.0) / self.window_us for e in ENGINES}

    def categories_us(self) -> dict[str, float]:
        """Engine states mapped onto the profiler categories (sums to ``window_us``).

        MME busy (alone or with TPC) -> ``matrix``; TPC alone -> ``vector``; DMA alone -> ``memory``; other engines
        alone (NIC) -> ``communication``; idle -> ``host_other``.
        """
        s = self.states_us
        return {
            "matrix": s["both"] + s["mme_only"],
            "attention_fused": 0.0,
            "vector": s["tpc_only"],
            "memory": s["dma_only"],
            "communication": s["other_only"],
            "host_other": s["idle"],
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "window_us": self.window_us,
            "states_us": dict(self.states_us),
            "state_fractions": self.state_fractions(),
            "busy_us": dict(self.busy_us),
            "busy_fractions": self.busy_fractions(),
            "lanes": dict(self.lanes),
            "matrix_on_tpc_us": self.matrix_on_tpc_us,
        }


def load_trace(path: str | Path) -> dict[str, Any]:
    """Read a Chrome trace (``.json`` or ``.json.gz``); a bare list of events is accepted too."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"HPU trace {p} does not exist")
    opener = gzip.open if p.suffix == ".gz" else open
    try:
        with opener(p, "rt") as f:
            data = json.load(f)
    except (json.JSONDecodeError, OSError, EOFError) as err:
        raise ValueError(f"{p} is not a readable Chrome trace JSON file: {err}") from err
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{p} has no 'traceEvents' list; is it a Chrome/Perfetto trace?")
    return data


def engine_intervals(
    trace: dict[str, Any],
) -> tuple[dict[str, list[tuple[float, float, str]]], dict[str, str]]:
    """Busy intervals per lane of every engine lane in ``trace``.

    Returns:
        ``({lane_key: [(start_us, end_us, kernel_name), ...]}, {lane_key: engine})`` where ``lane_key`` is the
        lane's display name (``"<process>/<thread>"``).
    """
    events = trace["traceEvents"]
    lane_of = _lane_resolver(events)
    intervals: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    lanes: dict[str, str] = {}
    open_b: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for ev in events:
        ph = ev.get("ph")
        if ph not in ("X", "B", "E"):
            continue
        key, engine = lane_of(ev)
        if engine is None:
            continue
        lanes[key] = engine
        interval = _interval_of(ev, ph, open_b[key], key)
        if interval is not None:
            intervals[key].append(interval)
    return dict(intervals), lanes


def _lane_resolver(events: list[dict[str, Any]]) -> Callable[[dict[str, Any]], tuple[str, str | None]]:
    """``event -> (lane key, engine or None)`` from the trace's ``process_name``/``thread_name`` metadata."""
    proc_names: dict[Any, str] = {}
    thread_names: dict[tuple[Any, Any], str] = {}
    for ev in events:
        if ev.get("ph") != "M":
            continue
        name = (ev.get("args") or {}).get("name", "")
        if ev.get("name") == "process_name":
            proc_names[ev.get("pid")] = str(name)
        elif ev.get("name") == "thread_name":
            thread_names[(ev.get("pid"), ev.get("tid"))] = str(name)

    def lane_of(ev: dict[str, Any]) -> tuple[str, str | None]:
        pid, tid = ev.get("pid"), ev.get("tid")
        pname = proc_names.get(pid, str(pid))
        tname = thread_names.get((pid, tid), str(tid))
        return f"{pname}/{tname}", engine_of_lane(tname) or engine_of_lane(pname)

    return lane_of


def _interval_of(
    ev: dict[str, Any], ph: str, open_b: list[tuple[float, str]], key: str
) -> tuple[float, float, str] | None:
    """The busy interval an ``X`` or ``E`` event closes on its lane (``None`` for ``B``, which opens one).

    Raises:
        ValueError: an event without a numeric ``ts``, a negative duration, or an ``E`` without its ``B``.
    """
    try:
        ts = float(ev["ts"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"trace event without a numeric 'ts': {ev}") from err
    name = str(ev.get("name", ""))
    if ph == "B":
        open_b.append((ts, name))
        return None
    if ph == "X":
        dur = float(ev.get("dur", 0.0))
        if dur < 0:
            raise ValueError(f"trace event with negative duration: {ev}")
        return (ts, ts + dur, name) if dur > 0 else None
    if not open_b:
        raise ValueError(f"'E' event without a matching 'B' on lane {key} at ts={ts}")
    start, name = open_b.pop()
    return (start, ts, name) if ts > start else None


def overlap_sweep(
    intervals_by_engine: Mapping[str, Iterable[tuple[float, float]]], window: tuple[float, float] | None = None
) -> tuple[dict[str, float], dict[str, float], float]:
    """Sweep over interval end points: time per overlap state and union busy time per engine.

    Args:
        intervals_by_engine: ``{engine: [(start, end), ...]}`` with engines from :data:`ENGINES`; intervals of
            one engine may overlap (several lanes of the same engine).
        window: ``(start, end)`` to analyse; default from the first start to the last end.

    Returns:
        ``(states, busy, window_length)``.
    """
    points: list[tuple[float, int, str]] = []
    lo, hi = float("inf"), float("-inf")
    for engine, ivs in intervals_by_engine.items():
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; use one of {ENGINES}")
        for s, e in ivs:
            if e < s:
                raise ValueError(f"interval ends before it starts: ({s}, {e})")
            points.append((float(s), 1, engine))
            points.append((float(e), -1, engine))
            lo, hi = min(lo, s), max(hi, e)
    if window is not None:
        lo, hi = float(window[0]), float(window[1])
        if hi < lo:
            raise ValueError(f"window ends before it starts: {window}")
    states = {s: 0.0 for s in STATES}
    busy = {e: 0.0 for e in ENGINES}
    if not points or hi <= lo:
        length = max(0.0, hi - lo) if window is not None else 0.0
        states["idle"] = length
        return states, busy, length
    # Ends before starts at the same time stamp: back-to-back kernels do not count as overlap.
    points.sort(key=lambda p: (p[0], p[1]))
    active = {e: 0 for e in ENGINES}
    prev = lo
    for t, delta, engine in points:
        t_clip = min(max(t, lo), hi)
        if t_clip > prev:
            _accumulate(states, busy, active, t_clip - prev)
            prev = t_clip
        active[engine] += delta
    if hi > prev:
        _accumulate(states, busy, active, hi - prev)
    return states, busy, hi - lo


def _accumulate(states: dict[str, float], busy: dict[str, float], active: dict[str, int], dt: float) -> None:
    mme, tpc, dma = active["mme"] > 0, active["tpc"] > 0, active["dma"] > 0
    other = active["nic"] > 0 or active["other"] > 0
    if mme and tpc:
        states["both"] += dt
    elif mme:
        states["mme_only"] += dt
    elif tpc:
        states["tpc_only"] += dt
    elif dma:
        states["dma_only"] += dt
    elif other:
        states["other_only"] += dt
    else:
        states["idle"] += dt
    for e, n in active.items():
        if n > 0:
            busy[e] += dt


def analyze_trace(trace: dict[str, Any] | str | Path, window: tuple[float, float] | None = None) -> EngineOverlap:
    """Engine overlap of a Gaudi Chrome trace (a loaded dict or a path to ``.json``/``.json.gz``).

    Raises:
        ValueError: the trace has no engine lanes (not an HPU trace, or exported without device activity).
    """
    if not isinstance(trace, dict):
        trace = load_trace(trace)
    intervals, lanes = engine_intervals(trace)
    if not lanes:
        raise ValueError(
            "the trace has no device engine lanes (MME/TPC/DMA/NIC): it was not recorded on a Gaudi, or the "
            "profiler ran without HPU activities"
        )
    by_engine: dict[str, list[tuple[float, float]]] = defaultdict(list)
    kernel_us: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    matrix_on_tpc = 0.0
    for key, ivs in intervals.items():
        engine = lanes[key]
        for s, e, name in ivs:
            by_engine[engine].append((s, e))
            kernel_us[engine][name] += e - s
            if engine == "tpc" and _TPC_MATRIX_RE.search(name):
                matrix_on_tpc += e - s
    states, busy, length = overlap_sweep(by_engine, window)
    return EngineOverlap(
        window_us=length,
        states_us=states,
        busy_us=busy,
        lanes=lanes,
        matrix_on_tpc_us=matrix_on_tpc,
        kernel_us={k: dict(v) for k, v in kernel_us.items()},
    )


def overlap_reference(
    intervals_by_engine: dict[str, Iterable[tuple[float, float]]],
    window: tuple[float, float],
    resolution: float,
) -> dict[str, float]:
    """Plain reference for :func:`overlap_sweep`: classify the midpoint of each ``resolution``-long time slice.

    Exact when all end points lie on the ``resolution`` grid; used by the tests to check the sweep.
    """
    lo, hi = window
    n = int(round((hi - lo) / resolution))
    ivs = {e: list(v) for e, v in intervals_by_engine.items()}
    states = {s: 0.0 for s in STATES}
    for i in range(n):
        t = lo + (i + 0.5) * resolution
        active = {e: sum(1 for s, en in ivs.get(e, []) if s <= t < en) for e in ENGINES}
        _accumulate(states, {e: 0.0 for e in ENGINES}, active, resolution)
    return states
