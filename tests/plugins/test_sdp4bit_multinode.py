"""Two "nodes" on one host: ``torchrun --nnodes=2 --nproc-per-node=2`` started twice on loopback.

The strategy must read intra-node size 2 and inter-node size 2 from the launcher, without ``intra_node_size``.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "sdp4bit_two_nodes.py"


@pytest.mark.slow
def test_torchrun_two_nodes_on_loopback_detects_topology():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--launch", "--steps", "2"], capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3]
    for r in reports:
        assert r["environment"] == "TorchElasticEnvironment"
        assert r["node_rank"] == r["rank"] // 2
        assert (r["intra_node_size"], r["inter_node_size"]) == (2, 2)
        assert r["bits"]["grad_intra"] == 8.25 and r["bits"]["grad_inter"] == 4.25
