"""The benchmark runner and its table of configurations (``python -m benchmarks``)."""

from __future__ import annotations

import ast
import datetime as dt
import json
import re
from pathlib import Path

import pytest

from benchmarks import __main__ as runner
from benchmarks.suite import CONFIGURATIONS, REPO_ROOT, Configuration, benchmarks, find, missing

RESULTS = REPO_ROOT / "benchmarks" / "results"
FAKE = Configuration(
    "fake_benchmark", "tiny", "a stand-in", ("--value", "2.5"), module="tests.benchmarks._fake_benchmark"
)


@pytest.fixture(autouse=True)
def _short_load_sample(monkeypatch):
    # the runner samples the CPU for a second before each run; a tenth tells these tests the same
    sample = runner._common.machine_before_run
    monkeypatch.setattr(runner._common, "machine_before_run", lambda: sample(sample_seconds=0.1))


def test_every_stored_result_belongs_to_a_listed_configuration():
    stems = {c.stem for c in CONFIGURATIONS} | {s for c in CONFIGURATIONS for s in c.extra_stems}
    stored = {path.name.split(".")[0] for path in RESULTS.iterdir()}
    assert stored - stems == set(), "results without a configuration: delete them or list them in benchmarks/suite.py"


def test_configurations_are_unique_and_name_existing_modules():
    keys = [c.key for c in CONFIGURATIONS]
    assert len(keys) == len(set(keys))
    for config in CONFIGURATIONS:
        assert (REPO_ROOT / Path(*config.module_name.split("."))).with_suffix(".py").is_file(), config.key
        assert config.summary and config.minutes > 0, config.key
        missing(config)  # every need is one the runner knows how to check


def test_find_names_the_configurations_of_a_benchmark_it_cannot_find():
    assert find("sdp4bit_throughput").name == "default"
    assert find("sdp4bit_throughput:cpu_10g").stem == "sdp4bit_throughput_cpu_10g"
    with pytest.raises(KeyError, match="sdp4bit_throughput:cpu_10g"):
        find("sdp4bit_throughput:nope")
    assert len({c.benchmark for c in benchmarks()}) == len(list(benchmarks()))


def test_list_says_what_each_configuration_needs(capsys):
    assert runner.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(CONFIGURATIONS)
    gpu = next(line for line in lines if line.startswith("gpu_checks "))
    assert "needs gpu" in gpu and "no --quick" in gpu


def test_a_run_records_the_machine_before_it_starts_and_the_command(tmp_path):
    assert runner.run(FAKE, quick=False, out=tmp_path) == 0
    payload = json.loads((tmp_path / "fake_benchmark_tiny.json").read_text())
    assert payload["rows"] == [{"value": 2.5}] and payload["quick"] is False
    assert payload["run"]["command"] == "python -m benchmarks fake_benchmark:tiny"
    recorded = dt.datetime.fromisoformat(payload["machine"]["date"]).timestamp()
    assert recorded <= payload["started"]  # taken before the module ran, not when it wrote
    assert 0 <= payload["machine"]["cpu_busy_before"] <= 1
    markdown = (tmp_path / "fake_benchmark_tiny.md").read_text()
    assert "Command: `python -m benchmarks fake_benchmark:tiny`" in markdown
    assert not list(tmp_path.glob("fake_benchmark_own_name*"))


def test_every_run_reads_the_runners_shared_data_even_from_another_checkout(tmp_path, monkeypatch):
    # a checkout of another commit (--against) lives where no ../shared/data is beside it
    monkeypatch.setattr(runner._common, "SHARED_DATA", tmp_path / "data")
    assert runner.run(FAKE, quick=False, out=tmp_path) == 0
    assert json.loads((tmp_path / "fake_benchmark_tiny.json").read_text())["data"] == str(tmp_path / "data")


def test_quick_runs_extra_arguments_and_background_jobs(tmp_path):
    assert runner.run(FAKE, quick=True, out=tmp_path, extra=["--value", "4"], background_jobs=1) == 0
    payload = json.loads((tmp_path / "fake_benchmark_tiny.json").read_text())
    assert payload["quick"] is True and payload["rows"] == [{"value": 4.0}]
    assert payload["run"]["background_jobs"] == 1


def _busy_jobs() -> list[Path]:
    return [p for p in Path("/proc").glob("[0-9]*/cmdline") if b"sum(range(10000))" in _read(p)]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # the process ended meanwhile
        return b""


def test_background_jobs_run_during_the_block_and_end_with_it():
    before = len(_busy_jobs())
    with runner.busy_processes(2):
        assert _eventually(lambda: len(_busy_jobs()) == before + 2)
    assert _eventually(lambda: len(_busy_jobs()) == before)


