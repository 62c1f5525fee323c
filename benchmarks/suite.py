"""The benchmark suite: every benchmark and its named configurations, with what each needs.

A configuration is a module of this folder plus the arguments that make one result set; its results are
``results/<benchmark>.*`` for the ``default`` configuration and ``results/<benchmark>_<name>.*`` for the others.
``python -m benchmarks --list`` prints this table; ``python -m benchmarks NAME[:CONFIG]`` runs one entry.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks._common import SHARED_DATA

REPO_ROOT = Path(__file__).resolve().parents[1]

# What a configuration may need, and how the runner tells whether this machine has it.
ROOT, GPU = "root", "gpu"
GOWALLA, LASTFM, SHAKESPEARE = "data:gowalla", "data:lastfm", "data:tinyshakespeare"


@dataclass(frozen=True)
class Configuration:
    """One result set: a benchmark module run with fixed arguments.

    Args:
        benchmark: the suite's name for it; the results stem starts with it.
        name: the configuration's name (``default`` writes ``results/<benchmark>.*``).
        summary: what it measures and against what, in one line.
        args: the module's arguments for the full run.
        quick_args: the module's arguments for the smoke run (``--quick``); ``None``: no smoke run.
        needs: what the machine must have: ``root``, ``gpu``, ``data:<folder of ../shared/data>``,
            ``pkg:<importable module>``.
        module: the module under ``benchmarks/`` (default: ``benchmark``), or a dotted module path.
        minutes: roughly how long the full run takes on a 2-core machine.
        background_jobs: CPU-bound processes run beside it (a machine with another job running).
    """

    benchmark: str
    name: str = "default"
    summary: str = ""
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] | None = ("--quick",)
    needs: tuple[str, ...] = ()
    module: str = ""
    minutes: float = 0.0
    background_jobs: int = 0
    extra_stems: tuple[str, ...] = field(default=(), repr=False)

    @property
    def key(self) -> str:
        """``benchmark`` or ``benchmark:name``: what ``python -m benchmarks`` takes."""
        return self.benchmark if self.name == "default" else f"{self.benchmark}:{self.name}"

    @property
    def stem(self) -> str:
        """The results files' stem."""
        return self.benchmark if self.name == "default" else f"{self.benchmark}_{self.name}"

    @property
    def module_name(self) -> str:
        """The module ``python -m`` runs (a dotted ``module`` is taken as it is)."""
        module = self.module or self.benchmark
        return module if "." in module else f"benchmarks.{module}"


def missing(config: Configuration) -> list[str]:
    """What this machine lacks for ``config`` (empty: it can run here)."""
    return [need for need in config.needs if not _has(need)]


def _has(need: str) -> bool:
    if need == ROOT:
        return os.geteuid() == 0
    if need == GPU:
        import torch

        return torch.cuda.is_available()
    kind, _, what = need.partition(":")
    if kind == "data":
        return (SHARED_DATA / what).is_dir()
    if kind == "pkg":
        return importlib.util.find_spec(what) is not None
    raise ValueError(f"unknown need {need!r} (root, gpu, data:<folder>, pkg:<module>)")


def find(key: str) -> Configuration:
    """The configuration named ``benchmark`` or ``benchmark:name``."""
    for config in CONFIGURATIONS:
        if config.key == key:
            return config
    close = sorted(c.key for c in CONFIGURATIONS if c.benchmark == key.partition(":")[0])
    hint = f"; configurations of it: {', '.join(close)}" if close else "; `python -m benchmarks --list` names them"
    raise KeyError(f"no benchmark configuration {key!r}{hint}")


def benchmarks() -> Iterator[Configuration]:
    """The first configuration of every benchmark (the one ``make bench`` smoke-runs)."""
    seen: set[str] = set()
    for config in CONFIGURATIONS:
        if config.benchmark not in seen:
            seen.add(config.benchmark)
            yield config


