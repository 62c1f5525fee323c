"""Benchmark smoke tests write their ``results/<name>.*`` files into a temporary folder, never the committed one.

Set before any ``benchmarks`` module is imported (``benchmarks._common.RESULTS_DIR`` is read at import), and
inherited by the subprocesses some smoke tests start.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

if "LIGHTNING_SDP_RESULTS_DIR" not in os.environ:
    os.environ["LIGHTNING_SDP_RESULTS_DIR"] = tempfile.mkdtemp(prefix="lightning_sdp_bench_results_")
    atexit.register(shutil.rmtree, os.environ["LIGHTNING_SDP_RESULTS_DIR"], ignore_errors=True)
