"""The benchmark runner: ``python -m benchmarks --list | NAME[:CONFIG] [--quick] | --all --quick``.

Each run records the machine and its load *before* it starts, runs the configuration's module in a child process
from the repository root, and checks that it wrote its result set (``results/<stem>.json`` with the command inside,
and the ``.md`` / ``.png`` rendered from it). ``--against REV`` runs the same configuration on a checkout of another
commit first (a temporary git worktree: no old code is loaded into this tree) and prints both side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks import _common
from benchmarks.suite import CONFIGURATIONS, REPO_ROOT, Configuration, benchmarks, find, missing

QUICK_DIR = REPO_ROOT / "bench_quick"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    parser.add_argument("key", nargs="?", help="benchmark or benchmark:configuration (see --list)")
    parser.add_argument("--list", action="store_true", help="name every benchmark configuration and what it needs")
    parser.add_argument("--all", action="store_true", help="every benchmark runnable here (with --quick: make bench)")
    parser.add_argument("--quick", action="store_true", help=f"the smoke run; results go to {QUICK_DIR.name}/")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results)")
    parser.add_argument("--against", metavar="REV", help="run a checkout of this commit first, then this tree")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    parser.add_argument("--render", action="store_true", help="rewrite the .md and .png from the stored .json")
    parser.add_argument(
        "--background-jobs",
        type=int,
        default=0,
        metavar="N",
        help="run N CPU-bound processes beside the benchmark (a machine with another job running); recorded",
    )
    parser.epilog = "Arguments after -- go to the benchmark module as they are."
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: len(argv) - len(extra) - (1 if "--" in argv else 0)])
    if args.list:
        print(listing())
        return 0
    if args.all:
        return run_all(args.quick, args.out, args.dry_run)
    if not args.key:
        parser.error("name a benchmark (python -m benchmarks --list shows them), or pass --list or --all")
    try:
        config = find(args.key)
    except KeyError as err:
        parser.error(str(err.args[0]))
    if args.render:
        return render(config, args.out)
    lacking = missing(config)
    if lacking:
        print(f"{config.key} needs {', '.join(lacking)}, which this machine lacks", file=sys.stderr)
        return 2
    if args.against:
        return run_against(config, args.against, args.quick, extra)
    jobs = args.background_jobs or config.background_jobs
    return run(config, args.quick, args.out, extra, args.dry_run, background_jobs=jobs)


def listing() -> str:
    """One line per configuration: key, what it needs (and whether this machine has it), time, summary."""
    lines = []
    for config in CONFIGURATIONS:
        lacking = missing(config)
        needs = ", ".join(config.needs) or "-"
        state = f"lacks {', '.join(lacking)}" if lacking else "runs here"
        quick = "" if config.quick_args is not None else ", no --quick"
        lines.append(f"{config.key:<34} needs {needs:<40} {state:<24} ~{config.minutes:g} min{quick}  {config.summary}")
    return "\n".join(lines)


def command_of(config: Configuration, quick: bool, extra: Sequence[str] = ()) -> list[str]:
    """The child's command line (run from the repository root)."""
    args = config.quick_args if quick else config.args
    if args is None:
        raise ValueError(f"{config.key} has no --quick form")
    return [sys.executable, "-m", config.module_name, *args, *extra]


