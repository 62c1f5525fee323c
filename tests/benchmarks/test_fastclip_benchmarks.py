"""The FastCLIP benchmarks run as modules (``python -m benchmarks.<name> --quick``) and write their results."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sdp.integrations.open_clip import NANO_CONFIG

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
NAMES = ("fastclip_small_batch", "fastclip_small_batch_10k")


def _run_quick(name: str) -> dict:
    out = RESULTS / f"{name}_quick.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (RESULTS / f"{name}_quick.md").is_file()
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", NAMES)
def test_benchmark_source_needs_no_path_edits_and_no_private_package_names(name):
    source = (REPO / "benchmarks" / f"{name}.py").read_text()
    assert "sys.path" not in source and "noqa: E402" not in source
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_sdp"):
            private = [a.name for a in node.names if a.name.startswith("_")]
            assert not private and "._" not in node.module, f"{name} imports {node.module}: {private}"


@pytest.mark.open_clip
def test_small_batch_quick_trains_both_losses_and_counts_fewer_fastclip_loss_bytes():
    payload = _run_quick("fastclip_small_batch")
    assert payload["bench_model"] == NANO_CONFIG
    assert sorted(r["loss"] for r in payload["runs"]) == ["fastclip_v3", "openclip"]
    assert all(0.0 <= r["zeroshot_top1"] <= 1.0 and r["steps"] >= 1 for r in payload["runs"])
    comm = {r["reduction"]: r for r in payload["comm"]}
    # FastCLIP gathers features once without gradients; OpenCLIP also sends the feature gradients back
    assert 0 < comm["fastclip_v3"]["loss_bytes_per_step"] < comm["openclip"]["loss_bytes_per_step"]


@pytest.mark.open_clip
def test_small_batch_10k_quick_reports_the_u_diagnostic_every_epoch():
    payload = _run_quick("fastclip_small_batch_10k")
    assert payload["complete"] and payload["bench_model"] == NANO_CONFIG
    v3 = next(r for r in payload["runs"] if r["loss"] == "fastclip_v3")
    assert [p["epoch"] for p in v3["u_probe"]] == list(range(payload["args"]["epochs"]))
    assert all(p["u_rel_err_median"] >= 0 for p in v3["u_probe"])
    assert next(r for r in payload["runs"] if r["loss"] == "openclip")["u_probe"] == []
