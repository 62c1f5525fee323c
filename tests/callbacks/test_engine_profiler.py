"""EngineProfiler in real Lightning runs on the CPU (tiny GPT)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_sdp.callbacks import EngineProfiler
from lightning_sdp.models.gpt import GPT
from lightning_sdp.profiling.categories import CATEGORIES
from lightning_sdp.profiling.results import EngineReport, ModelDims

V, T, B = 37, 16, 2
N_LAYER, D, H = 1, 32, 2


@pytest.fixture(scope="module", autouse=True)
def _device_profile_cache(tmp_path_factory):
    """A private device-profile cache, filled once with a tiny measurement (keeps tests fast and $HOME clean)."""
    import lightning_sdp.profiling.engine_bench as eb

    cache = tmp_path_factory.mktemp("engine_peaks")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LIGHTNING_SDP_CACHE_DIR", str(cache))
        mp.setitem(eb._GEMMS, ("cpu", True), ((64, 64, 64),))
        mp.setitem(eb._VECTOR_SIZES, ("cpu", True), (1 << 12,))
        mp.setitem(eb._MIN_TIME_S, True, 1e-4)
        mp.setitem(eb._REPEATS, True, 1)
        yield cache


def _model(attention: str = "explicit") -> GPT:
    return GPT(vocab_size=V, n_layer=N_LAYER, n_head=H, n_embd=D, block_size=T, attention=attention, warmup_steps=2)


def _loader(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (n, T), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=B)


def _trainer(tmp_path: Path, cb: EngineProfiler | None, max_steps: int, **kw) -> Trainer:
    return Trainer(
        max_steps=max_steps,
        callbacks=[cb] if cb is not None else [],
        default_root_dir=tmp_path,
        logger=kw.pop("logger", False),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        **kw,
    )


def _gpt_step_flops() -> int:
    """Analytic matrix FLOPs of one training step of the tiny explicit-attention GPT (forward x 3)."""
    tokens = B * T
    linear = tokens * N_LAYER * 24 * D * D + tokens * 2 * D * V
    attention = N_LAYER * B * 4 * T * T * D
    return 3 * (linear + attention)


@pytest.mark.slow
def test_fit_writes_reports_metrics_and_exact_flops(tmp_path, capsys):
    cb = EngineProfiler(wait=1, warmup=1, active=2, dirpath=str(tmp_path / "ep"))
    logger = CSVLogger(tmp_path, name="csv")
    _trainer(tmp_path, cb, max_steps=5, logger=logger, log_every_n_steps=1).fit(_model(), _loader())
    assert len(cb.reports) == 1
    r = cb.reports[0]
    assert r.steps == 2 and r.start_batch == 2
    assert sum(r.fractions.values()) == pytest.approx(1.0)
    # The categories add up to the measured step time.
    assert sum(r.categories_s.values()) == pytest.approx(r.step_time_s, rel=1e-6)
    assert r.flops.matrix_flops == _gpt_step_flops()
    assert r.throughput["matrix_tflops"] > 0
    assert r.model == ModelDims(d_model=D, n_heads=H, attention="explicit", seq_len=T)
    assert {"attention", "mlp", "norm", "embedding", "loss", "optimizer"} <= set(r.modules)
    assert r.fractions["matrix"] > 0 and r.fractions["vector"] > 0
    # Files: per-rank JSON + gzip trace, merged summary and PNG from rank 0.
    ep = tmp_path / "ep"
    written = json.loads((ep / "engine_profile-rank0.json").read_text())
    assert written == [r.to_dict()] and written[0]["cycle"] == 0
    assert EngineReport.from_dict(written[0]) == r
    trace = ep / "engine_profile-rank0-window0.pt.trace.json.gz"
    import gzip

    with gzip.open(trace, "rt") as f:  # a Chrome/Perfetto trace that tools can open, with the model's operators
        events = json.load(f)["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)
    assert not list(ep.glob(".*.json")), "the uncompressed temporary trace is removed"
    assert json.loads((ep / "engine_profile-summary.json").read_text())["ranks"] == [0]
    assert (ep / "engine_profile.png").stat().st_size > 0
    assert "EngineProfiler: rank 0/1" in capsys.readouterr().out
    # Metrics reached the Trainer's logger.
    header = next(Path(logger.log_dir).glob("metrics.csv")).read_text().splitlines()[0]
    for key in (
        "engine/matrix_frac",
        "engine/vector_frac",
        "engine/matrix_tflops",
        "engine/module_attention_frac",
    ):
        assert key in header


def test_fused_attention_is_counted_and_attributed(tmp_path):
    cb = EngineProfiler(wait=0, warmup=1, active=1, export_trace=False, save_plot=False)
    _trainer(tmp_path, cb, max_steps=2).fit(_model("sdpa"), _loader())
    # Default folder: <default_root_dir>/engine_profiler.
    assert (tmp_path / "engine_profiler" / "engine_profile-rank0.json").is_file()
    r = cb.reports[0]
    assert r.flops.attention_flops > 0
    assert r.fractions["attention_fused"] > 0
    assert r.modules["attention"].by_category_s.get("attention_fused", 0) > 0
    assert not list(tmp_path.rglob("*.pt.trace.json.gz"))


class _Counting:
    """Wraps a class and counts instantiations."""

    def __init__(self, cls):
        self.cls = cls
        self.calls = 0

    def __call__(self, *a, **k):
        self.calls += 1
        return self.cls(*a, **k)


def _patch_counters(monkeypatch):
    import torch.profiler

    import lightning_sdp.profiling.flops as flops

    prof = _Counting(torch.profiler.profile)
    work = _Counting(flops.WorkCounter)
    monkeypatch.setattr(torch.profiler, "profile", prof)
    monkeypatch.setattr(flops, "WorkCounter", work)
    hooks = {"n": 0}
    orig = torch.nn.Module.register_forward_pre_hook

    def counting_hook(self, *a, **k):
        hooks["n"] += 1
        return orig(self, *a, **k)

    monkeypatch.setattr(torch.nn.Module, "register_forward_pre_hook", counting_hook)
    return prof, work, hooks


def test_no_work_outside_the_window(tmp_path, monkeypatch):
    prof, work, hooks = _patch_counters(monkeypatch)
    cb = EngineProfiler(wait=100, warmup=1, active=1, dirpath=str(tmp_path))
    with pytest.warns(UserWarning, match="window needs"):
        _trainer(tmp_path, cb, max_steps=4).fit(_model(), _loader())
    assert prof.calls == 0 and work.calls == 0 and hooks["n"] == 0
    assert cb.reports == []
    assert cb.state_dict() == {"batches_seen": 4, "cycles_done": 0}


def test_repeat_runs_exactly_the_scheduled_windows(tmp_path, monkeypatch):
    prof, work, hooks = _patch_counters(monkeypatch)
    cb = EngineProfiler(wait=1, warmup=1, active=1, repeat=2, dirpath=str(tmp_path), save_plot=False)
    model = _model()
    _trainer(tmp_path, cb, max_steps=9).fit(model, _loader())
    assert prof.calls == 2 and work.calls == 2
    # Module scopes are added for each active window and removed afterwards.
    assert hooks["n"] == 2 * (len(list(model.modules())) - 1)
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert [r.start_batch for r in cb.reports] == [2, 5]


def test_skip_first_starts_the_windows_later(tmp_path, monkeypatch):
    prof, work, hooks = _patch_counters(monkeypatch)
    cb = EngineProfiler(skip_first=4, wait=1, warmup=1, active=1, repeat=2, dirpath=str(tmp_path), save_plot=False)
    _trainer(tmp_path, cb, max_steps=11).fit(_model(), _loader())
    assert prof.calls == 2 and work.calls == 2
    assert [r.start_batch for r in cb.reports] == [6, 9]
    auto = EngineProfiler(skip_first=7, wait=1, warmup=1, active=1, dirpath=str(tmp_path / "auto"), save_plot=False)
    _trainer(tmp_path, auto, max_steps=13).fit(_model(), _loader())  # (13 - 7) // 3: two windows fit after the skip
    assert [r.start_batch for r in auto.reports] == [9, 12]


def test_peak_memory_per_step_beside_the_shares(tmp_path, capsys):
    from lightning_sdp.profiling.report import metrics, summary_table

    cb = EngineProfiler(wait=0, warmup=1, active=3, repeat=1, dirpath=str(tmp_path), save_plot=False)
    _trainer(tmp_path, cb, max_steps=4).fit(_model(), _loader())
    memory = cb.reports[0].memory
    assert memory is not None and memory.source == "cpu" and len(memory.peak_bytes) == 3
    assert all(b > 10 * 2**20 for b in memory.peak_bytes)  # a process's resident set: tens of MiB at least
    assert metrics(cb.reports[0])["engine/peak_memory_mb"] == pytest.approx(max(memory.peak_bytes) / 2**20)
    assert (
        "peak memory per step:" in summary_table(cb.reports[0]) and "peak memory per step:" in capsys.readouterr().out
    )
    saved = json.loads((tmp_path / "engine_profile-rank0.json").read_text())[0]
    assert EngineReport.from_dict(saved).memory == memory


def test_a_trace_over_the_bound_is_not_kept(tmp_path):
    cb = EngineProfiler(wait=0, warmup=1, active=1, repeat=1, dirpath=str(tmp_path), save_plot=False, max_trace_mb=1e-4)
    with pytest.warns(UserWarning, match=r"could not write the trace of window 0 .* over the bound of 0.0 MiB"):
        _trainer(tmp_path, cb, max_steps=2).fit(_model(), _loader())
    assert cb.reports[0].trace_file is None and cb.reports[0].steps == 1
    assert not list(tmp_path.glob("*.gz")) and not list(tmp_path.glob(".*"))


def test_pytorch_profiler_present_warns_and_stays_off(tmp_path):
    from lightning.pytorch.profilers import PyTorchProfiler

    cb = EngineProfiler(wait=0, warmup=0, active=1, count_flops=False, dirpath=str(tmp_path))
    trainer = _trainer(tmp_path, cb, max_steps=2, profiler=PyTorchProfiler(dirpath=str(tmp_path), filename="pt"))
    with pytest.warns(UserWarning, match="already runs a PyTorchProfiler"):
        trainer.fit(_model(), _loader())
    assert cb.reports == []


class _Boom(GPT):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise RuntimeError("boom in step 2")
        return super().training_step(batch, batch_idx)


def test_exception_stops_cleanly_and_keeps_trace(tmp_path):
    cb = EngineProfiler(wait=0, warmup=1, active=3, dirpath=str(tmp_path))
    model = _Boom(vocab_size=V, n_layer=N_LAYER, n_head=H, n_embd=D, block_size=T, attention="explicit")
    with pytest.raises(RuntimeError, match="boom in step 2"):
        _trainer(tmp_path, cb, max_steps=6).fit(model, _loader())
    assert not torch._C._autograd._profiler_enabled()
    assert (tmp_path / "engine_profile-rank0-window0.pt.trace.json.gz").exists()
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_run_ending_inside_the_window_reports_partial(tmp_path):
    cb = EngineProfiler(wait=0, warmup=1, active=5, dirpath=str(tmp_path), save_plot=False)
    with pytest.warns(UserWarning, match="ended inside the profiling window"):
        _trainer(tmp_path, cb, max_steps=3).fit(_model(), _loader())
    assert cb.reports[0].steps == 2


def test_checkpoint_resume_keeps_the_schedule(tmp_path):
    ckpt = tmp_path / "mid.ckpt"
    cb1 = EngineProfiler(wait=3, warmup=1, active=1, dirpath=str(tmp_path / "a"), save_plot=False)
    t1 = _trainer(tmp_path, cb1, max_steps=2)
    t1.fit(_model(), _loader())
    t1.save_checkpoint(ckpt)
    cb2 = EngineProfiler(wait=3, warmup=1, active=1, dirpath=str(tmp_path / "b"), save_plot=False)
    _trainer(tmp_path, cb2, max_steps=6).fit(_model(), _loader(), ckpt_path=str(ckpt))
    uninterrupted = EngineProfiler(wait=3, warmup=1, active=1, dirpath=str(tmp_path / "c"), save_plot=False)
    _trainer(tmp_path, uninterrupted, max_steps=6).fit(_model(), _loader())
    assert [r.start_batch for r in cb2.reports] == [r.start_batch for r in uninterrupted.reports] == [4]
    assert cb2.state_dict() == uninterrupted.state_dict() == {"batches_seen": 6, "cycles_done": 1}
    with pytest.raises(KeyError, match="batches_seen"):
        cb2.load_state_dict({"cycles_done": 1})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"active": 0}, "active must be an integer >= 1"),
        ({"wait": -1}, "wait must be"),
        ({"repeat": 1.5}, "repeat must be"),
        ({"filename": "a/b"}, "plain file stem"),
        ({"softmax_k": 0}, "softmax_k"),
        ({"peaks": {"matrix": 1.0}}, "unknown peak"),
        ({"skip_first": -1}, "skip_first must be"),
        ({"max_trace_mb": 0}, "max_trace_mb must be positive"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineProfiler(**kwargs)


def test_categories_constant_is_the_public_contract():
    assert CATEGORIES == ("matrix", "attention_fused", "vector", "memory", "communication", "host_other")


@pytest.mark.slow
def test_shipped_yaml_parses_and_runs(tmp_path):
    from lightning_sdp.cli import main

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "gpt_engine_profiler.yaml"
    main(
        [
            "fit",
            "--config",
            str(config),
            "--trainer.max_steps=3",
            "--trainer.accelerator=cpu",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.callbacks.init_args.wait=0",
            "--trainer.callbacks.init_args.active=2",
            f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ep'}",
            "--model.init_args.n_layer=1",
            "--model.init_args.n_embd=32",
            "--model.init_args.block_size=16",
            "--data.init_args.block_size=16",
            "--data.init_args.batch_size=2",
        ]
    )
    report = EngineReport.from_dict(json.loads((tmp_path / "ep" / "engine_profile-rank0.json").read_text())[0])
    assert report.steps == 2 and report.model.attention == "explicit"
    assert (tmp_path / "ep" / "engine_profile.png").is_file()


class _FakeGaudiProfiler(EngineProfiler):
    """Runs on the CPU but takes the HPU branch (device type 'hpu'), to test the Gaudi wiring without a Gaudi."""

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        self._device_type = "hpu"


def test_hpu_branch_uses_the_engine_trace(tmp_path, monkeypatch):
    import lightning_sdp.profiling.hpu_trace as hpu_trace

    data = Path(__file__).resolve().parents[1] / "data" / "hpu_traces" / "gaudi_small.json"
    seen = []
    real = hpu_trace.analyze_trace

    def fake_analyze(path, window=None):
        seen.append(Path(path).name)  # the callback exported its own trace and asked for it to be analysed
        return real(data)

    monkeypatch.setattr(hpu_trace, "analyze_trace", fake_analyze)
    cb = _FakeGaudiProfiler(wait=0, warmup=1, active=1, dirpath=str(tmp_path), save_plot=False)
    _trainer(tmp_path, cb, max_steps=2).fit(_model(), _loader())
    r = cb.reports[0]
    assert seen == ["engine_profile-rank0-window0.pt.trace.json.gz"]
    assert r.hpu.states_us["both"] == pytest.approx(10)
    assert r.fractions["matrix"] == pytest.approx(0.40)  # MME busy: both + MME-only
    assert r.fractions["vector"] == pytest.approx(0.25)  # TPC only
    assert r.device.type == "hpu"
    checks = {f.check for f in r.findings}
    # fp32 on a Gaudi, and (here) every op on CPU tensors = host fallback. The 5 % GEMM on TPC is at the threshold.
    assert {"low_precision_off", "host_fallback"} <= checks
    assert r.hpu.matrix_on_tpc_us == pytest.approx(5)
    assert "matrix_off_engine" not in checks


@pytest.mark.cuda
def test_cuda_bf16_run_reports_tensor_cores(tmp_path):
    cb = EngineProfiler(wait=1, warmup=1, active=2, dirpath=str(tmp_path), save_plot=False)
    model = GPT(vocab_size=V, n_layer=2, n_head=4, n_embd=256, block_size=128, attention="sdpa")
    x = torch.randint(0, V, (64, 128))
    loader = DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=8)
    Trainer(
        accelerator="cuda",
        devices=1,
        precision="bf16-mixed",
        max_steps=5,
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    ).fit(model, loader)
    r = cb.reports[0]
    assert r.device.matrix_dtype == "bf16"
    assert r.cuda.matrix_kernel_us > 0
    assert r.cuda.tensor_core_frac > 0.5
    assert r.utilisation["matrix"] is None or 0 < r.utilisation["matrix"] < 1.5
    assert sum(r.fractions.values()) == pytest.approx(1.0)


# -------------------------------------------------------------------------------- output folder checks


class _CountingGPT(GPT):
    steps = 0

    def training_step(self, batch, batch_idx):
        type(self).steps += 1
        return super().training_step(batch, batch_idx)


def test_unwritable_dirpath_fails_at_setup(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    cb = EngineProfiler(wait=0, warmup=1, active=1, dirpath=str(blocker / "ep"))
    model = _CountingGPT(vocab_size=V, n_layer=N_LAYER, n_head=H, n_embd=D, block_size=T, attention="explicit")
    _CountingGPT.steps = 0
    with pytest.raises(OSError, match="EngineProfiler: cannot write to dirpath .*a_file/ep.*Pass `dirpath=`"):
        _trainer(tmp_path, cb, max_steps=4).fit(model, _loader())
    assert _CountingGPT.steps == 0  # raised at setup, before any training


def test_several_windows_by_default_with_median_and_spread(tmp_path, capsys):
    import statistics

    cb = EngineProfiler(wait=0, warmup=1, active=1, dirpath=str(tmp_path), save_plot=False, measure_peaks=False)
    _trainer(tmp_path, cb, max_steps=8).fit(_model(), _loader())
    # Four 2-batch cycles fit in 8 batches: four windows without being asked for them.
    assert [r.start_batch for r in cb.reports] == [1, 3, 5, 7]
    combined = cb.merged.per_rank[0]
    assert combined.windows == 4
    for c in CATEGORIES:
        shares = [r.fractions[c] for r in cb.reports]
        assert combined.fractions[c] == pytest.approx(statistics.median(shares))
        assert combined.spread[c] == pytest.approx(max(shares) - min(shares))
    assert "median of 4 windows" in capsys.readouterr().out


def test_short_run_profiles_the_windows_it_holds(tmp_path, recwarn):
    cb = EngineProfiler(wait=0, warmup=1, active=1, dirpath=str(tmp_path), save_plot=False, measure_peaks=False)
    _trainer(tmp_path, cb, max_steps=3).fit(_model(), _loader())
    assert len(cb.reports) == 1
    assert not [w for w in recwarn if "ended inside" in str(w.message)]  # no partial second window


class _TinyCNN(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.head = torch.nn.Linear(4 * 8 * 8, 5)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.head(self.conv(x).relu().flatten(1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_sequence_length_only_for_sequence_inputs(tmp_path, capsys):
    from lightning_sdp.callbacks.engine_profiler.callback import _sequence_length

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 5, (16,), generator=g))
    images = DataLoader(data, batch_size=4)
    cb = EngineProfiler(wait=0, warmup=1, active=1, dirpath=str(tmp_path), save_plot=False, measure_peaks=False)
    _trainer(tmp_path, cb, max_steps=2).fit(_TinyCNN(), images)
    assert cb.reports[0].model.seq_len is None
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("EngineProfiler: rank"))
    assert "seq" not in header  # was "seq 3" (the channel count)
    assert _sequence_length((torch.zeros(2, 7, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long))) == 7
    assert _sequence_length({"x": torch.randn(2, 9, 16)}) == 9  # (B, T, C) embeddings
    assert _sequence_length((torch.randn(2, 3, 8, 8), torch.zeros(2, dtype=torch.long))) is None
    assert _sequence_length((torch.randn(2, 3), torch.zeros(2, dtype=torch.long))) is None


# -------------------------------------------------------------------------------- measured ceilings


@pytest.mark.slow
def test_cpu_utilisation_from_measured_ceilings_and_cached_profile(tmp_path, monkeypatch, capsys):
    cb = EngineProfiler(wait=0, warmup=1, active=1, dirpath=str(tmp_path / "a"), save_plot=True)
    _trainer(tmp_path, cb, max_steps=2).fit(_model(), _loader())
    r = cb.reports[0]
    assert r.peak_sources == {
        "matrix_tflops": "measured",
        "vector_tflops": "measured",
        "mem_gbps": "measured",
    }
    assert r.peaks == r.peaks_measured
    for key in ("matrix", "vector_bandwidth", "vector_compute"):
        assert r.utilisation[key] > 0
    assert r.device.profile["num_threads"] == torch.get_num_threads()
    out = capsys.readouterr().out
    assert "util n/a" not in out and "of measured" in out
    assert (tmp_path / "a" / "engine_profile-roofline.png").stat().st_size > 0
    # The second run reads the cached profile: measuring again would fail here.
    import lightning_sdp.profiling.engine_bench as eb

    monkeypatch.setattr(eb, "measure_engine_peaks", lambda *a, **k: pytest.fail("measured again"))
    cb2 = EngineProfiler(wait=0, warmup=1, active=1, dirpath=str(tmp_path / "b"), save_plot=False)
    _trainer(tmp_path, cb2, max_steps=2).fit(_model(), _loader())
    assert cb2.reports[0].peaks_measured == r.peaks_measured


_KINETO_SCRIPT = """
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset
from lightning_sdp.callbacks import EngineProfiler
from lightning_sdp.models.gpt import GPT

x = torch.randint(0, 11, (8, 8))
cb = EngineProfiler(wait=0, warmup=0, active=1, count_flops=False, measure_peaks=False, export_trace=False,
                    save_plot=False, print_summary=False, dirpath={out!r})
Trainer(max_steps=1, callbacks=[cb], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu").fit(
    GPT(vocab_size=11, n_layer=1, n_head=2, n_embd=8, block_size=8), DataLoader(TensorDataset(x, x), batch_size=4))
assert len(cb.reports) == 1
"""


@pytest.mark.slow
def test_no_kineto_gpu_error_on_cpu_machines(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    proc = subprocess.run(
        [sys.executable, "-c", _KINETO_SCRIPT.format(out=str(tmp_path))],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "gpuGetDeviceCount" not in proc.stderr
