"""A fork server for the documentation's Python snippets (used by ``tests/test_docs.py``).

Importing torch and Lightning takes 10-12 s of CPU on a small machine, and every snippet would pay it again. This
process imports the heavy third-party libraries once and forks a child per snippet, which runs the snippet as
``__main__`` in its own folder, session and environment. It imports nothing of ``lightning_sdp``: a snippet must
still import the package itself (which registers ``strategy="sdp4bit"`` and ``accelerator="heat"``), exactly as a
user's script must.

Protocol, one JSON line per request on stdin: ``{"script", "cwd", "env", "output"}``. For each, the server writes
the child's pid on a line, then, when the child has ended, its exit status on a line.
"""

from __future__ import annotations

import json
import os
import sys

PRELOAD = ("torch", "lightning.pytorch", "numpy", "h5py", "numba", "torchmetrics")


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an extra that is not installed: the snippet that needs it will say so itself
            pass


def _run_child(request: dict) -> None:
    """In the forked child: become a session leader, take the snippet's folder, environment and output; run it."""
    os.setsid()  # a timeout kills the whole group: the snippet and the processes it started
    fd = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["script"]]
    sys.path[0] = request["cwd"]
    status = 0
    try:
        import runpy

        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # a snippet's error becomes its exit status, as for a script
        import traceback

        traceback.print_exc()
        status = 1
    try:
        import atexit

        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def main() -> None:
    _preload()
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_child(request)
        print(pid, flush=True)
        _, wait_status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(wait_status), flush=True)


if __name__ == "__main__":
    main()
