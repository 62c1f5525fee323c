"""Run a test function in N gloo processes on the CPU.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a gloo process group in
each (with the usual ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` environment set, so
Lightning's ``LightningEnvironment`` sees the same world), calls ``fn(rank, world_size, *args)``, and returns the
per-rank return values. A failure in any rank fails the caller with that rank's traceback; a hung rank fails it
after ``timeout`` seconds. ``fn`` must be a module-level (picklable) function. Return plain Python values or numpy
arrays, not torch tensors: tensors cross the queue as shared-memory handles that die with the worker process.

The ranks start from a fork server that has imported torch, Lightning and the package once per test process
(importing them costs 6-12 s of CPU per process on a small machine, more than most distributed tests run); each rank
gets the caller's current environment and working directory, as a spawned process would.
``LIGHTNING_SDP_TEST_START_METHOD=spawn`` starts every rank from a fresh interpreter instead.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from benchmarks._common import free_port as find_free_port  # the one free-port helper of the repository

# Imported once by the fork server; every rank is forked from it. The server itself never runs a torch operation,
# so no OpenMP or numba thread pool exists yet when it forks.
_PRELOAD = ["numpy", "torch", "torch.distributed", "lightning.pytorch", "lightning_sdp", "tests._distributed"]


def _context() -> Any:
    method = os.environ.get("LIGHTNING_SDP_TEST_START_METHOD", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    queue: Any,
    init_group: bool,
    env: dict[str, str],
) -> None:
    import torch
    import torch.distributed as dist

    # a forked rank starts with the fork server's environment: take the caller's, as a spawned process would
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    try:
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # report everything, including KeyboardInterrupt/SystemExit
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if init_group and dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # tearing down after a failure: the failure itself is already reported
                pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240.0,
    init_group: bool = True,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes and return their results by rank.

    Args:
        fn: module-level function to run in every rank.
        world_size: number of processes.
        *args: extra picklable arguments passed to ``fn``.
        timeout: seconds to wait for all ranks before failing.
        init_group: initialise the gloo default process group before calling ``fn``. Pass ``False`` when ``fn``
            starts a Lightning ``Trainer``, which initialises it itself from the environment variables.
        env: extra environment variables for the workers.
    """
    ctx = _context()
    queue = ctx.SimpleQueue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, fn, args, queue, init_group, {**os.environ, **(env or {})}),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"run_distributed: ranks {sorted(set(range(world_size)) - set(results) - set(failures))} did "
                    f"not finish within {timeout:.0f}s" + _format_failures(failures)
                )
            if not queue.empty():
                rank, ok, payload = queue.get()
                (results if ok else failures)[rank] = payload
                if failures:
                    # Give the other ranks a moment to report, then fail with the first traceback.
                    time.sleep(0.5)
                    while not queue.empty():
                        r, ok2, p2 = queue.get()
                        (results if ok2 else failures)[r] = p2
                    break
                continue
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
            if dead and queue.empty():
                time.sleep(0.2)
                if queue.empty():
                    raise RuntimeError(
                        f"run_distributed: rank(s) {dead} died with exit codes {[procs[i].exitcode for i in dead]}"
                    )
            time.sleep(0.02)
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if failures:
        raise AssertionError("run_distributed: a rank failed" + _format_failures(failures))
    return [results[r] for r in range(world_size)]


def _format_failures(failures: dict[int, str]) -> str:
    return "".join(f"\n\n----- rank {r} -----\n{tb}" for r, tb in sorted(failures.items()))
