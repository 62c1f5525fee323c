"""SDP4Bit convergence benchmark: a char-level GPT on tiny Shakespeare, 4 gloo processes as 2 nodes x 2.

Every configuration (weight x gradient compression) trains the same model from the same initial weights on the
same data order for the same number of steps; the script reports the final validation loss and its gap to the
uncompressed baseline (``none/none``), the bits per element measured on the wire for each collective, the bytes
per step, the qWD reference drift over the run, and the relative quantisation error of qWD versus direct 4-bit
weight quantisation (qW) on the real weights of the run. Writes
``benchmarks/results/sdp4bit_convergence.{json,md,png}``.

Run from the repository root::

    .venv/bin/python -m benchmarks.sdp4bit_convergence --noise-seeds 2       # 7 configurations x 300 steps
    .venv/bin/python -m benchmarks.sdp4bit_convergence --quick                # smoke run (a few steps)

The current result merges three stored runs (the one above, two more seeds, a longer run) into
``sdp4bit_convergence.*`` without rerunning them::

    .venv/bin/python -m benchmarks.sdp4bit_convergence --seed 1339 --noise-seeds 2 \\
        --modes none/none qwd/tlq_hs --name sdp4bit_convergence_seeds
    .venv/bin/python -m benchmarks.sdp4bit_convergence --steps 900 --warmup 60 --val-every 300 \\
        --modes none/none qwd/tlq_hs --name sdp4bit_convergence_long
    .venv/bin/python -m benchmarks.sdp4bit_convergence --name sdp4bit_convergence \\
        --merge sdp4bit_convergence sdp4bit_convergence_seeds sdp4bit_convergence_long

All configurations run inside one launch of 4 processes (process start-up is slow on a loaded 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, SHARED_DATA, free_port, markdown_table, write_results

CONFIGS = [
    ("none", "none"),
    ("qwd", "none"),
    ("none", "tlq_hs"),
    ("qwd", "tlq_hs"),
    ("qw", "none"),
    ("none", "tlq"),
    ("none", "ulq"),
]


def _recorder(strategy: Any, every: int) -> Any:
    """A callback recording the global train loss, the qWD drift and the qW-vs-qWD error on the real weights."""
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Callback

    from lightning_sdp.kernels import quantization as q
    from lightning_sdp.kernels.quantization import QuantFormat

    class Recorder(Callback):
        def __init__(self) -> None:
            self.train: list[tuple[int, float]] = []
            self.val: list[tuple[int, float]] = []
            self.drift: list[tuple[int, float]] = []
            self.quant_error: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs["loss"].detach().float().reshape(1).clone()
            dist.all_reduce(loss)
            step = trainer.global_step
            self.train.append((step, float(loss) / trainer.world_size))
            self.drift.append((step, float(strategy.weight_drift)))
            if step % every == 0 or step == trainer.max_steps:
                self._quant_error(step)

        def _quant_error(self, step: int) -> None:
            # the weights every rank would hold under qW (quantise w directly) vs under qWD (this run's copy)
            sq = torch.zeros(3, dtype=torch.float64)
            for b in strategy.buckets:
                w = b.full_master()
                fmt = QuantFormat(4, strategy.config.weight_group_size)
                wp = torch.nn.functional.pad(w, (0, (-w.numel()) % fmt.group_size))  # same groups as qW
                qw = q.decode(*q.encode(wp, fmt, "nearest"), fmt)[: w.numel()]
                sq[0] += (qw - w).double().pow(2).sum()
                sq[1] += (b.model_flat.float() - w).double().pow(2).sum()
                sq[2] += w.double().pow(2).sum()
            self.quant_error.append(
                {"step": step, "qw": float((sq[0] / sq[2]).sqrt()), "qwd": float((sq[1] / sq[2]).sqrt())}
            )

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.sanity_checking:
                return
            value = trainer.callback_metrics.get("val/loss")
            if value is not None:
                self.val.append((trainer.global_step, float(value)))

    return Recorder()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, configs: list, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), NODE_RANK="0",
    )  # fmt: skip
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl

    from lightning_sdp.datamodules.text import CharTextDataModule
    from lightning_sdp.models.gpt import GPT
    from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy

    try:
        for seed, weights, grads in configs:
            pl.seed_everything(seed, verbose=False)
            dm = CharTextDataModule(args.data, block_size=args.block, batch_size=args.batch, seed=seed)
            dm.setup("fit")
            model = GPT(
                vocab_size=dm.vocab_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                block_size=args.block, learning_rate=args.lr, warmup_steps=args.warmup, max_steps=args.steps,
            )  # fmt: skip
            strategy = SDP4BitStrategy(
                weight_compression=weights, gradient_compression=grads, intra_node_size=args.intra, seed=seed
            )
            recorder = _recorder(strategy, every=max(1, args.steps // 6))
            trainer = pl.Trainer(
                strategy=strategy, devices=world, accelerator="cpu", max_steps=args.steps,
                val_check_interval=args.val_every, check_val_every_n_epoch=None, limit_val_batches=args.val_batches,
                num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, callbacks=[recorder], gradient_clip_val=1.0,
            )  # fmt: skip
            t0 = time.perf_counter()
            trainer.fit(model, dm)
            wall = time.perf_counter() - t0
            if not recorder.val or recorder.val[-1][0] != trainer.global_step:
                trainer.validate(model, dm, verbose=False)
                recorder.val.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))
            if rank == 0:
                stats = strategy.comm_stats
                queue.put(("result", {
                    "seed": seed, "weights": weights, "grads": grads, "wall_s": wall,
                    "params": model.num_parameters() if hasattr(model, "num_parameters") else None,
                    "train": recorder.train, "val": recorder.val, "drift": recorder.drift,
                    "quant_error": recorder.quant_error,
                    "bits": {k: stats.bits_per_element(k, total=True) for k in ("weight", "grad_intra", "grad_inter")},
                    "bytes_per_step": stats.bytes_per_step,
                    "topology": [strategy.topology.intra_size, strategy.topology.inter_size],
                }))  # fmt: skip
                print(f"[sdp4bit] {weights}/{grads} seed {seed}: val {recorder.val[-1][1]:.4f} in {wall:.0f}s",
                      flush=True)  # fmt: skip
        queue.put(("done", rank))
    except BaseException:  # report every failure to the parent
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    configs = [(args.seed, w, g) for w, g in CONFIGS if f"{w}/{g}" in args.modes]
    for extra in range(1, args.noise_seeds):
        configs += [(args.seed + extra, w, g) for w, g in (("none", "none"), ("qwd", "tlq_hs"))]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, configs, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    results, done = [], 0
    try:
        while done < args.world:
            kind, payload = queue.get()
            if kind == "result":
                results.append(payload)
            elif kind == "done":
                done += 1
            else:
                raise RuntimeError(payload)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


def _rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One table row per configuration and seed: final losses, the gap to none/none, bits, bytes, drift, wall time."""
    base = {r["seed"]: r["val"][-1][1] for r in results if (r["weights"], r["grads"]) == ("none", "none")}
    rows = []
    for r in results:
        final = r["val"][-1][1]
        ref = base.get(r["seed"])
        drift = [d for _, d in r["drift"] if not math.isnan(d)]
        rows.append({
            "weights/grads": f"{r['weights']}/{r['grads']}", "seed": r["seed"], "final val loss": final,
            "gap vs none/none (%)": 100 * (final / ref - 1) if ref else float("nan"),
            "final train loss (mean last 20)": sum(v for _, v in r["train"][-20:]) / len(r["train"][-20:]),
            "weight bits/elt": r["bits"]["weight"], "grad bits/elt intra": r["bits"]["grad_intra"],
            "grad bits/elt inter": r["bits"]["grad_inter"], "bytes/step/rank": r["bytes_per_step"],
            "max w drift": max(drift) if drift else float("nan"), "wall s": r["wall_s"],
        })  # fmt: skip
    return rows