_SDP_SWEEP = ("--bandwidths", "50", "100", "200", "1000", "10000", "--timing-steps", "16", "--rounds", "2")
_SDP_METHODS = ("ddp", "sdp4bit_auto", "sdp4bit_none_none", "sdp4bit_qwd_tlq_hs", "sdp4bit_qwd_tlq_hs_autobucket")
_SDP_FIXED = ("sdp4bit_none_none", "sdp4bit_qwd_tlq_hs", "sdp4bit_qwd_none", "sdp4bit_qwd_tlq_hs_g8")
_SDP_LOADED = ("ddp", "sdp4bit_auto", "sdp4bit_none_none", "sdp4bit_qwd_tlq_hs")
_GPT_3X320 = ("--n-layer", "3", "--n-embd", "320")
_SDP_10G = ("--bandwidths", "10000", "--rounds", "4", "--steps", "24", "--timing-steps", "24")
_PEERS = ("ddp", "ddp_fp16", "powersgd_r1", "powersgd_r4", "zero_ddp", "fsdp2", "sdp4bit_auto", "sdp4bit_none_none")
_SDP_FORMATS = ("sdp4bit_qwd_tlq_hs", "sdp4bit_qwd_none", "sdp4bit_none_tlq_hs", "sdp4bit_qwd_tlq_hs_g8")
_SUITE = "suite_sparse_skewed,suite_mid_flat,suite_popularity_only,suite_long_histories,suite_dense,suite_very_dense"
_ASIDE = "suite_aside,suite_aside2,suite_aside3"
_HEAT_RECIPE = ("--methods", "heat_budget", "--budgets", "60,180", "--configs", "3", "--trial-seconds", "8")
_HEAT_ALS = ("--methods", "als,heat_budget", "--budgets", "60,180", "--configs", "24", "--trial-seconds", "4")

_SDP_FAST_LINKS = (
    *("--bandwidths", "1000", "10000", "--rounds", "3", "--timing-steps", "24"),
    *("--methods", "ddp", "sdp4bit_auto", "sdp4bit_auto_shard", *_GPT_3X320),
)

