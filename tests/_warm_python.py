"""``python ARGV`` for tests, forked from a server that has already imported torch and Lightning.

Examples, benchmark quick runs and documentation snippets are run as a user runs them: as ``__main__`` of a new
process, with its own folder, environment, output and exit status. A fresh interpreter would spend 6-12 s of CPU on
imports first; ``run_python`` forks the process from ``tests/_snippet_server.py`` instead (started once per test
process, never importing ``lightning_sdp``). ``LIGHTNING_SDP_TEST_FRESH_PROCESS=1`` runs every request in a fresh
interpreter (``subprocess.run``), for comparison or when a fork server misbehaves.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fresh_processes() -> bool:
    """Whether requests run in fresh interpreters (``LIGHTNING_SDP_TEST_FRESH_PROCESS=1``)."""
    return os.environ.get("LIGHTNING_SDP_TEST_FRESH_PROCESS") == "1"


class WarmPython:
    """Client of ``tests/_snippet_server.py``: one request at a time, replies read unbuffered with a timeout.

    Args:
        env: the server's environment (its imports read it once; each request brings its own).
    """

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "_snippet_server.py")],
            cwd=ROOT, env=dict(os.environ if env is None else env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        self._pending = b""
        if self._readline(timeout=300) != "ready":
            raise RuntimeError("the fork server for tests did not start")

    def _readline(self, timeout: float | None) -> str | None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError("the fork server for tests ended")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()

    def run(
        self, argv: list[str], cwd: Path | str, env: dict[str, str], timeout: float, stdout: Path, stderr: Path
    ) -> int | None:
        """Run ``python ARGV``; its output goes to the files ``stdout`` and ``stderr`` (the same path merges them).

        Returns:
            The exit status, or ``None`` when it ran past ``timeout`` seconds (its whole session is killed then).
        """
        request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(stdout), "stderr": str(stderr)}
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        pid = int(self._readline(timeout=30) or "0")
        status = self._readline(timeout=timeout)
        if status is None:
            os.killpg(pid, signal.SIGKILL)
            self._readline(timeout=30)
            return None
        return int(status)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_server: WarmPython | None = None


def _shared_server() -> WarmPython:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = WarmPython()
        atexit.register(_server.close)
    return _server


def run_python(
    argv: list[str], cwd: Path | str | None = None, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)`` from the warm fork server.

    Args:
        argv: what follows ``python``: ``["-m", module, ...]``, ``["-c", code, ...]`` or ``[script, ...]``.
        cwd: working folder (default: this process's).
        env: environment (default: this process's).
        timeout: seconds before the process and everything it started are killed.

    Raises:
        subprocess.TimeoutExpired: past ``timeout``, with what it had written so far.
    """
    cwd = Path.cwd() if cwd is None else cwd
    env = dict(os.environ if env is None else env)
    if fresh_processes():
        return subprocess.run(
            [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    with tempfile.TemporaryDirectory(prefix="warm_python_") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        status = _shared_server().run(argv, cwd, env, timeout, out, err)
        stdout, stderr = (p.read_text(errors="replace") if p.exists() else "" for p in (out, err))
    if status is None:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess([sys.executable, *argv], status, stdout, stderr)