def _quant_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The qW vs qWD relative error over the qwd/tlq_hs run."""
    qerr = next((r["quant_error"] for r in results if (r["weights"], r["grads"]) == ("qwd", "tlq_hs")), [])
    return [{"step": e["step"], "qW rel. error": e["qw"], "qWD rel. error": e["qwd"], "qW / qWD": e["qw"] / e["qwd"]}
            for e in qerr if e["qwd"] > 0]  # fmt: skip


def _plot(axes: Any, results: list[dict[str, Any]], base_seed: int, suffix: str = "") -> None:
    """Train loss (10-step mean), validation loss and the qWD drift of every run on three axes."""
    for r in results:
        label = f"{r['weights']}/{r['grads']}" + (f" (seed {r['seed']})" if r["seed"] != base_seed else "")
        steps = [s for s, _ in r["train"]]
        vals = [v for _, v in r["train"]]
        k = 10
        smooth = [sum(vals[max(0, i - k + 1) : i + 1]) / len(vals[max(0, i - k + 1) : i + 1]) for i in range(len(vals))]
        axes[0].plot(steps, smooth, label=label, lw=1)
        axes[1].plot([s for s, _ in r["val"]], [v for _, v in r["val"]], marker="o", label=label, lw=1)
        if r["weights"] != "none":
            axes[2].plot([s for s, _ in r["drift"]], [d for _, d in r["drift"]], label=label, lw=1)
    axes[0].set(title=f"train loss (4 ranks, 10-step mean){suffix}", xlabel="step", ylabel="loss")
    axes[1].set(title=f"validation loss{suffix}", xlabel="step")
    axes[2].set(title=f"||w_master - w_model|| / ||w_master||{suffix}", xlabel="step", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    axes[2].legend(fontsize=7)


def _describe(args: dict[str, Any], params: Any, seeds: str | None = None) -> str:
    """The paragraph that says what was trained (``args``: the run's arguments as a dict)."""
    world = args["world"]
    seed_note = f" Seeds {seeds}." if seeds else ""
    return (
        f"Char GPT: n_layer={args['n_layer']}, n_head={args['n_head']}, n_embd={args['n_embd']}, "
        f"block={args['block']}, {params} parameters; batch {args['batch']} per rank (global {args['batch'] * world}), "
        f"{args['steps']} steps, AdamW lr {args['lr']} (warm-up {args['warmup']}, cosine), clip 1.0; data "
        f"`{args['data']}`; validation on {args['val_batches']} batches per rank every {args['val_every']} steps. "
        f"Same seed, initial weights and data order for every configuration.{seed_note}"
    )


_QUANT_NOTE = (
    "Relative quantisation error of the weights every rank holds, on the real weights of the qwd/tlq_hs run "
    "(qW: 4-bit, group 2048, round-to-nearest, applied to the weights themselves; qWD: this run's model copy):"
)


def summarise(results: list[dict[str, Any]], args: argparse.Namespace) -> tuple[dict, str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, qrows = _rows(results), _quant_rows(results)
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    _plot(axes, results, args.seed)
    fig.tight_layout()
    md = [
        "# SDP4Bit convergence (CPU, gloo, 4 processes as 2 nodes x 2)",
        "",
        _describe(vars(args), results[0].get("params")),
        "",
        markdown_table(rows, list(rows[0])),
        "",
        _QUANT_NOTE,
        "",
        markdown_table(qrows) if qrows else "(none recorded)",
        "",
    ]
    payload = {"args": vars(args), "results": results, "table": rows, "quant_error": qrows}
    return payload, "\n".join(md), fig


def merge(names: Sequence[str], out: str = "sdp4bit_convergence") -> dict[str, Path]:
    """Merge stored runs ``results/<name>.json`` into ``results/<out>.{json,md,png}``, numbers unchanged.

    The current result of this benchmark is several runs (more seeds, a longer run). The merged files hold one
    section per run length: the runs' stored table rows one after the other, the qW/qWD error of the first run of
    that length, and the runs they came from (name, steps, seeds, machine).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(name, json.loads((RESULTS_DIR / f"{name}.json").read_text())) for name in names]
    for name, run in runs:
        if "args" not in run:
            raise ValueError(f"results/{name}.json is not a stored run (already merged?): merge the runs themselves.")
    lengths = sorted({run["args"]["steps"] for _, run in runs})
    fig, axes = plt.subplots(len(lengths), 3, figsize=(17, 4.8 * len(lengths)), squeeze=False)
    md = [
        "# SDP4Bit convergence (CPU, gloo, 4 processes as 2 nodes x 2)",
        "",
        f"Merged from {len(runs)} stored runs (numbers unchanged):",
        "",
        markdown_table([_source(name, run) for name, run in runs]),
        "",
    ]
    for row, steps in enumerate(lengths):
        same = [(name, run) for name, run in runs if run["args"]["steps"] == steps]
        results = [r for _, run in same for r in run["results"]]
        seeds = ", ".join(str(s) for s in sorted({r["seed"] for r in results}))
        first = same[0][1]
        md += [f"## {steps} steps", "", _describe(first["args"], results[0].get("params"), seeds), ""]
        md += [markdown_table([r for _, run in same for r in run["table"]]), "", _QUANT_NOTE, ""]
        md += [markdown_table(first["quant_error"]) if first["quant_error"] else "(none recorded)", ""]
        _plot(axes[row], results, first["args"]["seed"], suffix=f", {steps} steps")
    fig.tight_layout()
    payload = {
        "merged_from": [_source(name, run) for name, run in runs],
        "runs": {name: run for name, run in runs},
        "machine": runs[0][1]["machine"],
    }
    return write_results(out, payload, "\n".join(md), fig)


def _source(name: str, run: dict[str, Any]) -> dict[str, Any]:
    seeds = sorted({r["seed"] for r in run["results"]})
    configs = sorted({f"{r['weights']}/{r['grads']}" for r in run["results"]})
    machine = run.get("machine", {})
    return {
        "run": name, "steps": run["args"]["steps"], "seeds": ", ".join(map(str, seeds)),
        "configurations": len(configs), "machine": f"{machine.get('cpu')}, {machine.get('cores')} cores",
        "date": str(machine.get("date", ""))[:10],
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(SHARED_DATA / "tinyshakespeare" / "input.txt"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--intra", type=int, default=2, help="processes per emulated node")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=96)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--val-every", type=int, default=100)
    parser.add_argument("--val-batches", type=int, default=25)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--noise-seeds", type=int, default=1, help="extra seeds for none/none and qwd/tlq_hs")
    parser.add_argument("--modes", nargs="*", default=[f"{w}/{g}" for w, g in CONFIGS])
    parser.add_argument("--name", default="sdp4bit_convergence", help="stem of the files in benchmarks/results/")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run; writes <name>_quick.*")
    parser.add_argument(
        "--merge", nargs="+", metavar="RUN", help="merge stored results/<RUN>.json files into results/<name>.* (no run)"
    )
    args = parser.parse_args(argv)
    if args.merge:
        print(merge(args.merge, args.name))
        return
    if args.quick:
        args.steps, args.val_every, args.val_batches, args.n_embd, args.n_layer = 12, 6, 2, 32, 1
        args.warmup = 2
    if not Path(args.data).exists():
        raise SystemExit(f"{args.data} not found: pass --data PATH (tiny Shakespeare, see ../shared/data/README.md)")
    t0 = time.perf_counter()
    results = run(args)
    payload, md, fig = summarise(results, args)
    payload["total_wall_s"] = time.perf_counter() - t0
    md += f"\nTotal wall time {payload['total_wall_s']:.0f} s.\n"
    paths = write_results(args.name + ("_quick" if args.quick else ""), payload, md, fig)
    print(md)
    print(paths)


if __name__ == "__main__":
    main()