def test_background_jobs_end_when_the_runner_is_terminated():
    import signal
    import subprocess
    import sys

    before = len(_busy_jobs())
    block = "from benchmarks.__main__ import busy_processes\nimport time\nwith busy_processes(1):\n    time.sleep(60)"
    runner_process = subprocess.Popen([sys.executable, "-c", block], cwd=Path(__file__).resolve().parents[2])
    try:
        assert _eventually(lambda: len(_busy_jobs()) == before + 1, 30.0)
        runner_process.send_signal(signal.SIGTERM)  # no `finally` runs: the job must notice by itself
        runner_process.wait(10)
        assert _eventually(lambda: len(_busy_jobs()) == before)
    finally:
        runner_process.kill()


def _eventually(check, seconds: float = 10.0) -> bool:
    """``check()`` turned true within ``seconds`` (a loaded machine may take a moment to show a new process)."""
    import time

    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_module_that_writes_nothing_fails_the_run(tmp_path):
    silent = Configuration("silent", module="json.tool", args=("--help",), quick_args=None, summary="x", minutes=1)
    assert runner.run(silent, quick=False, out=tmp_path) == 1


def test_side_by_side_pairs_numbers_at_the_same_place():
    before = {"rows": [{"ms": 2.0, "name": "a"}], "machine": {"load": 1.0}}
    after = {"rows": [{"ms": 1.0, "name": "a"}], "machine": {"load": 3.0}, "new": 5}
    text = runner.side_by_side(before, after, "abc123")
    assert "rows[0].ms" in text and "0.500" in text
    assert "load" not in text and "new" not in text


def test_against_another_commit_runs_both_trees(capsys):
    # HEAD's checkout holds the committed stand-in module; the run there and here write separate result sets
    config = Configuration(
        "fake_benchmark", "against", "x", ("--value", "3"), module="tests.benchmarks._fake_benchmark", minutes=1
    )
    assert runner.run_against(config, "HEAD", quick=False, extra=[]) == 0
    out = capsys.readouterr().out
    assert "rows[0].value" in out and "1.000" in out


def test_pages_are_rendered_again_from_the_stored_json(tmp_path, monkeypatch):
    assert runner.run(FAKE, quick=False, out=tmp_path) == 0
    page = tmp_path / "fake_benchmark_tiny.md"
    first = page.read_text()
    payload = json.loads((tmp_path / "fake_benchmark_tiny.json").read_text())
    payload["rows"][0]["value"] = 7.5
    (tmp_path / "fake_benchmark_tiny.json").write_text(json.dumps(payload))
    page.write_text("stale")
    monkeypatch.setattr(runner._common, "RESULTS_DIR", runner._common.RESULTS_DIR)  # restored after the test
    assert runner.render(FAKE, tmp_path) == 0
    assert page.read_text() == first.replace("value 2.5", "value 7.5")
    assert runner.render(Configuration("x", module="json.decoder", summary="x", minutes=1), tmp_path) == 2


def _benchmark_imports(path: Path) -> list[str]:
    """Every ``benchmarks.<module>`` a file imports (``from benchmarks import x`` counts as ``benchmarks.x``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
            found += [f"benchmarks.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
            found.append(node.module or "")
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("benchmarks.")]
    return found


SHARED = ("benchmarks._common", "benchmarks.suite", "benchmarks.tools")


def test_no_benchmark_imports_another() -> None:
    # what benchmarks share lives in _common (recording, results) or tools/ (data, emulators, method tables)
    folder = Path(runner.__file__).parent
    crossing = [
        f"{path.relative_to(folder.parent)} imports {name}"
        for path in sorted([*folder.glob("*.py"), *(folder / "tools").glob("*.py")])
        for name in _benchmark_imports(path)
        if not any(name == shared or name.startswith(f"{shared}.") for shared in SHARED) and path.name != "__main__.py"
    ]
    assert not crossing, "\n".join(crossing)


def test_no_benchmark_loads_code_from_git() -> None:
    # comparisons across commits check the commit out (python -m benchmarks --against REV); nothing reads old code
    # out of git at run time
    folder = Path(runner.__file__).parent
    loading = [
        str(path.relative_to(folder.parent))
        for path in sorted([*folder.glob("*.py"), *(folder / "tools").glob("*.py")])
        if path.name != "__main__.py"
        and re.search(
            r"[\"']git[\"'],\s*[\"'](show|archive|cat-file)[\"']|git (show|archive|cat-file) ", path.read_text()
        )
    ]
    assert not loading, f"benchmarks that load code from git: {loading}"
