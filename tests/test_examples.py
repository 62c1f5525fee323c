"""Every ``examples/*.py`` script runs, as a user would start it, on tiny settings.

Each script is a separate process started in a temporary folder (the scripts write their outputs relative to the
working directory), with one OpenMP thread; it is forked from a server that has imported torch and Lightning
(``tests/_warm_python.py``), as ``python script.py ...`` would run it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._warm_python import run_python

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# script -> (tiny arguments, text its output must contain, pytest marks). "{tmp}" is the temporary folder.
TINY: dict[str, tuple[list[str], list[str], list[pytest.MarkDecorator]]] = {
    "engine_profiler_transformer.py": (["--seq-len", "32", "--batch-size", "2"], ["EngineProfiler"], []),
    "fastclip_existing_loop.py": (
        ["--epochs", "1", "--batch-size", "16", "--num-train", "64"],
        ["epoch 0: objective"],
        [pytest.mark.open_clip],
    ),
    "heat_existing_project.py": (["--epochs", "1"], ["reference {", "fused {", "recall@20"], [pytest.mark.numba]),
    "sdp4bit_existing_project.py": (
        ["--devices", "2", "--intra-node-size", "1", "--steps", "3"],
        ["final train/loss", "sdp4bit/weight_bits_per_element"],
        [],
    ),
    "solar_ptycho.py": (
        ["--data", "{tmp}/ptycho.h5", "--samples", "128", "--epochs", "1", "--batch-size", "16", "--buffer", "32"],
        ["buffer hit rate", "val/loss"],
        [],
    ),
}

# Scripts whose outputs go under runs/ in the working folder, and nowhere else there.
WRITES_UNDER_RUNS = {"engine_profiler_transformer.py"}

# Scripts that another test already runs end to end (so the suite does not pay for them twice).
COVERED_ELSEWHERE = {
    "sdp4bit_two_nodes.py": "tests/plugins/test_sdp4bit_multinode.py runs it with --launch --steps 2",
}


def test_every_example_script_is_exercised():
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    missing = scripts - set(TINY) - set(COVERED_ELSEWHERE)
    assert not missing, f"add tiny settings for {sorted(missing)} to tests/test_examples.py"
    assert not (set(TINY) | set(COVERED_ELSEWHERE)) - scripts, "a listed example script no longer exists"


@pytest.mark.slow
@pytest.mark.parametrize(
    "script",
    [pytest.param(name, marks=marks, id=name.removesuffix(".py")) for name, (_, _, marks) in TINY.items()],
)
def test_example_runs_on_tiny_settings(script, tmp_path):
    args, expected, _ = TINY[script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [str(EXAMPLES / script), *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    proc = run_python(cmd, cwd=tmp_path, env=env, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{output[-6000:]}"
    for text in expected:
        assert text in output, f"{script}: expected {text!r} in its output:\n{output[-4000:]}"
    if script in WRITES_UNDER_RUNS:  # nothing loose in the working folder: outputs go to runs/
        assert sorted(os.listdir(tmp_path)) == ["runs"], sorted(os.listdir(tmp_path))