def run(
    config: Configuration,
    quick: bool,
    out: Path | None = None,
    extra: Sequence[str] = (),
    dry_run: bool = False,
    tree: Path = REPO_ROOT,
    background_jobs: int = 0,
) -> int:
    """Run one configuration in a child process; 0 when it succeeded and wrote its result set.

    ``background_jobs`` CPU-bound processes run beside it, started after the machine was recorded (so the record
    shows the machine as it was) and stopped when it ends; the result's ``run.background_jobs`` says so.
    """
    out = (out or (QUICK_DIR if quick else _common.RESULTS_DIR)).resolve()
    command = command_of(config, quick, extra)
    words = ["python -m benchmarks", config.key, *(["--quick"] if quick else []), *(["--", *extra] if extra else [])]
    print(f"== {config.key}: {shlex.join(command[1:])}", flush=True)
    if dry_run:
        return 0
    run_record = {
        "configuration": config.key,
        "command": " ".join(words),
        "module_command": shlex.join(["python", *command[1:]]),
        "machine": _common.machine_before_run(),
        "background_jobs": background_jobs,
    }
    env = dict(os.environ)
    env.update(
        LIGHTNING_SDP_RESULTS_DIR=str(out),
        LIGHTNING_SDP_SHARED_DATA=str(_common.SHARED_DATA),
        LIGHTNING_SDP_RESULT_STEM=config.stem,
        LIGHTNING_SDP_BENCH_RUN=json.dumps(run_record),
        PYTHONPATH=os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")])),
    )
    started = time.time()
    with busy_processes(background_jobs):
        code = subprocess.call(command, cwd=tree, env=env)
    result = out / f"{config.stem}.json"
    if code == 0 and (not result.exists() or result.stat().st_mtime < started):
        print(f"{config.key} exited 0 but wrote no {result}", file=sys.stderr)
        return 1
    return code


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes that each keep one core busy (plain Python arithmetic) until the block ends, or until
    this process ends without reaching ``finally`` (a SIGTERM): each job stops once it has another parent."""
    # the parent's pid is written in, not read at the job's start: a parent killed while the job's interpreter was
    # still starting would leave it reading its new parent's pid and running on
    busy = f"import os\nparent = {os.getpid()}\nwhile os.getppid() == parent: sum(range(10000))"
    jobs = [subprocess.Popen([sys.executable, "-c", busy]) for _ in range(count)]
    try:
        yield
    finally:
        for job in jobs:
            job.kill()
            job.wait()


def render(config: Configuration, out: Path | None = None) -> int:
    """Rewrite a stored result's pages with its module's ``render(payload)``; 2 if the module has none."""
    module = importlib.import_module(config.module_name)
    if not hasattr(module, "render"):
        print(f"{config.module_name} has no render(payload): rerun it to rewrite its pages", file=sys.stderr)
        return 2
    if out is not None:
        _common.RESULTS_DIR = out
    for path in _common.render_results(config.stem, module.render).values():
        print(f"wrote {path}")
    return 0


def run_all(quick: bool, out: Path | None, dry_run: bool) -> int:
    """Every benchmark's first configuration (quick: its smoke run); the rest are skipped with the reason."""
    outcomes: list[tuple[str, str]] = []
    for config in benchmarks() if quick else CONFIGURATIONS:
        lacking = missing(config)
        if lacking:
            outcomes.append((config.key, f"skipped: needs {', '.join(lacking)}"))
        elif quick and config.quick_args is None:
            outcomes.append((config.key, "skipped: has no --quick form"))
        else:
            code = run(config, quick, out, dry_run=dry_run, background_jobs=0 if quick else config.background_jobs)
            outcomes.append((config.key, "ok" if code == 0 else f"FAILED (exit {code})"))
    print("\n".join(f"{key:<34} {outcome}" for key, outcome in outcomes))
    return 1 if any(outcome.startswith("FAILED") for _, outcome in outcomes) else 0


def run_against(config: Configuration, rev: str, quick: bool, extra: Sequence[str]) -> int:
    """Run ``config`` on a worktree of ``rev``, then on this tree; print numbers of both results side by side."""
    with tempfile.TemporaryDirectory(prefix="lightning_sdp_against_") as tmp:
        tree, results = Path(tmp) / "tree", {label: Path(tmp) / label for label in (rev, "this tree")}
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), rev], cwd=REPO_ROOT, check=True)
        try:
            codes = [
                run(config, quick, results[rev], extra, tree=tree),
                run(config, quick, results["this tree"], extra),
            ]
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO_ROOT, check=False)
        if any(codes):
            return max(codes)
        before, after = (json.loads((results[k] / f"{config.stem}.json").read_text()) for k in (rev, "this tree"))
        print(side_by_side(before, after, rev))
    return 0


def side_by_side(before: Any, after: Any, rev: str) -> str:
    """Every number found at the same place in both payloads (machine and run records left out), with its ratio."""
    rows = [f"{'':<60} {rev[:12]:>12} {'this tree':>12} {'ratio':>7}"]
    for path, a, b in _numbers(before, after, ""):
        ratio = f"{b / a:7.3f}" if a else "      -"
        rows.append(f"{path:<60.60} {a:>12.5g} {b:>12.5g} {ratio}")
    return "\n".join(rows)


def _numbers(a: Any, b: Any, path: str) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in a.keys() & b.keys() - {"machine", "run"}:
            yield from _numbers(a[key], b[key], f"{path}.{key}" if path else str(key))
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from _numbers(x, y, f"{path}[{i}]")
    elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
        yield path, float(a), float(b)


if __name__ == "__main__":
    sys.exit(main())
