"""HEAT attention aggregators: positives/s of the fused kernel with batched attention keys vs per-sample keys.

SimpleX's attention aggregators score each history item ``k`` with a key ``tanh(W_k e_k + b_k)``. The earlier kernel
(the commit named by ``PER_SAMPLE_KEYS_COMMIT``) computed every key inside every sample (``O(|H| d^2)`` a sample,
100 history rows x d^2); the current one computes the keys of all items once per batch and applies what flows back
through them after the pass (what the batched plain-torch reference does). This benchmark measures, in one run on the Gowalla split (2 threads, 200
negatives from the tile sampler, batches of 16,384 positives, history capped at 100):

* ``mean``: SimpleX with the mean aggregator (no keys), the cost floor;
* ``user_attention`` / ``self_attention``: the current kernel;
* ``user_attention (per-sample keys)``: the earlier kernel, loaded from git (skipped without git, and
  with ``--quick``: compiling that kernel takes ~40 s, which a smoke run need not spend);
* ``user_attention (reference, b4096)``: plain PyTorch with autograd and Adam, batch 4,096.

Run from the repo root: ``.venv/bin/python -m benchmarks.heat_attention_throughput`` (``--quick``: synthetic data).
Writes ``benchmarks/results/heat_attention_throughput.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from benchmarks._common import SHARED_DATA, markdown_table, write_results
from benchmarks.heat_throughput import _pairs, measure_fused, measure_reference
from lightning_sdp.datamodules.interactions import InteractionsDataModule
from lightning_sdp.models.simplex import SimpleXModule
from lightning_sdp.plugins.heat import set_cpu_threads

NAME = "heat_attention_throughput"
PER_SAMPLE_KEYS_COMMIT = "48cbb34"  # the last kernel that computed the attention keys inside every sample


def kernel_at(commit: str) -> ModuleType | None:
    """``lightning_sdp.kernels.cf_numba`` as of ``commit`` (``None`` where git cannot show it)."""
    root = Path(__file__).resolve().parents[1]
    try:
        shown = subprocess.run(
            ["git", "show", f"{commit}:lightning_sdp/kernels/cf_numba.py"],
            cwd=root,
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        return None
    if shown.returncode != 0:
        return None
    # a fixed place, rewritten only when the source differs: numba's on-disk cache (keyed on the file's path and
    # modification time) then holds the old kernel's compilation across processes and runs
    path = Path(tempfile.gettempdir()) / "lightning_sdp_kernels" / f"cf_numba_{commit}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != shown.stdout:
        path.write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # numba's cache finds the kernel's globals through the module's name
    spec.loader.exec_module(module)
    return module


@contextmanager
def _kernel_swapped(old: ModuleType) -> Iterator[None]:
    """Run :meth:`SimpleXModule.fused_step` on ``old``'s kernel (same signature) inside the block."""
    from lightning_sdp.kernels import cf_numba

    current = cf_numba.fused_sgd_step
    cf_numba.fused_sgd_step = old.fused_sgd_step
    try:
        yield
    finally:
        cf_numba.fused_sgd_step = current


def _model(dm: InteractionsDataModule, aggregator: str, dim: int, negatives: int, backend: str) -> SimpleXModule:
    m = SimpleXModule(
        dm.num_users,
        dm.num_items,
        dim=dim,
        g=0.8,
        loss="ccl",
        aggregator=aggregator,
        num_negatives=negatives,
        max_history=100,
        backend=backend,
        sampler="tile" if backend == "fused" else "uniform",
        lr=0.1 if backend == "fused" else 1e-4,
        row_norm=1.0 if backend == "fused" else None,
        aggregator_lr_scale=0.1,
    )
    m.set_interactions(*dm.train_csr)
    return m


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--data", default=str(SHARED_DATA / "gowalla"), help="LightGCN folder (default: Gowalla)")
    parser.add_argument("--seconds", type=float, default=6.0, help="measuring time per configuration")
    parser.add_argument("--negatives", type=int, default=200)
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny synthetic run (smoke test)")
    parser.add_argument(
        "--per-sample-keys",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"also measure the kernel of commit {PER_SAMPLE_KEYS_COMMIT} (default: yes, except with --quick)",
    )
    args = parser.parse_args(argv)
    if args.per_sample_keys is None:
        args.per_sample_keys = not args.quick
    if args.quick:
        dm = InteractionsDataModule(num_users=300, num_items=600, batch_size=1024, seed=0)
        args.seconds, args.dims, args.negatives, batch = 0.3, "16", 16, 1024
        name = f"{NAME}_quick"
    else:
        if not Path(args.data).is_dir():
            raise SystemExit(f"{args.data} not found; pass --data")
        dm = InteractionsDataModule(args.data, batch_size=16384, seed=0)
        batch, name = 16384, NAME
    dm.setup("fit")
    set_cpu_threads(args.threads)
    users, items = _pairs(dm)
    old = kernel_at(PER_SAMPLE_KEYS_COMMIT) if args.per_sample_keys else None
    rows = []
    for dim in (int(x) for x in args.dims.split(",")):
        measured: dict[str, float] = {}
        for aggregator in ("mean", "user_attention", "self_attention"):
            model = _model(dm, aggregator, dim, args.negatives, "fused")
            measured[aggregator] = measure_fused(model, users, items, args.seconds, batch)
        if old is not None:
            with _kernel_swapped(old):
                model = _model(dm, "user_attention", dim, args.negatives, "fused")
                measured["user_attention (per-sample keys)"] = measure_fused(model, users, items, args.seconds, batch)
        model = _model(dm, "user_attention", dim, args.negatives, "reference")
        measured["user_attention (reference, b4096)"] = measure_reference(
            model, users, items, args.seconds, min(4096, batch)
        )
        batched = measured["user_attention"]
        for variant, rate in measured.items():
            rows.append(
                {
                    "dim": dim,
                    "variant": variant,
                    "positives_per_s": rate,
                    "batched_keys_speedup": batched / rate,
                    "epoch_s": len(users) / rate,
                }
            )
            print(rows[-1], flush=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"d={r['dim']} {r['variant']}" for r in rows]
    ax.barh(labels, [r["positives_per_s"] for r in rows])
    ax.set_xscale("log")
    ax.set_xlabel(f"positives/s ({args.threads} threads)")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    if old is not None:
        old_state = "measured"
    elif args.per_sample_keys:
        old_state = "not measured: git could not show it"
    else:
        old_state = "not measured: --no-per-sample-keys (the default with --quick)"
    md = (
        f"SimpleX g=0.8, history capped at 100, {args.negatives} negatives (tile sampler in the fused rows, uniform "
        f"in the reference), {args.threads} threads, {args.seconds:g} s per row after a warm-up. "
        f"`batched_keys_speedup` = today's user-attention kernel / the row; `epoch_s` = training positives / rate. "
        f"Per-sample keys: the kernel of commit {PER_SAMPLE_KEYS_COMMIT} "
        f"({old_state}). "
        f"Load average at the end: {os.getloadavg()[0]:.2f}.\n\n"
        + markdown_table(rows, ["dim", "variant", "positives_per_s", "batched_keys_speedup", "epoch_s"])
    )
    write_results(name, {"rows": rows, "seconds": args.seconds, "threads": args.threads}, md, fig)
    torch.set_num_threads(os.cpu_count() or 1)


if __name__ == "__main__":
    main()
