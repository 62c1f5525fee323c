"""The GPU-only checks, in one short run on a CUDA machine (CI has no GPU; run these when one is at hand).

Each check runs in its own process with a time limit, so one failure does not hide the others:

1. ``tests``: the CUDA-marked tests and the Triton kernel tests with the interpreter off (compiled kernels on the GPU
   against the torch reference on fresh random inputs; SDP4Bit on one GPU with NCCL equal to plain training;
   EngineProfiler's tensor-core attribution on a bf16 GPT);
2. ``sdp4bit_kernels``: the fused codec kernels' bandwidth against the card's copy bandwidth, beside the plain-torch
   reference codec on the same GPU (``benchmarks/sdp4bit_kernels.py``);
3. ``engine_peaks``: EngineProfiler's measured engine ceilings of the card (``lightning-sdp engine-bench``);
4. ``engine_sweep``: the sequence-length study on the GPU, bf16, explicit vs fused attention;
5. ``gpt_training``: a short CUDA training run of a char-level GPT (nanoGPT's Shakespeare size) with
   ``strategy="sdp4bit"`` over NCCL beside the default strategy: loss, step time, peak memory;
6. ``fastclip``: FastCLIP-v3 and the OpenCLIP loss on the bundled tiny CLIP on the GPU: zero-shot top-1, step time.

    python -m benchmarks.gpu_checks --out DIR            # on the GPU machine (about 5 minutes on an H200)
    python -m benchmarks.gpu_checks --only tests,gpt_training --out DIR

Writes ``benchmarks/results/gpu_checks.{json,md}`` and packs every results file the checks wrote into
``DIR/gpu_results.tar.gz`` (unpack it into ``benchmarks/results`` on the development machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, machine_info, markdown_table, write_results

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ("tests", "sdp4bit_kernels", "gpt_training", "engine_sweep", "engine_peaks", "fastclip")  # by priority


def _run(name: str, cmd: list[str], timeout: float, env: dict[str, str]) -> dict[str, Any]:
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout, capture_output=True, text=True)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"{(e.stdout or b'')!s}{(e.stderr or b'')!s}\ntimed out after {timeout:.0f}s"
    wall = time.perf_counter() - start
    print(out if rc else out[-3000:], flush=True)  # the whole output of a failed check
    print(f"== {name}: rc {rc}, {wall:.0f}s", flush=True)
    row: dict[str, Any] = {"check": name, "rc": rc, "wall_s": round(wall, 1), "tail": out[-1500:]}
    for line in out.splitlines()[::-1]:  # the in-process checks print their numbers as one JSON line
        if line.startswith("RESULT "):
            row["result"] = json.loads(line[len("RESULT ") :])
            break
    return row


def _gpt_training(steps: int) -> dict[str, Any]:
    """nanoGPT's Shakespeare-char size on the built-in corpus, bf16: SDP4Bit over NCCL vs the default strategy."""
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from lightning_sdp import SDP4BitStrategy
    from lightning_sdp.datamodules.text import CharTextDataModule
    from lightning_sdp.models.gpt import GPT

    class _Clock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            torch.cuda.synchronize()
            self.times.append(time.perf_counter())

    rows = []
    for label, strategy in (("default (single device)", "auto"), ("sdp4bit over NCCL", "sdp4bit")):
        seed_everything(1337)
        torch.cuda.reset_peak_memory_stats()
        data = CharTextDataModule(block_size=256, batch_size=64)
        model = GPT(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2, learning_rate=1e-3,
                    warmup_steps=50, max_steps=steps)  # fmt: skip
        clock = _Clock()
        if strategy == "sdp4bit":
            strategy = SDP4BitStrategy(process_group_backend="nccl")
        trainer = Trainer(
            accelerator="cuda", devices=1, precision="bf16-mixed", strategy=strategy, max_steps=steps,
            val_check_interval=steps, limit_val_batches=50, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[clock], num_sanity_val_steps=0,
        )  # fmt: skip
        trainer.fit(model, datamodule=data)
        dts = sorted(b - a for a, b in zip(clock.times[10:], clock.times[11:], strict=False))
        step = dts[len(dts) // 2]
        rows.append(
            {
                "strategy": label,
                "steps": steps,
                "val_loss": float(trainer.callback_metrics["val/loss"]),
                "median_step_ms": 1e3 * step,
                "tokens_per_s": 64 * 256 / step,
                "peak_memory_GiB": torch.cuda.max_memory_allocated() / 2**30,
            }
        )
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return {"rows": rows}


def _fastclip(epochs: int) -> dict[str, Any]:
    """FastCLIP-v3 and the OpenCLIP loss on the bundled tiny CLIP on the GPU, batch 32, generated shapes."""
    import lightning.pytorch as pl
    import torch

    from lightning_sdp.callbacks import GammaScheduler, TemperatureScheduler, ZeroShotEvaluation
    from lightning_sdp.datamodules import ImageTextDataModule
    from lightning_sdp.integrations.open_clip import register_config
    from lightning_sdp.models import FastCLIPModule

    tiny = register_config("tiny")
    batch, num_train = 32, 2048
    dm = ImageTextDataModule(dataset="shapes", model=tiny, batch_size=batch, val_batch_size=256,
                             num_train=num_train, num_val=512, seed=0, augment=False)  # fmt: skip
    dm.setup("fit")
    rows = []
    for loss in ("openclip", "fastclip_v3"):
        pl.seed_everything(0, verbose=False)
        steps = epochs * (num_train // batch)
        module = FastCLIPModule(
            model=tiny, loss=loss, lr=2e-3, weight_decay=0.1, warmup_steps=steps // 20, max_steps=steps,
            temperature=0.07, lr_tau=4e-4 if loss == "fastclip_v3" else None, rho=6.5 if loss == "fastclip_v3" else None,
        )  # fmt: skip
        zs = ZeroShotEvaluation()
        trainer = pl.Trainer(
            accelerator="cuda", devices=1, precision="bf16-mixed", max_epochs=epochs, check_val_every_n_epoch=epochs,
            callbacks=[GammaScheduler(gamma_min=0.8, decay_epochs=max(1, epochs // 2)), TemperatureScheduler(), zs],
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0,
        )  # fmt: skip
        start = time.perf_counter()
        trainer.fit(module, dm)
        wall = time.perf_counter() - start
        rows.append(
            {
                "loss": loss,
                "epochs": epochs,
                "steps": steps,
                "zeroshot_top1_%": 100 * float(zs.metrics["val/zeroshot_top1"]),
                "final_tau": float(module.temperature),
                "train_s": wall,
                "peak_memory_GiB": torch.cuda.max_memory_allocated() / 2**30,
            }
        )
    return {"rows": rows}


def _inline(name: str, args: argparse.Namespace) -> None:
    """Entry of the in-process checks (run as ``--inline NAME`` in a child process); prints one JSON line."""
    result = _gpt_training(args.gpt_steps) if name == "gpt_training" else _fastclip(args.fastclip_epochs)
    print("RESULT " + json.dumps(result), flush=True)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for the packed results (e.g. $OUT on the GPU machine)")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma list of {', '.join(CHECKS)}")
    parser.add_argument("--gpt-steps", type=int, default=600)
    parser.add_argument("--fastclip-epochs", type=int, default=4)
    parser.add_argument("--deadline", type=float, default=450.0, help="seconds for all checks (device time is short)")
    parser.add_argument(
        "--merge", action="store_true", help="replace these checks' rows in the stored gpu_checks.json, keep the rest"
    )
    parser.add_argument("--inline", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _commands(args: argparse.Namespace, engine_dir: Path, sweep_dir: Path) -> dict[str, tuple[list[str], float]]:
    """Check name -> (command line, timeout in seconds); each check runs in its own process."""
    py = sys.executable
    return {
        "tests": (
            [py, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider", "tests/kernels/test_quant_triton.py",
             "tests/plugins/test_sdp4bit_cuda.py", "tests/callbacks/test_engine_profiler.py", "-m", "cuda or triton"],
            180,
        ),
        "sdp4bit_kernels": ([py, "-m", "benchmarks.sdp4bit_kernels"], 120),
        "engine_peaks": (
            [py, "-m", "lightning_sdp.profiling.engine_bench", "--device", "cuda", "--no-cache", "--out",
             str(engine_dir)],
            120,
        ),
        "engine_sweep": (
            [py, "-m", "lightning_sdp.callbacks.engine_profiler.sweep", "--accelerator", "cuda", "--precision",
             "bf16-mixed", "--seq-lens", "256", "512", "1024", "2048", "4096", "8192", "--attention", "explicit", "sdpa",
             "--n-layer", "4", "--n-head", "8", "--n-embd", "1024", "--batch-size", "2", "--steps", "3", "--out",
             str(sweep_dir)],
            150,
        ),
        "gpt_training": (
            [py, "-m", "benchmarks.gpu_checks", "--inline", "gpt_training", "--gpt-steps", str(args.gpt_steps)], 150
        ),
        "fastclip": (
            [py, "-m", "benchmarks.gpu_checks", "--inline", "fastclip", "--fastclip-epochs", str(args.fastclip_epochs)],
            120,
        ),
    }  # fmt: skip


def _markdown(results: dict[str, Any]) -> str:
    """The results' md: one row per check, the end of a failed check's output, the tables of the inline checks."""
    md = [f"GPU: {results['gpu']}. Each check is one process; `rc` 0 means it passed.", ""]
    md.append(markdown_table([{k: r[k] for k in ("check", "rc", "wall_s")} for r in results["checks"].values()]))
    failed = [r for r in results["checks"].values() if r["rc"] != 0]
    for r in failed:
        md += ["", f"`{r['check']}` failed; the end of its output:", "", "```", r["tail"], "```"]
    for name in ("gpt_training", "fastclip"):
        res = results["checks"].get(name, {}).get("result")
        if res:
            md += ["", f"## {name}", "", markdown_table(res["rows"])]
    return "\n".join(md)


def _pack(out: Path, folders: tuple[Path, ...]) -> Path:
    """Pack this run's result files into ``out/gpu_results.tar.gz`` (the GPU machine sends one file back)."""
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "gpu_results.tar.gz", "w:gz") as tar:
        for path in sorted(RESULTS_DIR.iterdir()):
            if path.stem in ("gpu_checks", "sdp4bit_kernels"):
                tar.add(path, arcname=path.name)
        for folder in folders:
            if folder.exists():
                tar.add(folder, arcname=folder.name)
    return out / "gpu_results.tar.gz"


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.inline:
        return _inline(args.inline, args)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_checks needs a CUDA device; CI and the CPU suite run the rest.")
    only = args.only.split(",")
    unknown = sorted(set(only) - set(CHECKS))
    if unknown:
        raise SystemExit(f"unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONUNBUFFERED": "1"}
    engine_dir = RESULTS_DIR / "gpu_engine_peaks"
    sweep_dir = RESULTS_DIR / "gpu_engine_sweep"
    commands = _commands(args, engine_dir, sweep_dir)
    results: dict[str, Any] = {"machine": machine_info(), "checks": {}}
    stored = RESULTS_DIR / "gpu_checks.json"
    if args.merge and stored.exists():
        results["checks"] = json.loads(stored.read_text())["checks"]
    try:
        results["gpu"] = torch.cuda.get_device_name(0)
    except RuntimeError as e:  # pragma: no cover - a broken driver
        results["gpu"] = f"unknown ({e})"
    start = time.perf_counter()
    for name in only:
        cmd, timeout = commands[name]
        left = args.deadline - (time.perf_counter() - start)
        if left < 30:
            results["checks"][name] = {"check": name, "rc": "not run", "wall_s": 0, "tail": "deadline reached"}
            continue
        results["checks"][name] = _run(name, cmd, min(timeout, left), env)
    md = _markdown(results)
    write_results("gpu_checks", results, md)
    print(md)
    if args.out:
        print(f"packed results into {_pack(Path(args.out), (engine_dir, sweep_dir))}")


if __name__ == "__main__":
    main()
