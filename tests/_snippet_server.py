"""A fork server that runs ``python ARGV`` without paying the interpreter's start-up imports again.

Importing torch and Lightning takes 6-12 s of CPU on a small machine, and every example, benchmark quick run and
documentation snippet the suite starts would pay it again. This process imports the heavy third-party libraries
once and forks a child per request, which runs the request as ``__main__`` in its own folder, session, environment
and output files, as ``python ARGV`` would. It imports nothing of ``lightning_sdp``: a snippet must still import the
package itself (which registers ``strategy="sdp4bit"`` and ``accelerator="heat"``), exactly as a user's script must.
The client is ``tests/_warm_python.py``.

Protocol, one JSON line per request on stdin: ``{"argv", "cwd", "env", "stdout", "stderr"}``, where ``argv`` is
what follows ``python`` on a command line: ``["-m", module, *args]``, ``["-c", code, *args]`` or
``[script, *args]``. For each, the server writes the child's pid on a line, then, when the child has ended, its
exit status on a line.
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


def _redirect(request: dict) -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the server's stdin carries the requests: a child must never read them
    os.close(null)
    for fd, key in ((1, "stdout"), (2, "stderr")):
        out = os.open(request[key], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, fd)
        os.close(out)


def _execute(argv: list[str], cwd: str) -> None:
    """``python ARGV``'s sys.argv, sys.path[0] and ``__main__``."""
    import runpy

    if argv[0] == "-m":
        sys.path[0] = cwd
        sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file in sys.argv[0], as python -m does
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        import types

        sys.path[0] = ""
        sys.argv = ["-c", *argv[2:]]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def _run_child(request: dict) -> None:
    """In the forked child: become a session leader, take the request's folder, environment and output; run it."""
    os.setsid()  # a timeout kills the whole group: the child and the processes it started
    _redirect(request)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra
    status = 0
    try:
        _execute(request["argv"], request["cwd"])
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # an error becomes the exit status, as for a script
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
