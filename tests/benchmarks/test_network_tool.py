"""The emulated cluster of the benchmarks (``benchmarks/tools/network.py``).

The tests that build namespaces need root and a kernel that allows network namespaces, veth and ``tc tbf``; they
skip elsewhere, saying why. The root check itself is tested everywhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.tools import network as emulated_cluster
from benchmarks.tools.network import EmulatedCluster

REPO = Path(__file__).resolve().parents[2]

_RECEIVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 29650)); s.listen(1)
c, _ = s.accept(); n = 0
while True:
    d = c.recv(1 << 20)
    if not d: break
    n += len(d)
c.sendall(str(n).encode()); c.close()
"""
_SENDER = """
import socket, sys, time
for _ in range(200):
    try:
        s = socket.create_connection((sys.argv[1], 29650)); break
    except OSError: time.sleep(0.05)
t = time.perf_counter(); s.sendall(b"x" * int(sys.argv[2])); s.shutdown(socket.SHUT_WR)
got = s.recv(64); print(time.perf_counter() - t, int(got))
"""


def _netns_unusable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth and tc); run the suite as root to test the emulated cluster"
    probe = f"sdpprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"root, but `ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_SKIP = _netns_unusable()
needs_netns = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
pytestmark = pytest.mark.bench


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def test_without_root_it_says_so_and_exits_non_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(emulated_cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="needs root") as err:
        emulated_cluster.main(["--nodes", "2", "--", "true"])
    assert err.value.code not in (0, None)  # a message string: Python exits with status 1


@needs_netns
def test_shaped_link_limits_rate_and_counts_bytes() -> None:
    payload = 2_000_000
    with EmulatedCluster(nodes=2, rate_mbit=40, name=f"sdpt{os.getpid()}") as cluster:
        before = cluster.tx_bytes()
        recv = cluster.popen(0, [sys.executable, "-c", _RECEIVER, cluster.addr(0)])
        send = cluster.popen(1, [sys.executable, "-c", _SENDER, cluster.addr(0), str(payload)],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
        out, _ = send.communicate(timeout=60)
        assert recv.wait(timeout=30) == 0 and send.returncode == 0
        sent = [b - a for a, b in zip(before, cluster.tx_bytes(), strict=True)]
        names = _namespaces(cluster.name)
        assert len(names) == 2
    seconds, received = out.split()
    assert int(received) == payload
    # node 1's counter saw the payload plus TCP/IP headers (a few %), node 0 only acknowledgements
    assert payload <= sent[1] <= 1.1 * payload, sent
    assert sent[0] < 0.1 * payload, sent
    # 2 MB at 40 Mbit/s take 0.4 s; the bucket lets at most 64 KiB through at once, so never under 0.35 s
    assert float(seconds) >= 0.35, f"{payload} bytes went through in {seconds} s: the link is not shaped"
    assert _namespaces(cluster.name) == []  # removed on leaving the block


@needs_netns
def test_bridge_for_three_nodes_and_cleanup_on_error() -> None:
    name = f"sdpe{os.getpid()}"
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(nodes=3, rate_mbit=100, name=name) as cluster:
            assert len(_namespaces(name)) == 4  # 3 nodes and the switch holding the bridge
            recv = cluster.popen(0, [sys.executable, "-c", _RECEIVER, cluster.addr(0)])
            send = cluster.popen(2, [sys.executable, "-c", _SENDER, cluster.addr(0), "1000"],
                                 stdout=subprocess.PIPE, text=True)  # fmt: skip
            out, _ = send.communicate(timeout=30)
            assert recv.wait(timeout=30) == 0 and out.split()[1] == "1000", "node 2 cannot reach node 0"
            raise RuntimeError("boom")
    assert _namespaces(name) == []


@needs_netns
def test_cli_removes_everything_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.tools.network", "--nodes", "2", "--rate-mbit", "100", "--",
         "sleep", "60"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    prefix = f"sdpc{proc.pid}"
    deadline = time.monotonic() + 20
    while len(_namespaces(prefix)) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert len(_namespaces(prefix)) == 2, proc.communicate(timeout=5)
    time.sleep(0.5)  # let it start the commands
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0, err
    assert _namespaces(prefix) == []
    leftover = subprocess.run(["pgrep", "-f", "^sleep 60$", "-P", str(proc.pid)], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""
