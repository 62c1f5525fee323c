"""An emulated cluster on one Linux machine: N "nodes" as network namespaces joined by a rate-limited link.

Each node is a network namespace with one interface (``ethN``-like, see :meth:`EmulatedCluster.ifname`) on the
subnet ``10.<a>.<b>.0/24``. Two nodes are joined by one veth pair; more than two through a Linux bridge that lives
in a separate "switch" namespace (nothing is created in the host's own namespace). The egress of every node's
interface is shaped with ``tc``: a token bucket (``tbf``) at ``rate_mbit`` and, optionally, a ``netem`` delay in
front of it. Processes started on a node (:meth:`EmulatedCluster.popen`, :meth:`EmulatedCluster.torchrun`) see
only that node's interfaces; the processes of one node talk to each other over the node's loopback (not shaped,
not counted), and to other nodes over the shaped link. Inter-node bytes are measured from the interfaces' own
counters (``/sys/class/net/<if>/statistics/tx_bytes``, read inside each namespace).

It needs root (``ip netns``, veth, ``tc``). Everything it creates (namespaces, links, bridge) is removed when the
``with`` block ends, on an exception, on Ctrl-C and on SIGTERM.

Run a command on every node (``{node}``, ``{nodes}``, ``{addr}``, ``{master}``, ``{ifname}`` are substituted)::

    sudo .venv/bin/python -m benchmarks.tools.network --nodes 2 --rate-mbit 100 -- \\
        .venv/bin/torchrun --nnodes {nodes} --node-rank {node} --nproc-per-node 2 \\
        --master-addr {master} --master-port 29511 train.py

It prints the bytes each node sent over the link. ``benchmarks/sdp4bit_throughput.py`` uses it as a library.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["EmulatedCluster", "require_root", "shape_interface", "read_tx_bytes"]


class ClusterSetupError(RuntimeError):
    """A command that builds or shapes the emulated network failed."""


def require_root() -> None:
    """Exit with a clear message (status 2) unless running as root with ``ip`` and ``tc`` available."""
    if os.geteuid() != 0:
        raise SystemExit(
            "The emulated cluster needs root: it creates network namespaces, veth links and tc qdiscs. "
            "Run it as root (e.g. `sudo .venv/bin/python -m benchmarks.tools.network ...`) or on a machine "
            "where you are root (a container with CAP_NET_ADMIN works)."
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(
            f"The emulated cluster needs the {' and '.join(missing)} command(s) (package iproute2); install it."
        )


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterSetupError(f"`{shlex.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def shape_interface(ifname: str, rate_mbit: float | None, delay_ms: float = 0.0, netns: str | None = None) -> None:
    """Shape the egress of ``ifname``: ``tbf`` at ``rate_mbit`` Mbit/s behind an optional ``netem`` delay.

    Args:
        ifname: interface to shape.
        rate_mbit: egress rate in Mbit/s; ``None`` removes any shaping.
        delay_ms: one-way delay added by ``netem`` (default 0: no netem).
        netns: namespace holding ``ifname``; ``None`` is the caller's own namespace (e.g. a process that was
            started inside a node).
    """
    prefix = ["ip", "netns", "exec", netns] if netns else []
    _run([*prefix, "tc", "qdisc", "del", "dev", ifname, "root"], check=False)  # absent the first time
    if rate_mbit is None:
        if delay_ms:
            _add_netem(prefix, ifname, delay_ms, [])
        return
    if rate_mbit <= 0:
        raise ValueError(f"rate_mbit must be positive, got {rate_mbit}.")
    # The bucket holds 5 ms worth of bytes (at least 64 KiB, enough for one GSO super-packet), and the queue
    # up to 100 ms: short bursts pass, sustained traffic gets exactly the rate.
    burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.005))
    tbf = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
    if delay_ms:
        _add_netem(prefix, ifname, delay_ms, ["handle", "1:"])
        _run([*prefix, "tc", "qdisc", "add", "dev", ifname, "parent", "1:1", "handle", "10:", *tbf])
    else:
        _run([*prefix, "tc", "qdisc", "add", "dev", ifname, "root", *tbf])


def _add_netem(prefix: list[str], ifname: str, delay_ms: float, handle: list[str]) -> None:
    proc = _run([*prefix, "tc", "qdisc", "add", "dev", ifname, "root", *handle, "netem", "delay", f"{delay_ms}ms"],
                check=False)  # fmt: skip
    if proc.returncode != 0:
        hint = (
            " This kernel has no netem qdisc (module sch_netem): load it (`modprobe sch_netem`) or run without a delay."
            if "unknown" in proc.stderr.lower()
            else ""
        )
        raise ClusterSetupError(f"Could not add a {delay_ms} ms netem delay on {ifname}: {proc.stderr.strip()}.{hint}")


def read_tx_bytes(ifname: str, netns: str | None = None) -> int:
    """Bytes sent by ``ifname`` so far (kernel counter, every protocol header included).

    Args:
        ifname: interface name.
        netns: namespace holding it; ``None`` reads the caller's own ``/sys`` (a process inside a node).
    """
    path = f"/sys/class/net/{ifname}/statistics/tx_bytes"
    if netns is None:
        return int(Path(path).read_text())
    return int(_run(["ip", "netns", "exec", netns, "cat", path]).stdout)


class EmulatedCluster:
    """N nodes as network namespaces joined by a shaped link (a veth pair, or a bridge for N > 2).

    Args:
        nodes: number of nodes (at least 2).
        rate_mbit: egress rate of every node's interface in Mbit/s; ``None`` leaves the link unshaped.
        delay_ms: one-way delay added at every node's egress with ``netem`` (default 0).
        subnet: first two octets of the private /24 the nodes get (``<subnet>.<third>.<node + 1>``).
        name: prefix of the namespaces (default ``sdpc<pid>``, so concurrent clusters do not collide).
    """

    def __init__(
        self,
        nodes: int = 2,
        rate_mbit: float | None = None,
        delay_ms: float = 0.0,
        subnet: str = "10.231",
        name: str | None = None,
    ) -> None:
        if nodes < 2:
            raise ValueError(f"An emulated cluster needs at least 2 nodes, got {nodes}.")
        if nodes > 250:
            raise ValueError(f"At most 250 nodes fit in the /24 the cluster uses, got {nodes}.")
        self.nodes = nodes
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms
        self.name = name or f"sdpc{os.getpid()}"
        self._third = os.getpid() % 250 + 1  # different clusters, different /24
        self.subnet = subnet
        self._created_ns: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict[int, Any] = {}

    # ----------------------------------------------------------------------------------------------- naming
    def netns(self, node: int) -> str:
        """Namespace name of ``node``."""
        return f"{self.name}-n{node}"

    def ifname(self, node: int) -> str:
        """Name of ``node``'s interface inside its namespace (what ``GLOO_SOCKET_IFNAME`` must be)."""
        return f"sdp{node}"

    def addr(self, node: int) -> str:
        """IPv4 address of ``node``."""
        return f"{self.subnet}.{self._third}.{node + 1}"

    @property
    def master_addr(self) -> str:
        """Address of node 0 (where torchrun's rendezvous listens)."""
        return self.addr(0)

    @property
    def _switch(self) -> str:
        return f"{self.name}-sw"

    # ------------------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> EmulatedCluster:
        require_root()
        self._install_signal_handlers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _install_signal_handlers(self) -> None:
        def _raise(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)  # unwinds through ``with``/``finally``: close() runs

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, _raise)
            except ValueError:  # not the main thread: the caller must call close() itself
                pass

    def _ns(self, ns: str, *argv: str) -> None:
        _run(["ip", "netns", "exec", ns, *argv])

    def _add_ns(self, ns: str) -> None:
        if ns in _run(["ip", "netns", "list"]).stdout.split():
            raise ClusterSetupError(f"Namespace {ns} already exists: remove it (`ip netns del {ns}`) first.")
        _run(["ip", "netns", "add", ns])
        self._created_ns.append(ns)
        self._ns(ns, "ip", "link", "set", "lo", "up")

    def _create(self) -> None:
        for r in range(self.nodes):
            self._add_ns(self.netns(r))
        if self.nodes == 2:
            a, b = self.netns(0), self.netns(1)
            _run(["ip", "link", "add", self.ifname(0), "netns", a, "type", "veth",
                  "peer", "name", self.ifname(1), "netns", b])  # fmt: skip
        else:
            sw = self._switch
            self._add_ns(sw)
            self._ns(sw, "ip", "link", "add", "br0", "type", "bridge")
            self._ns(sw, "ip", "link", "set", "br0", "up")
            for r in range(self.nodes):
                port = f"p{r}"
                _run(["ip", "link", "add", self.ifname(r), "netns", self.netns(r), "type", "veth",
                      "peer", "name", port, "netns", sw])  # fmt: skip
                self._ns(sw, "ip", "link", "set", port, "master", "br0")
                self._ns(sw, "ip", "link", "set", port, "up")
        for r in range(self.nodes):
            ns, dev = self.netns(r), self.ifname(r)
            self._ns(ns, "ip", "addr", "add", f"{self.addr(r)}/24", "dev", dev)
            self._ns(ns, "ip", "link", "set", dev, "up")
        self.set_link(self.rate_mbit, self.delay_ms)

    def set_link(self, rate_mbit: float | None, delay_ms: float = 0.0) -> None:
        """Reshape every node's egress (``None``: unshaped)."""
        for r in range(self.nodes):
            shape_interface(self.ifname(r), rate_mbit, delay_ms, netns=self.netns(r))
        self.rate_mbit, self.delay_ms = rate_mbit, delay_ms

    def close(self) -> None:
        """Stop the processes started on the nodes and delete every namespace, link and bridge created."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        self._procs = []
        errors = []
        for ns in reversed(self._created_ns):  # deleting a namespace deletes its veth ends and the bridge
            proc = _run(["ip", "netns", "del", ns], check=False)
            if proc.returncode != 0:
                errors.append(f"{ns}: {proc.stderr.strip()}")
        self._created_ns = []
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}
        if errors:
            print(f"[emulated_cluster] could not delete namespaces: {'; '.join(errors)}", file=sys.stderr)

    # ----------------------------------------------------------------------------------------- processes
    def node_env(self, node: int) -> dict[str, str]:
        """Environment additions for processes on ``node`` (gloo and NCCL bound to the node's interface)."""
        return {
            "GLOO_SOCKET_IFNAME": self.ifname(node),
            "NCCL_SOCKET_IFNAME": self.ifname(node),
            "EMULATED_CLUSTER_IFNAME": self.ifname(node),
            "EMULATED_CLUSTER_NODE": str(node),
        }

    def substitute(self, argv: Sequence[str], node: int) -> list[str]:
        """``argv`` with ``{node}``, ``{nodes}``, ``{addr}``, ``{master}`` and ``{ifname}`` filled in."""
        fields = dict(node=node, nodes=self.nodes, addr=self.addr(node), master=self.master_addr,
                      ifname=self.ifname(node))  # fmt: skip
        return [a.format(**fields) for a in argv]

    def popen(
        self, node: int, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace (own process group, stopped by :meth:`close`)."""
        full_env = {**os.environ, **(env or {}), **self.node_env(node)}
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.netns(node), *argv], env=full_env, start_new_session=True, **kwargs
        )
        self._procs.append(proc)
        return proc

    def torchrun(
        self,
        target: Sequence[str],
        nproc_per_node: int,
        master_port: int = 29511,
        env: dict[str, str] | None = None,
        torchrun: str | None = None,
        **kwargs: Any,
    ) -> list[subprocess.Popen]:
        """Start one ``torchrun`` agent per node (static rendezvous on node 0's address).

        Args:
            target: what torchrun runs, e.g. ``["-m", "benchmarks.x", "--flag"]`` or ``["train.py"]``.
            nproc_per_node: processes per node.
            master_port: rendezvous port on node 0.
            env: extra environment variables.
            torchrun: the torchrun executable (default: the one beside this Python).
            kwargs: passed to :class:`subprocess.Popen` (e.g. ``stdout``).
        """
        exe = torchrun or str(Path(sys.executable).with_name("torchrun"))
        procs = []
        for r in range(self.nodes):
            argv = [exe, f"--nnodes={self.nodes}", f"--node-rank={r}", f"--nproc-per-node={nproc_per_node}",
                    f"--master-addr={self.master_addr}", f"--master-port={master_port}", *target]  # fmt: skip
            procs.append(self.popen(r, argv, env=env, **kwargs))
        return procs

    def wait(self, procs: Sequence[subprocess.Popen], timeout: float | None = None) -> list[int]:
        """Wait for ``procs``; as soon as one fails, stop the others. Returns the exit codes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        return [p.wait() for p in procs]

    def tx_bytes(self) -> list[int]:
        """Bytes every node's interface has sent so far."""
        return [read_tx_bytes(self.ifname(r), self.netns(r)) for r in range(self.nodes)]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: build the cluster, run a command on every node, print the bytes sent, clean up."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Everything after `--` is the command run on every node; {node}, {nodes}, {addr}, {master} and "
        "{ifname} are substituted.",
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rate-mbit", type=float, default=None, help="egress rate per node (default: unshaped)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="netem one-way delay (default 0)")
    parser.add_argument("--timeout", type=float, default=None, help="stop the command after this many seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run on every node after `--`")
    require_root()
    with EmulatedCluster(args.nodes, args.rate_mbit, args.delay_ms) as cluster:
        print(f"[emulated_cluster] {args.nodes} nodes "
              f"({', '.join(f'{cluster.netns(r)}={cluster.addr(r)}' for r in range(args.nodes))}), "
              f"rate {args.rate_mbit or 'unshaped'} Mbit/s, delay {args.delay_ms} ms", flush=True)  # fmt: skip
        before = cluster.tx_bytes()
        t0 = time.perf_counter()
        procs = [cluster.popen(r, cluster.substitute(command, r)) for r in range(args.nodes)]
        codes = cluster.wait(procs, timeout=args.timeout)
        wall = time.perf_counter() - t0
        sent = [b - a for a, b in zip(before, cluster.tx_bytes(), strict=True)]
    for r, (code, nbytes) in enumerate(zip(codes, sent, strict=True)):
        print(f"[emulated_cluster] node {r}: exit {code}, sent {nbytes} bytes "
              f"({8 * nbytes / max(wall, 1e-9) / 1e6:.1f} Mbit/s over {wall:.1f} s)")  # fmt: skip
    return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
