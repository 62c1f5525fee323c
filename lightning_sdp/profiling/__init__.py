"""EngineProfiler's analysis (Gaudi MME/TPC study): what :class:`~lightning_sdp.callbacks.EngineProfiler` computes.

Zhang et al., "Benchmarking and In-depth Performance Study of Large Language Models on Habana Gaudi Processors"
(SC-W 2023, arXiv 2309.16976): how a Transformer step splits between the matrix engine and the vector engines.

This package is the framework-free part of the callback: it reads profiler events, traces and counters and never
imports from :mod:`lightning_sdp.callbacks`, :mod:`lightning_sdp.models` or :mod:`lightning_sdp.plugins` (the
callback and the sequence-length sweep that drive it live in :mod:`lightning_sdp.callbacks.engine_profiler`).
Modules (imported on demand, none is loaded by ``import lightning_sdp``):

- :mod:`~lightning_sdp.profiling.categories`: operator and kernel names -> ``matrix`` / ``attention_fused`` /
  ``vector`` / ``memory`` / ``communication`` / ``host_other``.
- :mod:`~lightning_sdp.profiling.module_groups`: module paths -> groups of the per-module view (attention, MLP...).
- :mod:`~lightning_sdp.profiling.breakdown`: per-category and per-module times from a profile's events.
- :mod:`~lightning_sdp.profiling.flops`: matrix FLOPs (``FlopCounterMode`` plus the CPU SDPA kernels it misses) and
  vector work (elements, bytes) counted in one training step.
- :mod:`~lightning_sdp.profiling.peaks`: per-device, per-dtype peak table (Lightning's CUDA table for the cards it
  lacks) and the analytic attention model.
- :mod:`~lightning_sdp.profiling.engine_bench`: engine microbenchmarks, the measured ceilings of this device.
- :mod:`~lightning_sdp.profiling.hpu_trace`: engine lanes of a Gaudi Chrome trace and their overlap states.
- :mod:`~lightning_sdp.profiling.results`: the typed report (:class:`~lightning_sdp.profiling.results.EngineReport`,
  :class:`~lightning_sdp.profiling.results.MergedReport`) and its JSON form.
- :mod:`~lightning_sdp.profiling.report`: building, combining and merging reports; findings, summary table, metrics,
  PNG.
"""
