"""The demo's report: ``<out>/index.md`` with a table of the parts' headlines, their notes and pictures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TITLES = {
    "sdp4bit": "SDP4Bit: 4-bit communication for sharded data parallelism",
    "fastclip": "FastCLIP: CLIP training at a small batch",
    "solar": "SOLAR: schedule-aware HDF5 loading",
    "heat": "HEAT: fused CPU training of SimpleX",
    "profiler": "EngineProfiler: matrix vs vector engine time",
    "gpt": "The character-level GPT",
}
"""Section title of each part in ``index.md``."""

_QUICK_LINE = "Quick smoke run (`--quick`): numbers are from a few steps only."
_FULL_LINE = "Short runs on built-in data; the benchmarks in `benchmarks/results/` are the longer measurements."


def write_index(out: Path, results: dict[str, dict[str, Any]], quick: bool) -> Path:
    """Write ``out/index.md`` from the parts' results (in run order) and return its path.

    Args:
        out: the report folder; each part's picture and ``result.json`` lie in ``out/<part>/``.
        results: ``{part: result}``; a result has a ``headline`` and may have ``note``, ``error``, ``png``,
            ``wall_s`` and (the GPT part) ``sample``.
        quick: whether the parts ran on ``--quick`` settings (said at the top of the report).
    """
    lines = [
        "# lightning-sdp demo report",
        "",
        _QUICK_LINE if quick else _FULL_LINE,
        "",
        "| part | headline | seconds |",
        "|---|---|---|",
    ]
    for name, res in results.items():
        lines.append(f"| {name} | {res['headline']} | {res.get('wall_s', res.get('seconds', ''))} |")
    for name, res in results.items():
        lines += ["", f"## {TITLES.get(name, name)}", "", res["headline"], ""]
        if res.get("note"):
            lines += [res["note"], ""]
        if res.get("error"):
            lines += ["```", res["error"], "```", ""]
        if res.get("png"):
            rel = Path(res["png"]).resolve().relative_to(out.resolve())
            lines += [f"![{name}]({rel.as_posix()})", ""]
        lines.append(f"Details: [`{name}/result.json`]({name}/result.json)")
    if "gpt" in results and results["gpt"].get("sample"):
        lines += ["", "GPT sample:", "", "```", results["gpt"]["sample"], "```"]
    index = out / "index.md"
    index.write_text("\n".join(lines) + "\n")
    return index
