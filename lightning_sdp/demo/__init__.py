"""``lightning-sdp demo``: a short tour of the five plugins and the GPT on built-in data, with a report.

Runs offline on a fresh CPU machine (about 5-10 minutes on 2 cores; ``--quick`` takes about a minute). Every part
uses the plugin's public API, compares it with its baseline in the same run, and writes into ``<out>/<part>/``
(a ``result.json`` and one PNG). The demo then writes ``<out>/index.md`` with a table of the headline numbers and
the pictures, and prints a short summary with the report's path.

Parts (``--only PART``, repeatable): ``sdp4bit`` (2-4 gloo processes: bytes per step with and without 4-bit
communication), ``fastclip`` (FastCLIP-v3 vs the OpenCLIP loss at a small batch), ``solar`` (the storage bytes and
read requests SolarDataModule saves against a plain DataLoader, counted on a generated HDF5 file, beside the
real-device benchmark's result), ``heat`` (fused vs plain-PyTorch SimpleX throughput), ``profiler``
(EngineProfiler's report on the GPT) and ``gpt`` (the character-level GPT).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_sdp.demo import fastclip, gpt, heat, profiler, sdp4bit, solar
from lightning_sdp.demo.common import quiet_lightning
from lightning_sdp.demo.report import write_index

PARTS: dict[str, Callable[[Path, bool], dict[str, Any]]] = {
    "sdp4bit": sdp4bit.run,
    "fastclip": fastclip.run,
    "solar": solar.run,
    "heat": heat.run,
    "profiler": profiler.run,
    "gpt": gpt.run,
}
"""Part name -> ``run(out_dir, quick)`` returning the part's result (a ``headline`` and its numbers), in run order."""


def main(argv: list[str] | None = None) -> int:
    """Run the selected parts (``--only``, default all), write ``<out>/index.md`` and print a summary.

    Returns:
        0 when every part ran, 1 when one failed (its error is in the report; the other parts still run).
    """
    parser = argparse.ArgumentParser(
        prog="lightning-sdp demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=list(PARTS), action="append", help="run only this part (repeatable)")
    parser.add_argument("--out", default="demo_report", help="report folder (default: demo_report)")
    parser.add_argument("--quick", action="store_true", help="a few steps of each part (smoke test, ~1 minute)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_lightning()
    names = list(dict.fromkeys(args.only)) if args.only else list(PARTS)
    results: dict[str, dict[str, Any]] = {}
    failed = []
    total = time.perf_counter()
    for i, name in enumerate(names, 1):
        print(f"\n=== lightning-sdp demo [{i}/{len(names)}]: {name} ===", flush=True)
        part_dir = out / name
        part_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            res = PARTS[name](part_dir, args.quick)
        except Exception as err:  # one broken part must not hide the others' results
            import traceback

            failed.append(name)
            res = {"headline": f"FAILED: {type(err).__name__}: {err}", "error": traceback.format_exc()}
        res["wall_s"] = round(time.perf_counter() - start, 1)
        (part_dir / "result.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        results[name] = res
    index = write_index(out, results, args.quick)
    print(f"\n=== lightning-sdp demo summary ({time.perf_counter() - total:.0f} s) ===")
    for name, res in results.items():
        print(f"{name:>9}: {res['headline']}")
    print(f"report: {index.resolve()}")
    return 1 if failed else 0