CONFIGURATIONS: tuple[Configuration, ...] = (
    # SDP4Bit
    Configuration(
        "sdp4bit_throughput",
        "default",
        "step time, wire bytes and loss over 50 Mbit/s-10 Gbit/s, every peer",
        ("--bandwidths", "50", "100", "200", "10000", "--methods", *_PEERS, *_SDP_FORMATS, "sdp4bit_none_tlq_hs_g8"),
        needs=(ROOT, SHAKESPEARE),
        minutes=20,
    ),
    Configuration(
        "sdp4bit_throughput",
        "sweep",
        "defaults and fixed formats over 50 Mbit/s-10 Gbit/s, two alternating rounds, both limit columns",
        (*_SDP_SWEEP, "--methods", "ddp", "sdp4bit_auto", "sdp4bit_auto_shard", *_SDP_FIXED),
        needs=(ROOT, SHAKESPEARE),
        minutes=25,
    ),
    Configuration(
        "sdp4bit_throughput",
        "sweep_3x320",
        "the same sweep on a GPT of 3 layers x 320",
        (*_SDP_SWEEP, "--methods", "ddp", "sdp4bit_auto", "sdp4bit_auto_shard", *_SDP_FIXED, *_GPT_3X320),
        needs=(ROOT, SHAKESPEARE),
        minutes=25,
    ),
    Configuration(
        "sdp4bit_throughput",
        "sweep_loaded",
        "the sweep with another job running (one busy process)",
        (*_SDP_SWEEP, "--methods", *_SDP_LOADED),
        needs=(ROOT, SHAKESPEARE),
        minutes=15,
        background_jobs=1,
    ),
    Configuration(
        "sdp4bit_throughput",
        "sweep_3x320_loaded",
        "the 3 x 320 sweep with another job running (one busy process)",
        (*_SDP_SWEEP, "--methods", *_SDP_LOADED, *_GPT_3X320),
        needs=(ROOT, SHAKESPEARE),
        minutes=15,
        background_jobs=1,
    ),
    Configuration(
        "sdp4bit_memory",
        "default",
        "peak memory per rank of DDP, ZeRO + DDP, FSDP2 and SDP4Bit at 2 and 4 processes, two GPT sizes",
        minutes=9,
    ),
    Configuration(
        "sdp4bit_throughput",
        "p2p",
        "the strategy's settings over 50 Mbit/s-10 Gbit/s, two alternating rounds",
        (*_SDP_SWEEP, "--methods", *_SDP_METHODS, "sdp4bit_auto_autobucket"),
        needs=(ROOT, SHAKESPEARE),
        minutes=17,
    ),
    Configuration(
        "sdp4bit_throughput",
        "3x320_p2p",
        "the same sweep on a GPT of 3 layers x 320",
        (*_SDP_SWEEP, "--methods", *_SDP_METHODS, "--n-layer", "3", "--n-embd", "320"),
        needs=(ROOT, SHAKESPEARE),
        minutes=16,
    ),
    Configuration(
        "sdp4bit_throughput",
        "auto_fast_links",
        "the defaults against DDP on fast links (1 and 10 Gbit/s), GPT 3 x 320, three alternating rounds",
        _SDP_FAST_LINKS,
        needs=(ROOT, SHAKESPEARE),
        minutes=6,
    ),
    Configuration(
        "sdp4bit_throughput",
        "auto_fast_links_loaded",
        "the same with another job running (one busy process)",
        _SDP_FAST_LINKS,
        needs=(ROOT, SHAKESPEARE),
        minutes=8,
        background_jobs=1,
    ),
    Configuration(
        "sdp4bit_throughput",
        "cpu_10g",
        "CPU per step at 10 Gbit/s, 4 alternating rounds",
        (*_SDP_10G, "--methods", "ddp", "sdp4bit_none_none", "sdp4bit_qwd_tlq_hs"),
        needs=(ROOT, SHAKESPEARE),
        minutes=2,
    ),
    Configuration(
        "sdp4bit_convergence",
        "default",
        "validation loss and bytes of every weight x gradient compression",
        needs=(SHAKESPEARE,),
        minutes=40,
    ),
    Configuration(
        "sdp4bit_exchange_cost",
        "default",
        "CPU of the exchange alone at 1/4/16 buckets against DDP's all-reduce",
        minutes=1,
    ),
    Configuration(
        "sdp4bit_single_process",
        "default",
        "one process with strategy='sdp4bit' against the default strategy",
        needs=(SHAKESPEARE,),
        minutes=10,
    ),
    Configuration("sdp4bit_zero_blocks", "default", "never-used embedding rows under TLq-HS", minutes=1),
    Configuration(
        "sdp4bit_kernels",
        "default",
        "Triton codec kernels: equality with the torch reference, bandwidth",
        needs=(GPU,),
        minutes=2,
    ),
    Configuration(
        "sdp4bit_kernels",
        "cpu",
        "numba codec kernels on one core: equality, bandwidth",
        ("--backend", "numba", "--threads", "1"),
        ("--quick", "--backend", "numba", "--threads", "1"),
        minutes=1,
    ),
    # FastCLIP
    Configuration(
        "fastclip_batch_gap",
        "default",
        "OpenCLIP at batch 512 and 32, FastCLIP-v3 and SigLIP at 32: the large-batch gap and the share v3 closes",
        minutes=60,
    ),
    Configuration(
        "fastclip_small_batch_10k",
        "default",
        "zero-shot and retrieval at batch 16/32/64, 10,240 pairs, 3 seeds",
        minutes=10,
    ),
    Configuration(
        "fastclip_small_batch", "default", "the shapes set at batch 16-128; the two reductions' cost", minutes=90
    ),
    Configuration("fastclip_u_diagnostic", "default", "why the estimators u miss the full-data g", minutes=120),
    Configuration("fastclip_many_visits", "default", "512 pairs visited 30 times each", minutes=120),
    # SOLAR
    Configuration(
        "solar_vs_loaders",
        "default",
        "PtychoNN through Trainer from a throttled device, 1/2/4 processes, peers",
        needs=(ROOT, "pkg:litdata", "pkg:webdataset"),
        minutes=60,
    ),
    Configuration(
        "solar_vs_loaders",
        "1gib_cn25",
        "the same on 1 GiB, buffer 25%, 4 processes",
        ("--samples", "22000", "--ranks", "4", "--epochs", "2", "--timeout", "1200"),
        needs=(ROOT, "pkg:litdata", "pkg:webdataset"),
        minutes=60,
    ),
    Configuration("solar_loading", "default", "loading alone, 1/2/4 simulated ranks, in-process throttle", minutes=15),
    Configuration(
        "solar_loading",
        "device",
        "loading alone on a throttled loop device, as a fraction of the device's bound",
        ("--storage", "device", "--modes", "baseline", "solar", "solar_auto"),
        quick_args=("--quick", "--storage", "device", "--modes", "baseline", "solar", "solar_auto"),
        needs=(ROOT,),
        minutes=20,
    ),
    *(
        Configuration(
            "solar_time_to_loss",
            f"{ranks}proc",
            f"time to a target validation loss on a 1 GiB scan in acquisition order, {ranks} process(es), peers",
            ("--ranks", str(ranks)),
            quick_args=("--quick", "--ranks", str(ranks)),
            needs=(ROOT, "pkg:litdata", "pkg:webdataset"),
            minutes=120,
        )
        for ranks in (1, 2, 4)
    ),
    # HEAT
    Configuration(
        "heat_vs_peers",
        "default",
        "test Recall@20 against training time, every peer tuned on validation (Gowalla)",
        needs=(GOWALLA, "pkg:implicit"),
        minutes=240,
    ),
    Configuration(
        "heat_suite",
        "auto",
        "the recipe against validation-tuned ALS at 60 s and 3 min: Gowalla, Last.fm, development catalogues",
        ("--dataset", f"gowalla,lastfm,{_SUITE}", *_HEAT_ALS),
        needs=(GOWALLA, LASTFM, "pkg:implicit"),
        module="heat_vs_peers",
        minutes=100,
    ),
    Configuration(
        "heat_suite",
        "clocked",
        "the recipe with timed trials on the clock, development catalogues + suite_aside",
        (
            "--dataset",
            f"{_SUITE},suite_aside",
            *_HEAT_RECIPE,
        ),
        needs=("pkg:implicit",),
        module="heat_vs_peers",
        minutes=60,
    ),
    Configuration(
        "heat_suite",
        "anchor64",
        "the recipe with HEAT's own configuration as anchor",
        (
            "--dataset",
            f"suite_mid_flat,suite_popularity_only,suite_long_histories,suite_dense,suite_very_dense,{_ASIDE}",
            *_HEAT_RECIPE,
        ),
        needs=("pkg:implicit",),
        module="heat_vs_peers",
        minutes=60,
    ),
    Configuration(
        "heat_suite",
        "aside4",
        "held-out catalogue suite_aside4, scored once",
        ("--dataset", "suite_aside4", *_HEAT_ALS),
        needs=("pkg:implicit",),
        module="heat_vs_peers",
        minutes=20,
    ),
    Configuration(
        "heat_suite",
        "aside5",
        "held-out catalogue suite_aside5, scored once",
        ("--dataset", "suite_aside5", *_HEAT_ALS),
        needs=("pkg:implicit",),
        module="heat_vs_peers",
        minutes=20,
    ),
    Configuration(
        "heat_suite",
        "asides",
        "the development catalogues suite_aside, suite_aside2 and suite_aside3 at 60 s, ALS tuned the same way",
        (
            "--dataset",
            _ASIDE,
            "--methods",
            "als,heat_budget",
            "--budgets",
            "60",
            "--configs",
            "24",
            "--trial-seconds",
            "4",
        ),
        needs=("pkg:implicit",),
        module="heat_vs_peers",
        minutes=15,
    ),
    Configuration(
        "heat_suite",
        "aside6",
        "held-out catalogue suite_aside6 (never used to choose anything), scored once",
        ("--dataset", "suite_aside6", *_HEAT_ALS),
        needs=("pkg:implicit",),
        module="heat_vs_peers",
        minutes=12,
    ),
    Configuration(
        "heat_recipe_candidates",
        "default",
        "validation Recall@20 of the recipe's candidates (SVD warm start, temperature) at fixed epochs",
        needs=(GOWALLA, LASTFM),
        minutes=30,
    ),
    Configuration(
        "heat_artifact",
        "default",
        "positives/s and Recall@20 at equal epochs against HEAT's own C++ code, built at run time (Gowalla)",
        needs=(GOWALLA,),
        minutes=6,
    ),
    Configuration(
        "heat_artifact",
        "sample",
        "the same against HEAT's code, ours with its own rules (each sample's gradient clipped, history rows trained)",
        ("--clip-mode", "sample"),
        needs=(GOWALLA,),
        minutes=6,
    ),
    Configuration(
        "heat_first_run",
        "default",
        "a fresh install's first max_time=30 s fit (empty kernel cache) against the same fit with the cache warm",
        needs=(LASTFM,),
        minutes=10,
    ),
    Configuration(
        "heat_throughput",
        "default",
        "positives/s of the fused kernel against plain PyTorch; the tile sampler's speed and quality over 80 epochs",
        ("--sampler-epochs", "80"),
        needs=(GOWALLA,),
        minutes=8,
    ),
    Configuration(
        "heat_trainer_overhead",
        "default",
        "what a Lightning fit adds to the fused kernel",
        needs=(GOWALLA,),
        minutes=10,
    ),
    Configuration(
        "heat_softmax_loss",
        "default",
        "HEAT's softmax loss with and without clipping against CCL",
        needs=(GOWALLA,),
        minutes=60,
    ),
    Configuration("heat_fused_gap", "default", "fused kernel on 1 and 2 threads against the plain backend", minutes=30),
    Configuration("heat_temperature", "default", "the softmax loss at fixed and annealed temperatures", minutes=60),
    Configuration(
        "heat_attention_throughput", "default", "positives/s of the attention aggregators", needs=(GOWALLA,), minutes=10
    ),
    Configuration(
        "heat_gowalla_quality",
        "default",
        "Recall/NDCG of fixed settings over epochs (Gowalla)",
        needs=(GOWALLA,),
        minutes=120,
    ),
    Configuration(
        "heat_gowalla_tuning", "default", "optimiser settings on validation (Gowalla)", needs=(GOWALLA,), minutes=120
    ),
    Configuration("heat_refit", "default", "what folding validation back in is worth", needs=(GOWALLA,), minutes=30),
    Configuration("heat_budget_curves", "default", "the recipe's learning curves", minutes=20),
    # EngineProfiler
    Configuration(
        "engine_sequence_sweep", "default", "matrix/vector/memory shares of a GPT step, 64-2,048 tokens", minutes=2
    ),
    Configuration("engine_overhead", "default", "step time inside and outside the profiler's window, peers", minutes=5),
    Configuration(
        "engine_flops_peers",
        "default",
        "FLOPs against fvcore, ptflops and DeepSpeed",
        needs=("pkg:fvcore", "pkg:ptflops", "pkg:deepspeed"),
        minutes=10,
    ),
    Configuration(
        "engine_stability", "default", "measured engine ceilings and the spread of the matrix share", minutes=10
    ),
    # The model the strategy benchmarks train, and the GPU checks
    Configuration(
        "gpt_char_cpu",
        "default",
        "the GPT's validation loss and tokens/s on tiny Shakespeare",
        needs=(SHAKESPEARE,),
        minutes=30,
    ),
    Configuration(
        "gpu_checks",
        "default",
        "GPU-only checks: Triton kernels, SDP4Bit over NCCL, engine ceilings, FastCLIP",
        needs=(GPU,),
        quick_args=None,
        minutes=8,
        extra_stems=("gpu_engine_peaks", "gpu_engine_sweep"),
    ),
)
