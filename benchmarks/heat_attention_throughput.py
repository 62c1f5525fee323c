"""HEAT attention aggregators: positives/s of the fused kernel with SimpleX's attention against its mean aggregator.

SimpleX's attention aggregators score each history item ``k`` with a key ``tanh(W_k e_k + b_k)``; the fused kernel
computes the keys of all items once per batch and applies what flows back through them after the pass (what the
batched plain-torch reference does). This benchmark measures the current code, in one run on the Gowalla split (2
threads, 200 negatives from the tile sampler, batches of 16,384 positives, history capped at 100):

* ``mean``: SimpleX with the mean aggregator (no keys), the cost floor;
* ``user_attention`` / ``self_attention``: the fused kernel with attention;
* ``user_attention (reference, b4096)``: plain PyTorch with autograd and Adam, batch 4,096.

Earlier kernels are compared by checking out their commit and running this module there (the suite's runner does
that); nothing is loaded from git here. Run from the repo root: ``.venv/bin/python -m benchmarks.heat_attention_throughput``
(``--quick``: synthetic data). Writes ``benchmarks/results/<--name>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from benchmarks._common import SHARED_DATA, markdown_table, write_results
from benchmarks.tools.heat import measure_fused, measure_reference, shuffled_pairs
from lightning_sdp.datamodules.interactions import InteractionsDataModule
from lightning_sdp.models.simplex import SimpleXModule
from lightning_sdp.plugins.heat import set_cpu_threads

NAME = "heat_attention_throughput"


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
    parser.add_argument("--name", default=None, help=f"results file stem (default {NAME}, {NAME}_quick)")
    args = parser.parse_args(argv)
    if args.quick:
        dm = InteractionsDataModule(num_users=300, num_items=600, batch_size=1024, seed=0)
        args.seconds, args.dims, args.negatives, batch = 0.3, "16", 16, 1024
    else:
        if not Path(args.data).is_dir():
            raise SystemExit(f"{args.data} not found; pass --data")
        dm = InteractionsDataModule(args.data, batch_size=16384, seed=0)
        batch = 16384
    name = args.name or (f"{NAME}_quick" if args.quick else NAME)
    dm.setup("fit")
    set_cpu_threads(args.threads)
    users, items = shuffled_pairs(dm)
    rows = []
    for dim in (int(x) for x in args.dims.split(",")):
        measured: dict[str, float] = {}
        for aggregator in ("mean", "user_attention", "self_attention"):
            model = _model(dm, aggregator, dim, args.negatives, "fused")
            measured[aggregator] = measure_fused(model, users, items, args.seconds, batch)
        model = _model(dm, "user_attention", dim, args.negatives, "reference")
        measured["user_attention (reference, b4096)"] = measure_reference(
            model, users, items, args.seconds, min(4096, batch)
        )
        for variant, rate in measured.items():
            row = {"dim": dim, "variant": variant, "positives_per_s": rate}
            row.update(cost_vs_mean=measured["mean"] / rate, epoch_s=len(users) / rate)
            rows.append(row)
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
    md = (
        f"SimpleX g=0.8, history capped at 100, {args.negatives} negatives (tile sampler in the fused rows, uniform "
        f"in the reference), {args.threads} threads, {args.seconds:g} s per row after a warm-up. "
        "`cost_vs_mean` = the mean aggregator's rate / the row's; `epoch_s` = training positives / rate.\n\n"
        + markdown_table(rows, ["dim", "variant", "positives_per_s", "cost_vs_mean", "epoch_s"])
    )
    write_results(name, {"rows": rows, "seconds": args.seconds, "threads": args.threads}, md, fig)
    torch.set_num_threads(os.cpu_count() or 1)


if __name__ == "__main__":
    main()
