"""Shared helpers for benchmarks: machine facts, writing ``results/<name>.{json,md,png}`` and a free TCP port
(the step timer is :mod:`benchmarks.tools.step_timer`; this module imports no deep-learning library, so a
benchmark that only writes results starts at once).

Every benchmark measures the plugin and its baseline side by side in one run and calls :func:`write_results`.
Benchmarks run as ``python -m benchmarks.<name>`` from the repository root (no ``sys.path`` edits).
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

# Smoke tests point this at a temporary folder (tests/benchmarks/conftest.py) so they never touch the committed results.
RESULTS_DIR = Path(os.environ.get("LIGHTNING_SDP_RESULTS_DIR") or Path(__file__).resolve().parent / "results")
REPO_ROOT = Path(__file__).resolve().parents[1]
# The runner passes its own to every run, so a checkout of another commit (``--against``) reads the same data.
SHARED_DATA = Path(os.environ.get("LIGHTNING_SDP_SHARED_DATA") or REPO_ROOT.parent / "shared" / "data")


def free_port() -> int:
    """A TCP port that is free on this host now (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """CPU model, usable cores, memory, load, library versions and GPU (if any) of the running machine."""
    import torch

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages / 2**30, 1)
    except (ValueError, OSError):
        pass
    try:  # the installed version, without importing Lightning (3 s on a small machine) into every child
        info["lightning"] = importlib.metadata.version("lightning")
    except importlib.metadata.PackageNotFoundError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def machine_before_run(sample_seconds: float = 1.0) -> dict[str, Any]:
    """:func:`machine_info` plus how busy the machine is before a run: load averages and the share of the CPU that
    other work used over ``sample_seconds`` (from ``/proc/stat``), so a loaded machine is known before it skews a
    timing."""
    info = machine_info()
    try:
        info["load_avg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
        first = _cpu_ticks()
        time.sleep(sample_seconds)
        busy, total = (b - a for a, b in zip(first, _cpu_ticks(), strict=True))
        info["cpu_busy_before"] = round(busy / total, 3) if total else None
    except (OSError, ValueError):
        pass
    return info


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def machine_line(info: dict[str, Any] | None = None) -> str:
    info = info or machine_info()
    gpu = f", GPU {info['gpu']}" if "gpu" in info else ""
    load = f", load {info['load_avg_1m']}" if "load_avg_1m" in info else ""
    busy = (
        f" (CPU {info['cpu_busy_before']:.0%} busy before the run)" if info.get("cpu_busy_before") is not None else ""
    )
    return f"{info['cpu']}, {info['cores']} cores{gpu}, torch {info['torch']}{load}{busy}, {info['date']}"


def write_results(name: str, payload: dict[str, Any], markdown: str, figure: Any = None) -> dict[str, Path]:
    """Write ``results/<name>.json`` (payload + machine), ``.md`` (markdown + machine line) and ``.png``.

    Args:
        name: file stem, e.g. ``"gpt_char_cpu"``.
        payload: JSON-serialisable results; a ``machine`` entry is added.
        markdown: the table(s) to show; a header and the machine line are added.
        figure: a matplotlib ``Figure`` saved as the PNG (closed afterwards), or ``None``.
    """
    # Under the runner (python -m benchmarks) the configuration names the files, and the machine is the one recorded
    # before the run started.
    name = os.environ.get("LIGHTNING_SDP_RESULT_STEM") or name
    run = json.loads(os.environ.get("LIGHTNING_SDP_BENCH_RUN") or "null")
    if run:
        payload["machine"] = run.pop("machine")
        payload["run"] = run
    payload.setdefault("machine", machine_info())
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    paths = {"json": RESULTS_DIR / f"{name}.json"}
    paths["json"].write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    paths.update(_write_pages(name, payload, markdown, figure))
    for p in paths.values():
        print(f"wrote {p}")
    return paths


def render_results(name: str, render: Any) -> dict[str, Path]:
    """Rewrite ``results/<name>.md`` and ``.png`` from ``results/<name>.json`` with a benchmark's ``render``.

    ``render(payload)`` returns ``(markdown, figure or None)``: what the benchmark wrote when it ran, rebuilt from
    the stored numbers alone (a changed table layout or plot needs no rerun).
    """
    payload = json.loads((RESULTS_DIR / f"{name}.json").read_text())
    return _write_pages(name, payload, *render(payload))


def _write_pages(name: str, payload: dict[str, Any], markdown: str, figure: Any) -> dict[str, Path]:
    """``.md``: a title, the machine line, the command (under the runner) and ``markdown``; ``.png``: ``figure``."""
    run = payload.get("run")
    command = f"Command: `{run['command']}`\n\n" if run else ""
    paths = {"md": RESULTS_DIR / f"{name}.md"}
    paths["md"].write_text(f"# {name}\n\nMachine: {machine_line(payload['machine'])}\n\n{command}{markdown.strip()}\n")
    if figure is not None:
        import matplotlib.pyplot as plt

        paths["png"] = RESULTS_DIR / f"{name}.png"
        figure.savefig(paths["png"], dpi=120, bbox_inches="tight")
        plt.close(figure)
    return paths


def markdown_table(rows: list[dict[str, Any]], columns: list[str] | None = None, floatfmt: str = "{:.4g}") -> str:
    """A GitHub markdown table from a list of dicts."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])

    def fmt(v: Any) -> str:
        return floatfmt.format(v) if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _jsonable(obj: Any) -> Any:
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:
        pass
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)
