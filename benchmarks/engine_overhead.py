"""EngineProfiler's overhead against the peers: none, EngineProfiler, PyTorchProfiler, ThroughputMonitor.

One run trains the same GPT (:mod:`lightning_sdp.models.gpt`) on the same batches once per
setting, interleaved over repeats, and times every step from the start of one batch to the start of the
next (so every callback hook, the profiler's own work, data loading and logging are inside the step):

- no profiler;
- EngineProfiler outside its window: before it (``wait`` longer than the run) and after it (window first);
- EngineProfiler inside its window (``active`` batches under ``torch.profiler``), with and without
  ``module_view``;
- Lightning's ``PyTorchProfiler`` inside its recording window (schedule stretched over the run) and outside
  it (its window put after the measured batches);
- Lightning's ``ThroughputMonitor`` (always on).

Inside-window steps are those with ``torch.autograd`` profiling on at both ends, so the one-off start of a
profiler and the work after a window stay out of the steady state; those one-off costs are reported apart:
EngineProfiler's FLOP-counting warm-up batch, its window analysis, and each setting's whole-run extra time.
The time inside EngineProfiler's own hooks is measured in the run too (the hooks are wrapped with a timer),
which bounds the outside-window overhead free of timing noise. Wall time and process CPU time are both kept:
on a shared machine the CPU time (one torch thread) is the steadier of the two.

    .venv/bin/python -m benchmarks.engine_overhead            # full (a few minutes; use a quiet machine)
    .venv/bin/python -m benchmarks.engine_overhead --quick    # smoke run (well under a minute)

Writes ``benchmarks/results/engine_overhead.{json,md,png}`` (``engine_overhead_quick`` with --quick).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from benchmarks._common import machine_info, markdown_table, write_results
from benchmarks.tools.step_timer import StepTimer
from lightning_sdp.callbacks.engine_profiler import EngineProfiler
from lightning_sdp.models.gpt import GPT

VOCAB = 65


class _ProfiledStepTimer(StepTimer):
    """:class:`~benchmarks._common.StepTimer` that also notes whether autograd profiling was on at each batch start.

    Put it first in ``callbacks`` so its ``on_train_batch_start`` runs before any other callback's.
    """

    def __init__(self) -> None:
        super().__init__()
        self.profiling: list[bool] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.profiling.append(bool(torch.autograd._profiler_enabled()))

    def steps(self) -> list[tuple[int, float, bool, float]]:
        """``(batch, wall seconds to the next batch's start, profiling on at both ends, process CPU seconds)``."""
        cpu = [b - a for a, b in zip(self.cpu_starts[:-1], self.cpu_starts[1:], strict=True)]
        return [
            (i, wall, self.profiling[i] and self.profiling[i + 1], cpu[i]) for i, wall in enumerate(self.intervals())
        ]


def _time_hooks(cb: Callback, clock: StepTimer, sink: dict[int, float]) -> None:
    """Wrap every Lightning hook that ``cb``'s class overrides with a timer; seconds per batch go to ``sink``."""
    names = [
        n
        for n in dir(Callback)
        if (n.startswith("on_") or n in ("setup", "teardown"))
        and callable(getattr(Callback, n))
        and getattr(type(cb), n, None) is not getattr(Callback, n)
    ]
    for name in names:
        original = getattr(cb, name)

        @functools.wraps(original)
        def timed(*args: Any, __f: Callable[..., Any] = original, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return __f(*args, **kwargs)
            finally:
                sink[max(0, len(clock.starts) - 1)] += time.perf_counter() - t0

        setattr(cb, name, timed)


@dataclass
class Setting:
    """One way of running the same training."""

    key: str
    label: str
    make: Callable[[Path, argparse.Namespace], tuple[list[Callback], Any]]
    window: str  # "none", "outside", "inside", "always"


def _ep(args: argparse.Namespace, tmp: Path, **kwargs: Any) -> EngineProfiler:
    """A quiet EngineProfiler writing to ``tmp`` (no plot, no printed summary, no logged metrics)."""
    return EngineProfiler(dirpath=str(tmp), save_plot=False, print_summary=False, log_metrics=False, **kwargs)


def settings(args: argparse.Namespace) -> list[Setting]:
    steps, first = args.steps, args.first
    never = 10**9  # a wait longer than any run
    ep_window = {"wait": first - 1, "warmup": 1, "active": steps - first, "repeat": 1}

    def none(tmp: Path, a: argparse.Namespace) -> tuple[list[Callback], Any]:
        return [], None

    def ep_before(tmp: Path, a: argparse.Namespace) -> tuple[list[Callback], Any]:
        return [_ep(a, tmp, wait=never, warmup=1, active=1, repeat=1)], None

    def ep_after(tmp: Path, a: argparse.Namespace) -> tuple[list[Callback], Any]:
        # The window is batches 0..2 (export and analysis included), the measured steps all come after it.
        return [_ep(a, tmp, wait=0, warmup=1, active=2, repeat=1, export_trace=True)], None

    def ep_inside(tmp: Path, a: argparse.Namespace) -> tuple[list[Callback], Any]:
        return [_ep(a, tmp, export_trace=True, module_view=True, **ep_window)], None

    def ep_inside_no_modules(tmp: Path, a: argparse.Namespace) -> tuple[list[Callback], Any]:
        return [_ep(a, tmp, export_trace=True, module_view=False, **ep_window)], None

    def ptp(wait: int, active: int) -> Callable[[Path, argparse.Namespace], tuple[list[Callback], Any]]:
        def make(tmp: Path, a: argparse.Namespace) -> tuple[list[Callback], Any]:
            from lightning.pytorch.profilers import PyTorchProfiler

            sched = torch.profiler.schedule(wait=wait, warmup=1, active=active)
            return [], PyTorchProfiler(dirpath=str(tmp), filename="ptp", schedule=sched)

        return make

    def throughput(tmp: Path, a: argparse.Namespace) -> tuple[list[Callback], Any]:
        from lightning.pytorch.callbacks import ThroughputMonitor

        return [ThroughputMonitor(batch_size_fn=lambda b: b[0].size(0), length_fn=lambda b: b[0].numel())], None

    return [
        Setting("none", "no profiler", none, "none"),
        Setting("ep_before", "EngineProfiler, outside its window (before it)", ep_before, "outside"),
        Setting("ep_after", "EngineProfiler, outside its window (after it)", ep_after, "outside"),
        Setting("ep_inside", "EngineProfiler, inside its window", ep_inside, "inside"),
        Setting(
            "ep_inside_nomod",
            "EngineProfiler, inside its window, module_view=False",
            ep_inside_no_modules,
            "inside",
        ),
        Setting(
            "ptp_inside",
            "PyTorchProfiler, inside its recording window",
            ptp(max(0, first - 2), steps),
            "inside",
        ),
        # A schedule that never records makes Lightning's PyTorchProfiler fail at teardown ("Profiler must be
        # initialized before accessing events"), so its window is put on the last batches, after the measured ones.
        Setting(
            "ptp_outside",
            "PyTorchProfiler, outside its window (wait phase)",
            ptp(max(1, steps - 3), 1),
            "outside",
        ),
        Setting("throughput", "ThroughputMonitor", throughput, "always"),
    ]


def _loader(args: argparse.Namespace) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (args.steps * args.batch_size, args.seq_len + 1), generator=g)
    return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=args.batch_size)


