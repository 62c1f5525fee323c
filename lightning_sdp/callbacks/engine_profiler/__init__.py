"""EngineProfiler: where a training step's time goes, matrix engine or vector engines (Gaudi MME/TPC study).

- :mod:`~lightning_sdp.callbacks.engine_profiler.callback`: the :class:`EngineProfiler` callback.
- :mod:`~lightning_sdp.callbacks.engine_profiler.outputs`: its output files (folder check, checked trace export).
- :mod:`~lightning_sdp.callbacks.engine_profiler.sweep`: the paper's long-sequence study, the callback run on a GPT
  at growing sequence lengths (``python -m lightning_sdp.callbacks.engine_profiler.sweep``).

The analysis the callback runs (categories, FLOPs, peaks, reports, engine microbenchmarks) is
:mod:`lightning_sdp.profiling`, which imports nothing from callbacks or models.
"""

from lightning_sdp.callbacks.engine_profiler.callback import AUTO_WINDOWS, EngineProfiler

__all__ = ["AUTO_WINDOWS", "EngineProfiler"]
