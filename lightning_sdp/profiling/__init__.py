"""Helpers of the :class:`~lightning_sdp.callbacks.EngineProfiler` callback (Gaudi MME/TPC study).

Zhang et al., "Benchmarking and In-depth Performance Study of Large Language Models on Habana Gaudi Processors"
(SC-W 2023, arXiv 2309.16976): how a Transformer step splits between the matrix engine and the vector engines.

Modules (imported on demand, none is loaded by ``import lightning_sdp``):

- :mod:`~lightning_sdp.profiling.categories`: operator and kernel names -> ``matrix`` / ``attention_fused`` /
  ``vector`` / ``memory`` / ``communication`` / ``host_other``; per-category and per-module times from profiler
  events.
- :mod:`~lightning_sdp.profiling.flops`: matrix FLOPs (``FlopCounterMode`` plus the CPU SDPA kernels it misses) and
  vector work (elements, bytes) counted in one training step.
- :mod:`~lightning_sdp.profiling.peaks`: per-device, per-dtype peak table and the analytic attention model.
- :mod:`~lightning_sdp.profiling.hpu_trace`: engine lanes of a Gaudi Chrome trace and their overlap states.
- :mod:`~lightning_sdp.profiling.report`: the report (JSON, summary table, metrics, findings, PNG).
- :mod:`~lightning_sdp.profiling.sweep`: ``sequence_length_sweep`` and its command line.
"""
