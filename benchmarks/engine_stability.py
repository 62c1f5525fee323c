"""EngineProfiler on the device at hand: its measured engine ceilings, and how stable its answers are.

Three checks on a CPU, in one run:

1. The device profile (:func:`lightning_sdp.profiling.engine_bench.measure_engine_peaks`, full mode) with the
   Trainer's thread count: GEMM ceilings per dtype, elementwise / reduction / softmax / layer-norm throughput.
2. A GEMM-only workload (a stack of bias-free square linear layers) profiled by EngineProfiler: its achieved matrix
   throughput against the measured fp32 ceiling (target: at least 70%).
3. The GPT and torchvision's resnet18 profiled over several windows of one run: the matrix share per window, its
   median and its spread (target: at most 5 points).

    .venv/bin/python -m benchmarks.engine_stability            # full (a few minutes on 2 quiet cores)
    .venv/bin/python -m benchmarks.engine_stability --quick    # smoke run (well under a minute)

Writes ``benchmarks/results/engine_stability.{json,md,png}`` (``engine_stability_quick`` with --quick).
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks._common import markdown_table, write_results
from lightning_sdp.callbacks.engine_profiler import EngineProfiler
from lightning_sdp.models.gpt import GPT
from lightning_sdp.profiling.engine_bench import cache_path, measure_engine_peaks
from lightning_sdp.profiling.report import combine_windows


class GemmStack(LightningModule):
    """Bias-free square linear layers with no activation: forward and backward are GEMMs only."""

    def __init__(self, width: int = 1024, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.layers(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)


class ImageClassifier(LightningModule):
    """torchvision's resnet18 on random images (what a user's CNN project looks like to the profiler)."""

    def __init__(self, image_size: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        from torchvision.models import resnet18

        self.net = resnet18(num_classes=num_classes)
        self.image_size = image_size

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _loader(tensors: tuple[torch.Tensor, ...], batch_size: int) -> DataLoader:
    return DataLoader(TensorDataset(*tensors), batch_size=batch_size, shuffle=False)


def _workloads(quick: bool) -> dict[str, tuple[LightningModule, DataLoader]]:
    g = torch.Generator().manual_seed(0)
    width = 512 if quick else 1024
    batch = 256 if quick else 1024
    gemm = GemmStack(width=width, depth=4)
    gemm_data = _loader((torch.randn(batch * 64, width, generator=g),), batch)

    vocab, block = 65, (64 if quick else 256)
    gpt = GPT(vocab_size=vocab, n_layer=2 if quick else 4, n_head=4, n_embd=128, block_size=block)
    tokens = torch.randint(0, vocab, (16 * 64, block + 1), generator=g)
    gpt_data = _loader((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), 16)

    size = 32 if quick else 64
    cnn = ImageClassifier(image_size=size)
    images = torch.randn(16 * 64, 3, size, size, generator=g)
    labels = torch.randint(0, 10, (16 * 64,), generator=g)
    cnn_data = _loader((images, labels), 16)
    return {"gemm_only": (gemm, gemm_data), "gpt": (gpt, gpt_data), "resnet18": (cnn, cnn_data)}


def _profile(
    name: str, model: LightningModule, data: DataLoader, windows: int, threads: int, cache_dir: str, out_dir: str
) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    profiler = EngineProfiler(
        wait=2, warmup=1, active=3, repeat=windows, dirpath=f"{out_dir}/{name}", export_trace=False, save_plot=False,
        print_summary=False, peaks_cache_dir=cache_dir,
    )  # fmt: skip
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=profiler.cycle_length * windows, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[profiler],
    )  # fmt: skip
    trainer.fit(model, data)
    per_window = profiler.reports
    combined = combine_windows(per_window)
    matrix = [w.fractions["matrix"] for w in per_window]
    util = [(w.utilisation_measured or {}).get("matrix") for w in per_window]
    return {
        "workload": name,
        "windows": len(per_window),
        "matrix_share_per_window": matrix,
        "matrix_share_median": combined.fractions["matrix"],
        "matrix_share_spread_points": 100 * (max(matrix) - min(matrix)),
        "matrix_tflops_median": combined.throughput["matrix_tflops"],
        "matrix_util_measured_per_window": util,
        "matrix_util_measured_median": (combined.utilisation_measured or {}).get("matrix"),
        "vector_util_measured_median": (combined.utilisation_measured or {}).get("vector_compute"),
        "step_time_s_median": combined.step_time_s,
        "peak_sources": combined.peak_sources,
        "fractions_median": combined.fractions,
        "fractions_range": combined.fractions_range,
    }


def _plot(rows: list[dict[str, Any]]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, row in enumerate(rows):
        shares = [100 * s for s in row["matrix_share_per_window"]]
        ax.scatter([i] * len(shares), shares, color="C0", alpha=0.7)
        ax.hlines(100 * row["matrix_share_median"], i - 0.25, i + 0.25, color="C3")
    ax.set_xticks(range(len(rows)), [r["workload"] for r in rows])
    ax.set_ylabel("matrix share of the step (%)")
    ax.set_title("EngineProfiler: matrix share per window (red: median)")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 windows (a smoke run)")
    parser.add_argument("--windows", type=int, default=5, help="profiling windows per workload (default 5)")
    parser.add_argument("--threads", type=int, default=max(1, torch.get_num_threads()), help="torch threads")
    args = parser.parse_args(argv)
    windows = 2 if args.quick else args.windows
    with tempfile.TemporaryDirectory(prefix="engine_stability_") as tmp:
        profile = measure_engine_peaks("cpu", num_threads=args.threads, quick=args.quick)
        cache = f"{tmp}/cache"
        # the callback reads its ceilings from this cache: seed it with the full measurement above
        profile.save(cache_path(profile.device_type, profile.device_name, args.threads, cache_dir=cache))
        rows = [
            _profile(name, model, data, windows, args.threads, cache, tmp)
            for name, (model, data) in _workloads(args.quick).items()
        ]
    fp32 = profile.matrix_tflops("fp32")
    gemm = rows[0]
    gemm_vs_ceiling = gemm["matrix_tflops_median"] / fp32 if fp32 and gemm["matrix_tflops_median"] else None
    table = [
        {
            "workload": r["workload"],
            "windows": r["windows"],
            "matrix share median %": 100 * r["matrix_share_median"],
            "matrix share min-max %": "–".join(f"{100 * s:.1f}" for s in (min(r["matrix_share_per_window"]),
                                                                         max(r["matrix_share_per_window"]))),
            "spread (points)": r["matrix_share_spread_points"],
            "matrix GFLOP/s": 1e3 * (r["matrix_tflops_median"] or 0.0),
            "matrix util (measured) %": None if r["matrix_util_measured_median"] is None
            else 100 * r["matrix_util_measured_median"],
            "vector util (measured) %": None if r["vector_util_measured_median"] is None
            else 100 * r["vector_util_measured_median"],
            "step ms": 1e3 * r["step_time_s_median"],
        }
        for r in rows
    ]  # fmt: skip
    ceilings = [
        {"engine": f"matrix {k}", "ceiling": f"{1e3 * v['tflops']:.1f} GFLOP/s"} for k, v in profile.matrix.items()
    ] + [
        {"engine": f"vector {k}", "ceiling": f"{max(x['gelem_per_s'] for x in v):.2f} Gelem/s, "
         f"{max(x['gbps'] for x in v):.1f} GB/s"}
        for k, v in profile.vector.items()
    ]  # fmt: skip
    spread_ok = {r["workload"]: r["matrix_share_spread_points"] <= 5.0 for r in rows if r["workload"] != "gemm_only"}
    md = [
        f"Device profile (full measurement, {args.threads} torch threads, {profile.elapsed_s:.1f} s, load "
        f"{profile.load_avg}):",
        "",
        markdown_table(ceilings),
        "",
        f"EngineProfiler, {windows} windows per workload (wait 2, warm-up 1, active 3):",
        "",
        markdown_table(table, floatfmt="{:.3g}"),
        "",
        "## Targets",
        "",
        (
            f"- GEMM-only workload at {100 * gemm_vs_ceiling:.1f}% of the measured fp32 matrix ceiling (target >= 70%: "
            f"{'met' if gemm_vs_ceiling >= 0.7 else 'not met'})."
            if gemm_vs_ceiling
            else "- GEMM-only: no ceiling."
        ),
    ]
    for name, ok in spread_ok.items():
        r = next(x for x in rows if x["workload"] == name)
        md.append(
            f"- {name}: matrix share spread {r['matrix_share_spread_points']:.1f} points over {r['windows']} windows "
            f"(target <= 5: {'met' if ok else 'not met'})."
        )
    payload = {
        "quick": args.quick,
        "threads": args.threads,
        "device_profile": profile.to_dict(),
        "workloads": rows,
        "gemm_only_vs_fp32_ceiling": gemm_vs_ceiling,
        "spread_target_met": spread_ok,
    }
    write_results("engine_stability_quick" if args.quick else "engine_stability", payload, "\n".join(md), _plot(rows))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
