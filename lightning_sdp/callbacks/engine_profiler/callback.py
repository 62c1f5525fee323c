"""EngineProfiler: where a training step's time goes, matrix engine or vector engines.

Working form of the study by Zhang et al., "Benchmarking and In-depth Performance Study of Large Language Models on
Habana Gaudi Processors" (SC-W 2023, arXiv 2309.16976), which compares Gaudi's matrix engine (MME) with its vector
cores (TPC) and finds Transformers held back by non-matrix work such as softmax, worst at long sequences. Add
``callbacks=[EngineProfiler()]`` to any Trainer: for a few steps it splits the step time into ``matrix``,
``attention_fused``, ``vector``, ``memory``, ``communication`` and ``host_other``, per module group, with achieved
TFLOPS against the device's peaks and findings with advice. The analysis lives in :mod:`lightning_sdp.profiling`.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils._pytree import tree_flatten
from typing_extensions import override

from lightning_sdp._files import write_text_atomic
from lightning_sdp.callbacks.engine_profiler.outputs import (
    TraceExportError,
    check_writable,
    closing_message,
    export_trace,
)
from lightning_sdp.profiling.results import DeviceInfo, EngineReport, MergedReport, ModelDims

_MODEL_DIM_KEYS = {
    "d_model": ("n_embd", "d_model", "hidden_size", "embed_dim", "dim"),
    "n_heads": ("n_head", "n_heads", "num_heads", "num_attention_heads"),
    "attention": ("attention", "attn_impl", "attention_impl"),
}
AUTO_WINDOWS = 5
"""Windows profiled by default (``repeat=None``), fewer when the run is shorter."""


class EngineProfiler(Callback):
    """Profile a few training steps and report matrix-engine vs vector-engine time.

    The window follows ``torch.profiler.schedule``: per cycle, ``wait`` batches with no work at all, ``warmup``
    batches (the last one counts FLOPs and vector work under ``FlopCounterMode``, so the timed steps carry no
    counting overhead), then ``active`` batches under ``torch.profiler``; ``repeat`` cycles (0 = until the end).
    By default (``repeat=None``) it profiles as many windows as the run allows, up to :data:`AUTO_WINDOWS`, and
    the summary gives each share as the median over the windows with its spread (one window is a sample, not the
    answer); findings about timing are made only when their effect is larger than that spread. Outside the window
    the hooks only compare integers.

    Utilisation is reported against the datasheet peak where one is known, and against ceilings measured on the
    device itself (:func:`~lightning_sdp.profiling.engine_bench.measure_engine_peaks`, quick mode, cached per
    device, thread count and torch version) where none is (the CPU); where both exist both are shown.

    Backends (from ``trainer.strategy.root_device``): CPU (operator self times), CUDA (kernel device times attributed
    to the launching operators; tensor-core kernels detected by name), HPU (Gaudi: engine lanes of the exported
    trace, overlap states MME-only / TPC-only / both / DMA-only / idle).

    Outputs in ``dirpath``: ``<filename>-rank<R>.json`` (all windows of global rank R),
    ``<filename>-rank<R>-window<C>.pt.trace.json.gz`` (Chrome/Perfetto trace), and from rank 0
    ``<filename>-summary.json`` (merged over ranks) and ``<filename>.png``. JSON files are written atomically; a
    trace is named in the report only once it reads back (a failed export gives a warning naming the file and the
    reason, and leaves no partial file). Metrics ``engine/*`` go to the Trainer's loggers. At the end of training
    (``print_summary=True``) rank 0 prints the summary table and logs once (``rank_zero_info``) where the files are
    and whether the device ceilings were measured in this run or read from the cache, naming the cache file.

    By default only global rank 0 profiles (``all_ranks=True``: every rank, each writing its own files, rank 0 the
    merged summary); the other ranks do nothing at all. Beside the engine shares the report gives the peak memory of
    each profiled step (the CUDA / HPU allocator's peak, or on the CPU the process's peak resident set).

    Args:
        skip_first: batches to skip once before the first cycle (``torch.profiler.schedule``'s ``skip_first``), e.g.
            to profile after the first epoch's start-up. Default 0.
        wait: batches to skip at the start of each cycle. Default 2.
        warmup: batches before the active ones; the last counts FLOPs (needs ``>= 1`` for TFLOPS). Default 1.
        active: profiled batches per cycle. Default 3.
        repeat: number of cycles; 0 repeats until training ends; ``None`` (default): as many as the run holds, up to
            :data:`AUTO_WINDOWS` (at least one is attempted).
        dirpath: output folder; default ``<trainer.log_dir or default_root_dir>/engine_profiler``.
        filename: stem of the output files. Default ``"engine_profile"``.
        export_trace: write the gzip Chrome trace per rank and window. Default True.
        max_trace_mb: largest compressed trace kept per window, in MiB; a larger one is not written (a warning gives
            its size; the report is made all the same). ``None``: no bound. Default 100.
        all_ranks: profile every rank (each writes its own ``-rank<R>`` files); ``False`` (default): global rank 0
            only.
        save_plot: rank 0 writes the PNG at the end. Default True.
        count_flops: count FLOPs and vector work in the last warm-up batch. Default True.
        module_view: open a ``record_function`` scope per module during active batches for the per-module view
            (attention, MLP, norms, embeddings, head, loss, optimizer). Default True.
        peaks: overrides of the device peaks: ``matrix_tflops``, ``vector_tflops``, ``mem_gbps`` (win over the
            datasheet table :data:`lightning_sdp.profiling.peaks.PEAKS` and the measured ceilings).
        measure_peaks: measure the device's matrix and vector ceilings at the start of training (a few seconds,
            once per device: the profile is cached) and use them where no datasheet peak exists. Default True.
        peaks_cache_dir: folder of the device-profile cache; default ``$LIGHTNING_SDP_CACHE_DIR`` or
            ``~/.cache/lightning_sdp/engine_peaks``.
        d_model: model width for the analytic attention model; read from the module's hparams
            (``n_embd``/``d_model``/``hidden_size``) when ``None``.
        n_heads: attention heads, likewise (``n_head``/``n_heads``/``num_heads``).
        softmax_k: element operations per attention score in the analytic model (5-8 unfused). Default 6.
        print_summary: at the end of training, rank 0 prints the summary table and logs where the files went and
            where the device ceilings came from. Default True.
        log_metrics: log ``engine/*`` metrics to the Trainer's loggers. Default True.
    """

    def __init__(
        self,
        skip_first: int = 0,
        wait: int = 2,
        warmup: int = 1,
        active: int = 3,
        repeat: int | None = None,
        dirpath: str | None = None,
        filename: str = "engine_profile",
        export_trace: bool = True,
        max_trace_mb: float | None = 100.0,
        all_ranks: bool = False,
        save_plot: bool = True,
        count_flops: bool = True,
        module_view: bool = True,
        peaks: dict[str, float] | None = None,
        measure_peaks: bool = True,
        peaks_cache_dir: str | None = None,
        d_model: int | None = None,
        n_heads: int | None = None,
        softmax_k: float = 6.0,
        print_summary: bool = True,
        log_metrics: bool = True,
    ) -> None:
        super().__init__()
        for name, value, low in (
            ("skip_first", skip_first, 0),
            ("wait", wait, 0),
            ("warmup", warmup, 0),
            ("active", active, 1),
            ("repeat", 0 if repeat is None else repeat, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"EngineProfiler: {name} must be an integer >= {low}, got {value!r}")
        if not filename or "/" in filename:
            raise ValueError(f"EngineProfiler: filename must be a plain file stem, got {filename!r}")
        if softmax_k <= 0:
            raise ValueError(f"EngineProfiler: softmax_k must be positive, got {softmax_k}")
        if max_trace_mb is not None and not max_trace_mb > 0:
            raise ValueError(f"EngineProfiler: max_trace_mb must be positive or None, got {max_trace_mb!r}")
        from lightning_sdp.profiling.peaks import resolve_peaks

        resolve_peaks(None, "fp32", peaks)  # validates the override keys and values now, not mid-training
        self.skip_first = skip_first
        self.wait = wait
        self.warmup = warmup
        self.active = active
        self.repeat = repeat
        self.dirpath = dirpath
        self.filename = filename
        self.export_trace = export_trace
        self.max_trace_mb = max_trace_mb
        self.all_ranks = all_ranks
        self.save_plot = save_plot
        self.count_flops = count_flops
        self.module_view = module_view
        self.peaks = dict(peaks) if peaks else None
        self.measure_peaks = measure_peaks
        self.peaks_cache_dir = peaks_cache_dir
        self.device_profile: Any = None  # the measured DeviceProfile once known
        self._device_profile_file: str | None = None
        self.d_model = d_model
        self.n_heads = n_heads
        self.softmax_k = softmax_k
        self.print_summary = print_summary
        self.log_metrics = log_metrics
        if count_flops and warmup == 0:
            rank_zero_warn("EngineProfiler: FLOPs are counted in the last warm-up batch; with warmup=0 no TFLOPS.")

        self.reports: list[EngineReport] = []
        self.merged: MergedReport | None = None
        self._batches_seen = 0
        self._cycles_done = 0
        self._disabled = False
        self._device_type = "cpu"
        self._dir: Path | None = None
        self._rank = 0
        self._world_size = 1
        self._repeat = AUTO_WINDOWS if repeat is None else repeat
        self._measured_peaks: dict[str, float | None] | None = None
        self._ceilings_note: str | None = None  # where the machine ceilings came from, for the closing message
        self._files_written: list[Path] = []
        self._traces_written = 0
        self._memory: Any = None  # the PeakMemoryMeter of the training device, from setup on
        self._reset_window()

    # ------------------------------------------------------------------ schedule

    @property
    def cycle_length(self) -> int:
        return self.wait + self.warmup + self.active

    def _phase(self, batch: int) -> tuple[str | None, int, int]:
        """(phase, position in the cycle, cycle) of a batch index; phase None after the last cycle. The first
        ``skip_first`` batches are ``wait`` batches of cycle 0 at negative positions."""
        if batch < self.skip_first:
            return "wait", batch - self.skip_first, 0
        cycle, pos = divmod(batch - self.skip_first, self.cycle_length)
        if self._repeat and cycle >= self._repeat:
            return None, pos, cycle
        if pos < self.wait:
            return "wait", pos, cycle
        if pos < self.wait + self.warmup:
            return "warmup", pos, cycle
        return "active", pos, cycle

    def _reset_window(self) -> None:
        self._prof: Any = None
        self._work_counter: Any = None
        self._work: Any = None
        self._hooks: list[Any] = []
        self._scope_stack: list[Any] = []
        self._t_start = 0.0
        self._active_steps = 0
        self._batch_shapes: list[list[list[int]]] = []
        self._step_peaks: list[int] = []
        self._seq_len: int | None = None
        self._window_start_batch = 0

    # ------------------------------------------------------------------ Lightning hooks

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        from lightning.pytorch.profilers import PyTorchProfiler

        # Lightning sets `Trainer.profiler` in `_init_profiler` without declaring it on the class.
        if isinstance(trainer.profiler, PyTorchProfiler):  # type: ignore[attr-defined]
            rank_zero_warn(
                "EngineProfiler: the Trainer already runs a PyTorchProfiler and only one torch profiler session can "
                "run at a time; EngineProfiler stays off. Remove `profiler=` to use it."
            )
            self._disabled = True
            return
        self._device_type = trainer.strategy.root_device.type
        self._rank = trainer.global_rank
        self._world_size = trainer.world_size
        if not self.all_ranks and self._rank != 0:
            self._disabled = True  # rank 0 profiles; this rank does nothing (all_ranks=True profiles every rank)
            return
        from lightning_sdp.profiling.memory import PeakMemoryMeter

        self._memory = PeakMemoryMeter(trainer.strategy.root_device)
        base = (
            Path(self.dirpath)
            if self.dirpath
            else Path(trainer.log_dir or trainer.default_root_dir) / "engine_profiler"
        )
        check_writable(base, given=self.dirpath is not None)
        self._dir = base
        _quiet_kineto_without_cuda()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._disabled:
            return
        total = self._total_batches(trainer)
        if self.repeat is None:
            # As many windows as the run holds (planned from the whole run, so a resumed run plans the same).
            cycles = None if total is None else (total - self.skip_first) // self.cycle_length
            self._repeat = AUTO_WINDOWS if cycles is None else max(1, min(AUTO_WINDOWS, cycles))
        remaining = None if total is None else total - self._batches_seen
        if remaining is not None and self._phase(self._batches_seen)[0] is not None:
            need = self.cycle_length - self._phase(self._batches_seen)[1]
            if need > remaining:
                rank_zero_warn(
                    f"EngineProfiler: the profiling window needs {need} more batches (wait={self.wait}, "
                    f"warmup={self.warmup}, active={self.active}) but the run has {remaining} left; the window will "
                    "be cut short or not reached. Lower `wait`/`active` or train longer."
                )
        if not self.measure_peaks:
            self._ceilings_note = "device ceilings not measured (measure_peaks=False)."
        elif self._phase(self._batches_seen)[0] is not None:
            self._measure_device(trainer)

    def _measure_device(self, trainer: Trainer) -> None:
        """Measured ceilings of the training device (cached per device, threads, torch version)."""
        if self._device_type not in ("cpu", "cuda", "hpu"):
            self._ceilings_note = f"device ceilings not measured (no benchmark for device type {self._device_type!r})."
            return
        from lightning_sdp.profiling.engine_bench import cached_engine_peaks

        dtype = self._matrix_dtype(trainer)
        dtypes = tuple(dict.fromkeys(("fp32", dtype)))
        try:
            profile, path, cached = cached_engine_peaks(
                trainer.strategy.root_device,
                num_threads=torch.get_num_threads(),
                dtypes=dtypes,
                quick=True,
                cache_dir=self.peaks_cache_dir,
            )
        except Exception as err:  # utilisation then falls back to the datasheet only
            rank_zero_warn(
                f"EngineProfiler: measuring the device's ceilings failed ({type(err).__name__}: {err}); utilisation "
                "is reported only where a datasheet peak (or `peaks=`) exists."
            )
            self._ceilings_note = "measuring the device ceilings failed (see the warning above)."
            return
        self.device_profile = profile
        self._measured_peaks = profile.peaks(dtype)
        self._device_profile_file = str(path)
        mode = "quick mode" if profile.quick else "full mode"
        if cached:
            self._ceilings_note = (
                f"device ceilings read from the cache {path} (measured {profile.created or 'earlier'}, {mode}); "
                "`lightning-sdp engine-bench` measures them again."
            )
        else:
            self._ceilings_note = (
                f"device ceilings measured in this run ({profile.elapsed_s:.1f} s, {mode}) and cached at {path}; "
                "later runs on this device read them from there."
            )

    @staticmethod
    def _total_batches(trainer: Trainer) -> int | None:
        try:
            steps = trainer.estimated_stepping_batches
        except Exception:  # an estimate only; unknown is fine
            return None
        if steps is None or steps == float("inf"):
            return None
        return int(steps) * max(1, int(trainer.accumulate_grad_batches))

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._disabled:
            return
        phase, pos, cycle = self._phase(self._batches_seen)
        if phase is None or phase == "wait":
            return
        self._batch_shapes.append(_batch_shapes(batch))
        self._seq_len = _sequence_length(batch)
        if phase == "warmup":
            if self.count_flops and pos == self.wait + self.warmup - 1:
                from lightning_sdp.profiling.flops import WorkCounter

                accel = None if self._device_type == "cpu" else self._device_type
                self._work_counter = WorkCounter(accelerator=accel)
                self._work_counter.__enter__()
            return
        if pos == self.wait + self.warmup:
            self._start_profiler(pl_module)
            self._window_start_batch = self._batches_seen
        if self._prof is not None and self._memory is not None:
            self._memory.start()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._disabled:
            return
        phase, pos, cycle = self._phase(self._batches_seen)
        self._batches_seen += 1
        if phase is None or phase == "wait":
            return
        if self._work_counter is not None:
            self._work_counter.__exit__(None, None, None)
            self._work = self._work_counter.count
            self._work_counter = None
        if phase != "active":
            return
        if self._prof is not None:
            self._active_steps += 1
            peak = self._memory.stop() if self._memory is not None else None
            if peak is not None:
                self._step_peaks.append(peak)
        if pos == self.cycle_length - 1:
            if self._prof is None:
                rank_zero_warn(
                    f"EngineProfiler: window {cycle} was entered mid-way (resumed from a checkpoint); skipped."
                )
                self._cycles_done = cycle + 1
                self._reset_window()
                return
            report = self._finish_window(trainer, pl_module, cycle)
            if report is not None and self.log_metrics:
                from lightning_sdp.profiling.report import metrics

                pl_module.log_dict(metrics(report), on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._disabled:
            return
        if self._work_counter is not None:
            self._work_counter.__exit__(None, None, None)
            self._work_counter = None
        if self._prof is not None:
            rank_zero_warn(
                f"EngineProfiler: training ended inside the profiling window after {self._active_steps} of "
                f"{self.active} active batches; reporting the partial window."
            )
            cycle = self._phase(self._window_start_batch)[2]
            report = self._finish_window(trainer, pl_module, cycle)
            if report is not None and self.log_metrics:
                from lightning_sdp.profiling.report import metrics

                for logger in trainer.loggers:
                    logger.log_metrics(metrics(report), step=trainer.global_step)
        self._merge_and_summarise(trainer)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Stop the profiler and the counters; keep the trace of the interrupted window."""
        if self._work_counter is not None:
            try:
                self._work_counter.__exit__(None, None, None)
            finally:
                self._work_counter = None
        self._remove_module_hooks()
        if self._prof is not None:
            prof = self._prof
            self._prof = None
            try:
                prof.stop()
                if self.export_trace and self._dir is not None:
                    cycle = self._phase(self._window_start_batch)[2]
                    path = self._save_trace(prof, cycle)
                    if path is not None:
                        rank_zero_warn(
                            f"EngineProfiler: training raised {type(exception).__name__}; trace kept at {path}"
                        )
            except Exception as err:  # never mask the original exception
                rank_zero_warn(f"EngineProfiler: could not save the trace after an exception: {err}")
        self._reset_window()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"batches_seen": self._batches_seen, "cycles_done": self._cycles_done}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = {"batches_seen", "cycles_done"} - set(state_dict)
        if missing:
            raise KeyError(f"EngineProfiler checkpoint state lacks {sorted(missing)}; was it written by this callback?")
        self._batches_seen = int(state_dict["batches_seen"])
        self._cycles_done = int(state_dict["cycles_done"])

    # ------------------------------------------------------------------ window

    def _start_profiler(self, pl_module: LightningModule) -> None:
        from torch.profiler import ProfilerActivity, profile

        if torch._C._autograd._profiler_enabled():
            rank_zero_warn("EngineProfiler: another torch profiler session is running; this window is skipped.")
            return
        activities = [ProfilerActivity.CPU]
        if self._device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        elif self._device_type == "hpu" and hasattr(ProfilerActivity, "HPU"):
            activities.append(ProfilerActivity.HPU)
        if self.module_view:
            self._add_module_hooks(pl_module)
        self._module_types = {n: type(m).__name__ for n, m in pl_module.named_modules()}
        self._prof = profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False)
        self._prof.start()
        self._sync()
        self._t_start = time.perf_counter()
        self._active_steps = 0

    def _sync(self) -> None:
        if self._device_type == "cuda":
            torch.cuda.synchronize()
        elif self._device_type == "hpu":
            hpu = getattr(torch, "hpu", None)
            if hpu is not None and hasattr(hpu, "synchronize"):
                hpu.synchronize()

    def _add_module_hooks(self, pl_module: LightningModule) -> None:
        from torch.autograd.profiler import record_function

        stack = self._scope_stack

        def make_pre(name: str) -> Any:
            def pre(module: torch.nn.Module, args: Any) -> None:
                scope = record_function(f"module::{name}")
                scope.__enter__()
                stack.append(scope)

            return pre

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            if stack:
                stack.pop().__exit__(None, None, None)

        for name, module in pl_module.named_modules():
            if not name:
                continue
            self._hooks.append(module.register_forward_pre_hook(make_pre(name)))
            self._hooks.append(module.register_forward_hook(post))

    def _remove_module_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        while self._scope_stack:
            self._scope_stack.pop().__exit__(None, None, None)

    def _trace_path(self, cycle: int) -> Path:
        assert self._dir is not None
        return self._dir / f"{self.filename}-rank{self._rank}-window{cycle}.pt.trace.json.gz"

    def _save_trace(self, prof: Any, cycle: int) -> Path | None:
        """Export the window's trace; ``None`` (and a warning naming the file and the reason) when it failed."""
        path = self._trace_path(cycle)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            max_bytes = None if self.max_trace_mb is None else int(self.max_trace_mb * 2**20)
            export_trace(prof, path, max_bytes=max_bytes)
        except (TraceExportError, OSError) as err:
            # Each rank writes its own trace, so every rank warns for its own (not only rank 0).
            warnings.warn(
                f"EngineProfiler: rank {self._rank} could not write the trace of window {cycle} to {path}: {err}. "
                "The report names no trace for this window and no partial file is left; check the folder's free "
                "space and permissions, or pass export_trace=False.",
                stacklevel=2,
            )
            return None
        self._traces_written += 1
        return path

    def _write_json(self, name: str, data: Any) -> None:
        """Write ``<dirpath>/<name>`` atomically and remember it for the closing message."""
        assert self._dir is not None
        path = write_text_atomic(self._dir / name, json.dumps(data, indent=1) + "\n")
        self._files_written.append(path)

    def _finish_window(self, trainer: Trainer, pl_module: LightningModule, cycle: int) -> EngineReport | None:
        from lightning_sdp.profiling.breakdown import categorize_events
        from lightning_sdp.profiling.report import build_report

        self._sync()
        t_stop = time.perf_counter()
        span_us = (t_stop - self._t_start) * 1e6
        prof = self._prof
        self._prof = None
        steps = self._active_steps
        try:
            prof.stop()
        finally:
            self._remove_module_hooks()
        self._cycles_done = cycle + 1
        assert self._dir is not None
        self._dir.mkdir(parents=True, exist_ok=True)
        trace_path = None
        if self.export_trace or self._device_type == "hpu":
            trace_path = self._save_trace(prof, cycle)
        if steps == 0:
            self._reset_window()
            return None
        events = prof.events()
        breakdown = categorize_events(
            events,
            span_us,
            device="cuda" if self._device_type == "cuda" else "cpu",
            module_types=self._module_types,
        )
        overlap = None
        if self._device_type == "hpu" and trace_path is not None:
            from lightning_sdp.profiling.hpu_trace import analyze_trace

            try:
                overlap = analyze_trace(trace_path)
            except ValueError as err:
                rank_zero_warn(f"EngineProfiler: no HPU engine lanes in the trace ({err}); host view only.")
        device, peaks, sources = self._device_and_peaks(trainer)
        dims = self._model_dims(pl_module)
        report = build_report(
            breakdown=breakdown,
            steps=steps,
            device=device,
            work=self._work,
            peaks=peaks,
            batch_shapes=self._batch_shapes,
            model_dims=dims,
            softmax_k=self.softmax_k,
            overlap=overlap,
            rank=self._rank,
            world_size=self._world_size,
            cycle=cycle,
            start_batch=self._window_start_batch,
            measured_peaks=self._measured_peaks,
            peak_sources=sources,
            memory=self._step_memory(),
        )
        report.trace_file = str(trace_path) if trace_path is not None and self.export_trace else None
        # One-off cost after the window: stopping the profiler, exporting the trace, parsing and classifying.
        report.analysis_s = time.perf_counter() - t_stop
        self.reports.append(report)
        self._write_json(f"{self.filename}-rank{self._rank}.json", [r.to_dict() for r in self.reports])
        self._reset_window()
        return report

    def _step_memory(self) -> Any:
        """The window's per-step peak memory (a :class:`~lightning_sdp.profiling.memory.StepMemory`), or ``None``."""
        from lightning_sdp.profiling.memory import StepMemory

        if not self._step_peaks or self._memory is None or self._memory.source is None:
            return None
        return StepMemory(self._memory.source, list(self._step_peaks))

    def _device_and_peaks(self, trainer: Trainer) -> tuple[DeviceInfo, dict[str, float | None], dict[str, str | None]]:
        from lightning_sdp.profiling.peaks import device_key, device_name_of, effective_peaks

        index = trainer.strategy.root_device.index or 0
        name = device_name_of(self._device_type, index)
        if name is None and self.device_profile is not None:
            name = self.device_profile.device_name  # the CPU model (no datasheet entry matches a CPU)
        dtype = self._matrix_dtype(trainer)
        if self._device_type not in ("cpu", "cuda", "hpu"):
            rank_zero_warn(
                f"EngineProfiler: device type {self._device_type!r} is not known; reporting time shares without "
                "utilisation."
            )
        peaks, sources = effective_peaks(
            name, dtype, self.peaks, self._measured_peaks, device=trainer.strategy.root_device
        )
        device = DeviceInfo(
            type=self._device_type,
            name=name,
            key=device_key(name),
            precision=str(trainer.precision),
            matrix_dtype=dtype,
        )
        if self.device_profile is not None:
            device.profile = {
                "name": self.device_profile.device_name,
                "num_threads": self.device_profile.num_threads,
                "quick": self.device_profile.quick,
                "file": self._device_profile_file,
            }
        return device, peaks, sources

    def _matrix_dtype(self, trainer: Trainer) -> str:
        from lightning_sdp.profiling.peaks import matrix_dtype_key

        tf32 = self._device_type == "cuda" and (
            torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
        )
        return matrix_dtype_key(str(trainer.precision), allow_tf32=tf32)

    def _model_dims(self, pl_module: LightningModule) -> ModelDims:
        hp = dict(getattr(pl_module, "hparams", {}) or {})
        dims: dict[str, Any] = {}
        explicit = {"d_model": self.d_model, "n_heads": self.n_heads}
        for key, names in _MODEL_DIM_KEYS.items():
            value = explicit.get(key)
            if value is None:
                value = next((hp[n] for n in names if hp.get(n) is not None), None)
            dims[key] = value
        return ModelDims(**dims, seq_len=self._seq_len)

    def _merge_and_summarise(self, trainer: Trainer) -> None:
        from lightning_sdp.profiling.report import combine_windows, merge_reports

        combined = combine_windows(self.reports) if self.reports else None
        if combined is not None and (combined.windows or 1) > 1 and self.log_metrics:
            self._log_medians_and_spread(trainer, combined)
        gathered: list[Any] = [combined]
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if self.all_ranks and self._world_size > 1 and distributed:
            gathered = [None] * self._world_size
            torch.distributed.all_gather_object(gathered, combined)
        if self._rank != 0:
            return
        reports = [r for r in gathered if r is not None]
        if not reports:
            rank_zero_warn("EngineProfiler: no profiling window completed; nothing to report.")
            return
        self.merged = merge_reports(reports)
        assert self._dir is not None
        self._dir.mkdir(parents=True, exist_ok=True)
        self._write_json(f"{self.filename}-summary.json", self.merged.to_dict())
        if self.save_plot:
            self._save_plots(reports)
        if self.print_summary:
            self._print_summary(reports)
            rank_zero_info(
                closing_message(
                    self._dir,
                    self._files_written,
                    self._traces_written,
                    self._world_size if self.all_ranks else 1,
                    self._ceilings_note,
                )
            )

    @staticmethod
    def _log_medians_and_spread(trainer: Trainer, combined: EngineReport) -> None:
        """``engine/median_<category>_frac`` and ``engine/spread_<category>_frac`` to every logger."""
        from lightning_sdp.profiling.report import metrics

        m = {k.replace("engine/", "engine/median_", 1): v for k, v in metrics(combined).items() if k.endswith("_frac")}
        m.update({f"engine/spread_{c}_frac": float(v) for c, v in (combined.spread or {}).items()})
        for logger in trainer.loggers:
            logger.log_metrics(m, step=trainer.global_step)

    def _save_plots(self, reports: list[EngineReport]) -> None:
        """Rank 0's PNGs: shares and rooflines of the reports, and the device roofline when ceilings were measured."""
        from lightning_sdp.profiling.report import plot_reports

        assert self._dir is not None
        if len(reports) == 1 and len(self.reports) > 1:
            # One rank: a bar per window shows the spread; the roofline uses the medians.
            png = plot_reports(self.reports, self._dir / f"{self.filename}.png", roofline=reports[0])
        else:
            png = plot_reports(reports, self._dir / f"{self.filename}.png")
        self._files_written.append(Path(png))
        if self.device_profile is not None:
            from lightning_sdp.profiling.engine_bench import plot_roofline

            first = reports[0]
            datasheet = {k: v for k, v in first.peaks.items() if (first.peak_sources or {}).get(k) == "datasheet"}
            roofline = plot_roofline(
                self.device_profile, self._dir / f"{self.filename}-roofline.png", report=first, datasheet=datasheet
            )
            self._files_written.append(Path(roofline))

    @staticmethod
    def _print_summary(reports: list[EngineReport]) -> None:
        from lightning_sdp.profiling.report import summary_table

        print(summary_table(reports[0]))
        if len(reports) > 1:
            print(
                "EngineProfiler ranks: "
                + ", ".join(f"rank {r.rank} {r.step_time_s * 1e3:.2f} ms/step" for r in reports)
            )


def _batch_shapes(batch: Any) -> list[list[int]]:
    flat, _ = tree_flatten(batch)
    return [list(t.shape) for t in flat if isinstance(t, torch.Tensor)]


def _sequence_length(batch: Any) -> int | None:
    """Sequence length of a batch, only for sequence inputs: token ids ``(B, T)`` (integer) or ``(B, T, C)`` floats.

    Images ``(B, C, H, W)``, flat features ``(B, F)`` and label vectors have no sequence length (``None``).
    """
    flat, _ = tree_flatten(batch)
    for t in flat:
        if not isinstance(t, torch.Tensor):
            continue
        integer = not (t.is_floating_point() or t.is_complex()) and t.dtype != torch.bool
        if t.ndim == 2 and integer and t.shape[1] > 1:
            return int(t.shape[1])
        if t.ndim == 3 and t.is_floating_point():
            return int(t.shape[1])
    return None


def _quiet_kineto_without_cuda() -> None:
    """Silence kineto's spurious ``ERROR: gpuGetDeviceCount failed with code 35`` on machines without a GPU.

    A CUDA build of torch on a machine without a CUDA driver makes kineto (the profiler's trace library) log this
    error once per process when the first profiler session stops, although nothing is wrong for a CPU profile.
    Kineto reads ``KINETO_LOG_LEVEL`` when it first starts, so it is set (to 5: drop ERROR and lower, keep kineto's
    USDT markers) before the first window; only when no CUDA device is usable and the user has not set it.
    """
    if "KINETO_LOG_LEVEL" not in os.environ and not torch.cuda.is_available():
        os.environ["KINETO_LOG_LEVEL"] = "5"