def run_setting(setting: Setting, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One training run; per-step times and the one-off costs."""
    torch.manual_seed(0)
    model = GPT(
        vocab_size=VOCAB,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        block_size=args.seq_len,
        warmup_steps=1,
    )
    clock = _ProfiledStepTimer()
    callbacks, profiler = setting.make(tmp, args)
    hook_s: dict[int, float] = defaultdict(float)
    eps = [c for c in callbacks if isinstance(c, EngineProfiler)]
    for cb in eps:
        _time_hooks(cb, clock, hook_s)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=args.steps,
            callbacks=[clock, *callbacks],
            profiler=profiler,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
        ).fit(model, _loader(args))
    fit_s = time.perf_counter() - t0
    iv = [row for row in clock.steps() if row[0] >= args.first]
    keep = [row for row in iv if row[2] == (setting.window == "inside")]
    steady = [row[1] for row in keep]
    cpu = [row[3] for row in keep]
    out: dict[str, Any] = {
        "fit_s": fit_s,
        "step_s": steady,
        "median_step_s": statistics.median(steady) if steady else None,
        "cpu_step_s": cpu,
        "median_cpu_step_s": statistics.median(cpu) if cpu else None,
        "measured_steps": len(steady),
        "all_intervals_s": [row[1] for row in iv],
    }
    if eps:
        cb = eps[0]
        out["ep_hook_s_per_batch"] = {int(k): v for k, v in sorted(hook_s.items())}
        steady_batches = [row[0] for row in keep]
        hooks = [hook_s.get(b, 0.0) for b in steady_batches]
        out["ep_hook_us_median"] = statistics.median(hooks) * 1e6 if hooks else None
        reports = getattr(cb, "reports", []) or []
        out["ep_windows"] = len(reports)
        out["ep_analysis_s"] = [r.analysis_s for r in reports]
        out["ep_step_time_s"] = [r.step_time_s for r in reports]
        # The FLOP-counting batch: the last warm-up batch of the first window (all hooks + counting, one-off).
        warm = getattr(cb, "wait", None), getattr(cb, "warmup", 0)
        if warm[0] is not None and warm[1] and warm[0] + warm[1] - 1 < len(clock.starts) - 1:
            b = warm[0] + warm[1] - 1
            out["ep_count_batch_s"] = clock.starts[b + 1] - clock.starts[b]
            out["ep_count_batch"] = b
    return out


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    all_settings = settings(args)
    if args.only:
        all_settings = [s for s in all_settings if s.key in set(args.only) | {"none"}]
    # One untimed run first: thread pools, allocator and lazy imports warm up.
    run_setting(all_settings[0], args, tmp / "warmup")
    runs: dict[str, list[dict[str, Any]]] = {s.key: [] for s in all_settings}
    for rep in range(args.repeats):
        order = all_settings if rep % 2 == 0 else list(reversed(all_settings))
        for s in order:
            runs[s.key].append(run_setting(s, args, tmp / f"{s.key}-{rep}"))
            m = runs[s.key][-1]["median_step_s"]
            c = runs[s.key][-1]["median_cpu_step_s"]
            print(
                f"rep {rep} {s.key}: median step {m * 1e3 if m else float('nan'):.2f} ms wall, "
                f"{c * 1e3 if c else float('nan'):.2f} ms CPU ({runs[s.key][-1]['measured_steps']} steps)"
            )
    return {"settings": {s.key: {"label": s.label, "window": s.window} for s in all_settings}, "runs": runs}


def _ratios(rs: list[dict[str, Any]], base_runs: list[dict[str, Any]], key: str, steps_key: str) -> dict[str, Any]:
    """Median of ``key`` over the repeats, its ratio to no profiler's, the paired per-repeat ratios, and the ratio
    of the fastest steps (other jobs only ever add time, so the minimum is the least disturbed estimate)."""
    meds = [r[key] for r in rs if r.get(key) is not None]
    fastest = min((s for r in rs for s in r[steps_key]), default=None)
    base_fastest = min(s for r in base_runs for s in r[steps_key])
    base = statistics.median(r[key] for r in base_runs if r.get(key) is not None)
    paired = [r[key] / b[key] for r, b in zip(rs, base_runs, strict=True) if r.get(key) and b.get(key)]
    med = statistics.median(meds) if meds else None
    return {
        "median_ms": None if med is None else med * 1e3,
        "ratio": None if med is None else med / base,
        "paired_median": statistics.median(paired) if paired else None,
        "paired_min": min(paired) if paired else None,
        "paired_max": max(paired) if paired else None,
        "fastest_ratio": None if fastest is None else fastest / base_fastest,
        "paired": paired,
    }


def summarise(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per setting: wall and CPU step time against no profiler, EngineProfiler's hook and one-off costs."""
    runs = result["runs"]
    base_runs = runs["none"]
    base_med = statistics.median(r["median_step_s"] for r in base_runs)
    base_cpu = statistics.median(r["median_cpu_step_s"] for r in base_runs)
    base_fit = statistics.median(r["fit_s"] for r in base_runs)
    rows = []
    for key, meta in result["settings"].items():
        rs = runs[key]
        row: dict[str, Any] = {
            "key": key,
            "setting": meta["label"],
            "window": meta["window"],
            "wall": _ratios(rs, base_runs, "median_step_s", "step_s"),
            "cpu": _ratios(rs, base_runs, "median_cpu_step_s", "cpu_step_s"),
            "steps_per_run": statistics.median(r["measured_steps"] for r in rs),
            "run_extra_s": statistics.median(r["fit_s"] for r in rs) - base_fit,
        }
        hooks = [r.get("ep_hook_us_median") for r in rs if r.get("ep_hook_us_median") is not None]
        if hooks:
            row["ep_hook_us"] = statistics.median(hooks)
            # Against the CPU step time: the smaller (less disturbed) denominator, so the larger, safer share.
            row["ep_hook_share"] = row["ep_hook_us"] / 1e6 / min(base_med, base_cpu)
        counts = [r.get("ep_count_batch_s") for r in rs if r.get("ep_count_batch_s")]
        if counts and meta["window"] == "inside":
            row["count_batch_s"] = statistics.median(counts)
        analysis = [a for r in rs for a in r.get("ep_analysis_s", []) if a is not None]
        if analysis:
            row["analysis_s"] = statistics.median(analysis)
        rows.append(row)
    return rows


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{(x - 1) * 100:+.1f}%"


def _targets(rows: list[dict[str, Any]]) -> list[str]:
    """Each target, judged on the wall-clock ratio (the target) with the CPU-time ratio beside it."""
    by = {r["key"]: r for r in rows}
    lines = []
    for key in ("ep_before", "ep_after"):
        if key in by:
            r = by[key]
            w, c, hook = r["wall"]["paired_median"], r["cpu"]["paired_median"], r.get("ep_hook_share")
            lines.append(
                f"- {r['setting']}: wall {_pct(w)}, CPU {_pct(c)} (target ≤ +1%: wall "
                f"{'met' if w is not None and w <= 1.01 else 'not met'}, "
                f"CPU {'met' if c is not None and c <= 1.01 else 'not met'}); "
                f"its hooks take {r.get('ep_hook_us', float('nan')):.1f} µs per step = {(hook or 0) * 100:.3f}% of "
                f"the step (the noise-free bound: {'met' if hook is not None and hook <= 0.01 else 'not met'})."
            )
    if "ep_inside" in by:
        r, p = by["ep_inside"], by.get("ptp_inside")
        for kind in ("wall", "cpu"):
            e = r[kind]["paired_median"]
            q = p[kind]["paired_median"] if p else None
            ef, qf = r[kind]["fastest_ratio"], p[kind]["fastest_ratio"] if p else None
            spread = max(
                ((d[kind]["paired_max"] or 0) - (d[kind]["paired_min"] or 0)) / 2 for d in (r, p) if d is not None
            )
            repeats = min(len(d[kind]["paired"]) for d in (r, p) if d is not None)
            noise = (
                ""
                if e is None or q is None
                else f" (difference {abs(q - e) * 100:.1f} points; one repeat, no spread to compare it with)"
                if repeats < 2
                else f" (difference {abs(q - e) * 100:.1f} points; "
                f"half-range of the paired ratios ±{spread * 100:.1f} "
                + ("points: within the noise)" if abs(q - e) <= spread else "points: beyond the noise)")
            )
            lines.append(
                f"- {r['setting']} ({kind}): {_pct(e)} "
                f"(target ≤ +10%: {'met' if e is not None and e <= 1.10 else 'not met'}); "
                f"PyTorchProfiler inside its window {_pct(q)} (EngineProfiler below it: "
                f"{'yes' if e is not None and q is not None and e < q else 'no'}{noise}). "
                f"Fastest steps: EngineProfiler {_pct(ef)}, PyTorchProfiler {_pct(qf)}."
            )
    return lines


def _busy_note(*loads: float | None) -> str:
    """A warning when other jobs kept the machine busy: a few percent of step time is then below the noise."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = max((x for x in loads if x is not None), default=0.0)
    if busy <= 0.5 * cores + 1:  # the benchmark's own single-threaded process accounts for a load of about 1
        return ""
    return (
        f" **The machine was busy (load {busy} on {cores} cores): differences of a few percent are within the noise; "
        "rerun on a quiet machine to judge the 1% and 10% targets.**"
    )


def plot(rows: list[dict[str, Any]], result: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels, data = [], []
    for r in rows:
        steps = [s * 1e3 for run in result["runs"][r["key"]] for s in run["step_s"]]
        if steps:
            labels.append(r["setting"].replace(", ", ",\n"))
            data.append(steps)
    ax.boxplot(data, orientation="horizontal", showfliers=False)
    ax.set_yticks(range(1, len(labels) + 1))
    ax.set_yticklabels(labels, fontsize=7)
    base = next((r["wall"]["median_ms"] for r in rows if r["key"] == "none"), None)
    if base:
        ax.axvline(base, color="k", ls="--", lw=0.8, label="no profiler (median)")
        ax.axvline(base * 1.10, color="r", ls=":", lw=0.8, label="+10%")
        ax.legend(fontsize=8)
    ax.set_xlabel("step time (ms), start of one batch to the start of the next")
    ax.set_title("Profiler overhead per step (same model, same batches)")
    ax.invert_yaxis()
    return fig


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model, few steps, one repeat (well under a minute)")
    p.add_argument("--steps", type=int, default=40, help="training batches per run")
    p.add_argument("--first", type=int, default=6, help="first measured batch (earlier ones warm up)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats of every setting")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadier on a shared machine)")
    p.add_argument("--only", nargs="+", default=None, help="run only these setting keys (and 'none')")
    p.add_argument("--from-json", default=None, help="re-render the tables and plot of a finished run's JSON")
    args = p.parse_args(argv)
    if args.from_json:
        payload = json.loads(Path(args.from_json).read_text())
        saved = argparse.Namespace(**payload["config"])
        result = {"runs": payload["runs"], "settings": payload["settings"]}
        payload["rows"] = summarise(result)
        md = render(saved, payload["rows"], payload["wall_s"], payload["load_avg_before"], payload["load_avg_after"])
        write_results(Path(args.from_json).stem, payload, md, plot(payload["rows"], result))
        print(md)
        return
    if args.quick:
        args.steps, args.first, args.repeats = 14, 4, 1
        args.seq_len, args.batch_size, args.n_layer, args.n_embd = 64, 4, 1, 64
    if args.first < 2 or args.steps < args.first + 4:
        p.error("need --first >= 2 and --steps >= --first + 4 (warm-up batches, then a window of at least 4)")
    torch.set_num_threads(args.threads)
    name = "engine_overhead" + ("_quick" if args.quick else "")
    load_before = machine_info().get("load_avg_1m")
    tmp = Path(tempfile.mkdtemp(prefix="engine_overhead_"))
    t0 = time.perf_counter()
    result = measure(args, tmp)
    wall = time.perf_counter() - t0
    load_after = machine_info().get("load_avg_1m")
    rows = summarise(result)
    md = render(args, rows, wall, load_before, load_after)
    payload = {
        "config": vars(args),
        "rows": rows,
        "runs": result["runs"],
        "settings": result["settings"],
        "wall_s": wall,
        "load_avg_before": load_before,
        "load_avg_after": load_after,
    }
    write_results(name, payload, md, plot(rows, result))
    print(md)


def render(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    wall: float,
    load_before: float | None,
    load_after: float | None,
) -> str:
    """The markdown: the table, the targets and the machine's load."""

    def rng(d: dict[str, Any]) -> str:
        if d["paired_median"] is None:
            return "—"
        return f"{d['paired_median']:.3f} [{d['paired_min']:.3f}–{d['paired_max']:.3f}]"

    table = [
        {
            "setting": r["setting"],
            "wall ms/step": r["wall"]["median_ms"],
            "wall ratio (paired median [min–max])": rng(r["wall"]),
            "CPU ms/step": r["cpu"]["median_ms"],
            "CPU ratio (paired median [min–max])": rng(r["cpu"]),
            "CPU ratio, fastest steps": "—"
            if r["cpu"]["fastest_ratio"] is None
            else f"{r['cpu']['fastest_ratio']:.3f}",
            "steps/run": r["steps_per_run"],
            "EP hooks µs/step": "—" if r.get("ep_hook_us") is None else f"{r['ep_hook_us']:.1f}",
            "one-off: counting batch s": "—" if r.get("count_batch_s") is None else f"{r['count_batch_s']:.2f}",
            "one-off: analysis s": "—" if r.get("analysis_s") is None else f"{r['analysis_s']:.2f}",
            "run extra s": f"{r['run_extra_s']:+.2f}",
        }
        for r in rows
    ]
    md = (
        f"GPT ({args.n_layer} layers, width {args.n_embd}, {args.n_head} heads, fused attention), batch "
        f"{args.batch_size} × {args.seq_len} tokens, fp32 on the CPU with {args.threads} thread(s); {args.steps} "
        f"batches per run, batches from {args.first} on measured, {args.repeats} interleaved repeat(s) of every "
        "setting. Step time = from the start of one batch to the start of the next (every hook, the profiler, "
        "data loading and logging included); inside-window steps are those with autograd profiling on at both ends. "
        "Wall = elapsed time; CPU = this process's CPU time over the same span (with one torch thread it is far "
        "less disturbed by other jobs on a shared machine). Ratios are per repeat against that repeat's "
        "no-profiler run (paired), median over repeats; `fastest steps` compares the fastest step of each setting "
        "(other jobs only add time, so on a busy machine it is the least disturbed figure). `EP hooks µs/step` = "
        "time inside EngineProfiler's own hooks, measured in the run. "
        "One-off costs are not in the steady-state step time: EngineProfiler's FLOP-counting warm-up batch (its whole "
        "step), its window analysis (stop, trace export, parsing); `run extra s` = this setting's whole `fit` "
        f"({args.steps} batches, set-up, one-off costs and teardown included) minus the no-profiler one's.\n\n"
        + markdown_table(table)
        + "\n\n## Targets\n\n"
        + "\n".join(_targets(rows))
        + f"\n\nWhole benchmark {wall:.0f} s. 1-minute load average before {load_before}, after {load_after}"
        + (
            " (quick mode: a smoke run on a shared machine; only the full run on a quiet machine judges the targets)."
            if args.quick
            else "."
        )
        + _busy_note(load_before, load_after)
    )
    return md


if __name__ == "__main__":
    main()
