"""README.md and the guides in docs/ are tested as a user would use them.

Every fenced code block runs (one pytest case per block, named ``<file>:<line>``):

- ``python``: written to ``snippet.py`` in a fresh temporary folder and run there as a script (``__main__``), with the
  repository root on ``PYTHONPATH``, ``OMP_NUM_THREADS=1`` and a 120 s limit. To spare each snippet the 6-12 s of
  importing torch and Lightning, it is forked from a server that imported those libraries, never ``lightning_sdp``,
  once (``tests/_warm_python.py``); ``LIGHTNING_SDP_TEST_FRESH_PROCESS=1`` runs each in a fresh interpreter instead.
- ``bash``: lines starting with ``make``, ``pip``, ``git``, ``cd``, ``export`` or ``#`` are set-up and skipped; the
  other lines run with bash, ``set -e``, 300 s limit, in a folder that shows the repository's files (links to them),
  so repository paths such as ``examples/configs/x.yaml`` work while outputs stay out of the clone. ``.venv/bin`` (the
  running interpreter's folder) leads ``PATH``, so ``lightning-sdp`` is found. A block made only of plain
  ``lightning-sdp ...`` lines (no shell syntax) runs each as ``python .venv/bin/lightning-sdp ...`` (what the
  script's first line does) through the same server.
- ``yaml``: parsed.
- Other languages (``text`` for output samples) are not run.

A block preceded by ``<!-- no-run: <reason> -->`` (on the line above its fence) is not run; the reason is required.

Only the block runs are marked ``slow``. The other tests are fast: the size and wording targets of the same files
(README <= 150 lines, each guide <= 300, no issue/spec/moonshot, dates or commit hashes, links to existing files),
the API reference's coverage of every exported class and function, and the site's link hook.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests._warm_python import WarmPython, fresh_processes

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_TIMEOUT_S = 120
BASH_TIMEOUT_S = 300
SETUP_PREFIXES = ("make", "pip", "git", "cd", "export", "#")
RUN_LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "yaml": "yaml", "yml": "yaml"}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
_NO_RUN = re.compile(r"^\s*<!--\s*no-run\b(?P<rest>.*?)-->\s*$")


@dataclass(frozen=True)
class CodeBlock:
    """One fenced block of a markdown file."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    no_run: str | None  # the text of a no-run comment on the line above the fence, or None
    closed: bool = True

    @property
    def id(self) -> str:
        return f"{_relative(self.path)}:{self.line}"


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def code_blocks(path: Path) -> list[CodeBlock]:
    """The fenced code blocks of a markdown file (indented fences inside list items included)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[CodeBlock] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent = opening["fence"], opening["indent"]
        language = opening["info"].strip().split(" ")[0].lower() if opening["info"].strip() else ""
        end = i + 1
        while end < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", lines[end]):
            end += 1
        body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : end]]
        above = lines[i - 1] if i > 0 else ""
        marker = _NO_RUN.match(above)
        rest = marker["rest"] if marker else None
        blocks.append(CodeBlock(path, i + 1, language, "\n".join(body) + "\n", rest, closed=end < len(lines)))
        i = end + 1
    return blocks


def no_run_reason(block: CodeBlock) -> str | None:
    """The reason of a block's ``<!-- no-run: reason -->`` comment; raises if the comment gives none."""
    if block.no_run is None:
        return None
    reason = block.no_run.strip()
    if not reason.startswith(":") or not reason[1:].strip():
        raise AssertionError(f"{block.id}: write the reason into the comment: <!-- no-run: <why it cannot run> -->")
    return reason[1:].strip()


def bash_commands(code: str) -> list[str]:
    """The lines of a bash block that run: continuation lines joined, set-up lines and blank lines dropped."""
    joined: list[str] = []
    pending = ""
    for raw in code.splitlines():
        line = pending + raw.lstrip() if pending else raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1].rstrip() + " "
            continue
        pending = ""
        joined.append(line.strip())
    return [ln for ln in joined if ln and not ln.startswith(SETUP_PREFIXES)]


# A user runs a snippet from a clean shell. Lightning's launcher writes these into the launching process's own
# environment, so after an earlier in-process multi-device test the suite's process carries them, and a snippet
# that inherited LOCAL_RANK would take itself for an already-launched rank 0 and wait for peers that never start.
_LAUNCH_VARIABLES = {"LOCAL_RANK", "RANK", "GLOBAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"}
_LAUNCH_VARIABLES |= {"MASTER_ADDR", "MASTER_PORT"}
_LAUNCH_PREFIXES = ("PL_", "TORCHELASTIC_", "SLURM_")


def _environment(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES and not k.startswith(_LAUNCH_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["LIGHTNING_SDP_RESULTS_DIR"] = str(tmp_path / "benchmark_results")  # a benchmark run never writes the clone's
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _repository_view(tmp_path: Path) -> Path:
    """A folder whose entries link to the repository's top-level files: repository paths resolve, outputs stay here."""
    view = tmp_path / "repo"
    view.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in {".git", "lightning_logs", "demo_report", "runs", "site"}:
            (view / entry.name).symlink_to(entry)
    return view


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int, block: CodeBlock) -> None:
    # a session of its own, so that a timeout also ends the processes a snippet started (DDP workers)
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{block.id}: still running after {timeout} s; make the snippet tinier.\n{_tail(output)}")
    if proc.returncode != 0:
        pytest.fail(f"{block.id}: exit status {proc.returncode}\n{block.code}\n--- output ---\n{_tail(output)}")


def _run_warm(
    server: WarmPython, argv: list[str], cwd: Path, env: dict[str, str], timeout: int, block: CodeBlock
) -> None:
    output = cwd / "output.txt" if cwd.name != "repo" else cwd.parent / "output.txt"  # never inside the clone
    status = server.run(argv, cwd, env, timeout, output, output)
    if status is None:
        pytest.fail(f"{block.id}: still running after {timeout} s; make the snippet tinier.\n{_tail(_read(output))}")
    if status != 0:
        pytest.fail(f"{block.id}: exit status {status}\n{block.code}\n--- output ---\n{_tail(_read(output))}")


# A line that is just the installed console script with arguments (no shell syntax) runs in the fork server as
# `python .venv/bin/lightning-sdp ARGS`, which is what the script's shebang line does.
_SHELL_SYNTAX = re.compile(r"[|&;<>()$`*?~\\'\"]")


def _console_script_argv(command: str) -> list[str] | None:
    words = command.split()
    if not words or words[0] != "lightning-sdp" or _SHELL_SYNTAX.search(command):
        return None
    script = Path(sys.executable).parent / "lightning-sdp"
    return [str(script), *words[1:]] if script.is_file() else None


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture(scope="module")
def snippet_server(tmp_path_factory: pytest.TempPathFactory):
    if fresh_processes():
        yield None
        return
    server = WarmPython(_environment(tmp_path_factory.mktemp("snippet_server")))
    yield server
    server.close()


def _tail(text: str | None, chars: int = 6000) -> str:
    return (text or "")[-chars:]


def _runnable_blocks() -> list[CodeBlock]:
    return [b for path in DOC_FILES for b in code_blocks(path) if b.language in RUN_LANGUAGES]


@pytest.mark.slow
@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in _runnable_blocks()])
def test_code_block_runs(block: CodeBlock, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    reason = no_run_reason(block)
    if reason is not None:
        pytest.skip(f"no-run: {reason}")
    kind = RUN_LANGUAGES[block.language]
    env = _environment(tmp_path)
    if kind == "yaml":
        yaml.safe_load(block.code)
    elif kind == "python":
        work = tmp_path / "work"
        work.mkdir()
        (work / "snippet.py").write_text(block.code, encoding="utf-8")
        server = request.getfixturevalue("snippet_server")  # started by the first block that needs it
        if server is None:
            _run([sys.executable, "snippet.py"], work, env, PYTHON_TIMEOUT_S, block)
        else:
            _run_warm(server, ["snippet.py"], work, env, PYTHON_TIMEOUT_S, block)
    else:
        commands = bash_commands(block.code)
        if not commands:
            return  # set-up lines only (make, pip, git, ...): nothing to run
        view = _repository_view(tmp_path)
        scripts = [_console_script_argv(c) for c in commands]
        server = request.getfixturevalue("snippet_server") if all(scripts) else None
        if server is None:
            script = "set -e -o pipefail\n" + "\n".join(commands) + "\n"
            _run(["bash", "-c", script], view, env, BASH_TIMEOUT_S, block)
        else:
            for argv in scripts:
                _run_warm(server, argv, view, env, BASH_TIMEOUT_S, block)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------- targets

README_MAX_LINES = 150
GUIDE_MAX_LINES = 300
# Words a user cannot follow and history that belongs in CHANGELOG.md. A hash needs a digit and a letter a-f, so
# numbers ("1234567") and words ("defaced") pass; "specific"/"tissue" pass thanks to the word boundaries.
FORBIDDEN = {
    "the word 'issue'": re.compile(r"\bissues?\b", re.IGNORECASE),
    "the word 'spec'": re.compile(r"\bspecs?\b", re.IGNORECASE),
    "the word 'moonshot'": re.compile(r"moonshot", re.IGNORECASE),
    "a date": re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
}
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _wording_problems(path: Path) -> list[str]:
    problems = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        for what, pattern in FORBIDDEN.items():
            for hit in pattern.finditer(line):
                problems.append(f"{_relative(path)}:{number}: {what} ({hit.group(0)!r})")
    return problems


def test_readme_and_guides_meet_their_targets() -> None:
    """README <= 150 lines, each guide <= 300; no issue/spec/moonshot, dates or commit hashes; relative links exist."""
    problems = []
    readme_lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    if readme_lines > README_MAX_LINES:
        problems.append(f"README.md has {readme_lines} lines (at most {README_MAX_LINES})")
    for guide in DOC_FILES[1:]:
        n = len(guide.read_text(encoding="utf-8").splitlines())
        if n > GUIDE_MAX_LINES:
            problems.append(f"{_relative(guide)} has {n} lines (at most {GUIDE_MAX_LINES})")
    for path in [*DOC_FILES, *sorted((ROOT / "docs").glob("*/**/*.md"))]:
        problems += _wording_problems(path)
        for link in _LINK.finditer(path.read_text(encoding="utf-8")):
            target = link["target"].split("#")[0]
            if target and "://" not in target and not target.startswith("mailto:"):
                if not (path.parent / target).exists():
                    problems.append(f"{_relative(path)}: link to a missing file {link['target']}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------- API reference

API_PAGES = ROOT / "docs" / "api"
# Packages whose exported classes and functions (``_EXPORTS``, else ``__all__``, else public top-level definitions)
# the API reference must show, and single names from packages whose other exports are internals.
API_PACKAGES = (
    "lightning_sdp",
    "lightning_sdp.plugins",
    "lightning_sdp.plugins.sdp4bit",
    "lightning_sdp.callbacks",
    "lightning_sdp.models",
    "lightning_sdp.models.fastclip",
    "lightning_sdp.datamodules",
    "lightning_sdp.recipes",
    "lightning_sdp.metrics",
)
API_NAMES = {
    "lightning_sdp.datamodules.solar": ("make_ptycho_h5", "per_sample_loss_scale"),
    "lightning_sdp.models.simplex": ("SimpleXConfig",),
}


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _exports(module: str, tree: ast.Module) -> dict[str, str]:
    """Name -> module it is taken from, for what ``module`` exports (read statically, nothing is imported)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
            return dict(ast.literal_eval(node.value))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {name: module for name in ast.literal_eval(node.value)}
    return {
        n.name: module
        for n in tree.body
        if isinstance(n, ast.ClassDef | ast.FunctionDef) and not n.name.startswith("_")
    }


def _definition(module: str, name: str, depth: int = 0) -> str | None:
    """``module.name`` where a class or function is defined (following imports), None for a constant.

    Raises:
        LookupError: the module does not exist or does not define or import the name.
    """
    path = _module_file(module)
    if path is None or depth > 10:
        raise LookupError(f"{module} (exporting {name}) does not exist")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
            return f"{module}.{name}"
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return None
    lazy = _exports(module, tree)  # a lazy package's ``_EXPORTS`` names the module that defines the name
    if lazy.get(name, module) != module:
        return _definition(lazy[name], name, depth + 1)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for found in ast.walk(tree):  # imports anywhere, including a lazy ``__getattr__``
        if isinstance(found, ast.ImportFrom):
            for alias in found.names:
                if (alias.asname or alias.name) == name:
                    base = package.rsplit(".", found.level - 1)[0] if found.level else ""
                    source = ".".join(filter(None, [base, found.module])) if found.level else found.module or ""
                    return _definition(source, alias.name, depth + 1)
    raise LookupError(f"{module} exports {name} but neither defines nor imports it")


def test_api_reference_covers_every_public_class_and_function() -> None:
    """Every exported class and function of the plugins has a ``::: path`` entry (its defining module) in docs/api."""
    entries = {
        line.split(maxsplit=1)[1].strip()
        for page in API_PAGES.glob("*.md")
        for line in page.read_text(encoding="utf-8").splitlines()
        if line.startswith("::: ")
    }
    wanted: dict[str, str] = {}
    problems = []
    for package in API_PACKAGES:
        path = _module_file(package)
        assert path is not None, f"{package} does not exist: update API_PACKAGES in {Path(__file__).name}"
        for name, source in _exports(package, ast.parse(path.read_text(encoding="utf-8"))).items():
            wanted[f"{package}.{name}"] = source
    for package, names in API_NAMES.items():
        wanted.update({f"{package}.{name}": package for name in names})
    for public, source in sorted(wanted.items()):
        try:
            defined = _definition(source, public.rpartition(".")[2])
        except LookupError as err:
            problems.append(str(err))
            continue
        if defined is not None and defined not in entries and defined.rpartition(".")[0] not in entries:
            problems.append(f"{public}: add '::: {defined}' to a page of docs/api/")
    assert not problems, "\n".join(problems)


def _load_hook():
    spec = importlib.util.spec_from_file_location("repository_links", ROOT / "docs" / "hooks" / "repository_links.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_site_hook_points_outside_links_at_site_copies(tmp_path: Path) -> None:
    """The MkDocs hook rewrites links to repository files outside docs/; missing files and code stay as written."""
    hook = _load_hook()
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    for name in ("docs/other.md", "benchmarks/results/m.md", "benchmarks/results/m.png"):
        (tmp_path / name).write_text("x")
    guide = (
        '[r](../benchmarks/results/m.md#table) ![p](../benchmarks/results/m.png "plot") [x](../benchmarks/results/gone.md)'
        " [o](other.md) [w](https://example.org/a.md)\n```\n[c](../benchmarks/results/m.md)\n```"
    )
    text, reached = hook.rewrite_links(guide, "docs/guide.md", "docs", tmp_path)
    assert text == (
        '[r](repository/benchmarks/results/m.md#table) ![p](repository/benchmarks/results/m.png "plot")'
        " [x](../benchmarks/results/gone.md) [o](other.md) [w](https://example.org/a.md)"
        "\n```\n[c](../benchmarks/results/m.md)\n```"
    )
    assert reached == {"benchmarks/results/m.md", "benchmarks/results/m.png"}
    text, reached = hook.rewrite_links(
        "![p](m.png) [g](../../docs/other.md)", "benchmarks/results/m.md", "docs", tmp_path
    )
    assert text == "![p](m.png) [g](../../../other.md)"
    assert reached == {"benchmarks/results/m.png"}


def test_every_block_is_complete_and_no_run_says_why() -> None:
    """Fences close, runnable python blocks parse, and every no-run comment gives its reason (no block is run)."""
    problems = []
    for path in DOC_FILES:
        for block in code_blocks(path):
            if not block.closed:
                problems.append(f"{block.id}: the code fence is not closed")
            try:
                no_run_reason(block)
            except AssertionError as err:
                problems.append(str(err))
            if RUN_LANGUAGES.get(block.language) == "python":
                try:
                    ast.parse(block.code)
                except SyntaxError as err:
                    problems.append(f"{block.id}: python does not parse: {err}")
    assert not problems, "\n".join(problems)


def test_harness_reads_blocks_as_documented(tmp_path: Path) -> None:
    """The parser finds languages, lines, indented fences and no-run reasons; bash set-up lines are dropped."""
    sample = tmp_path / "sample.md"
    sample.write_text(
        textwrap.dedent(
            """\
            # t

            ```python
            print(1)
            ```
            <!-- no-run: needs two nodes -->
            ```bash
            make test
            lightning-sdp fit \\
              --config x.yaml
            # a comment
            ```
            - item

              ```yaml
              a: 1
              ```
            <!-- no-run -->
            ```text
            out
            ```
            """
        )
    )
    blocks = code_blocks(sample)
    assert [(b.language, b.line) for b in blocks] == [("python", 3), ("bash", 7), ("yaml", 15), ("text", 19)]
    assert blocks[0].code == "print(1)\n" and no_run_reason(blocks[0]) is None
    assert no_run_reason(blocks[1]) == "needs two nodes"
    assert bash_commands(blocks[1].code) == ["lightning-sdp fit --config x.yaml"]
    assert yaml.safe_load(blocks[2].code) == {"a": 1}
    with pytest.raises(AssertionError, match="write the reason"):
        no_run_reason(blocks[3])
    assert _wording_problems(sample) == []


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("see issue 33", True),
        ("the spec says", True),
        ("a moonshot", True),
        ("on 2026-12-01 we", True),
        ("fixed in 2db5c10", True),
        ("a specific tissue of issuers", False),
        ("1234567 samples, a defaced wall, 0x1f2e3d4, 1e-05", False),
    ],
)
def test_wording_patterns(text: str, bad: bool, tmp_path: Path) -> None:
    path = tmp_path / "x.md"
    path.write_text(text + "\n")
    assert bool(_wording_problems(path)) is bad


def test_a_snippet_past_its_limit_fails_and_its_processes_end(tmp_path: Path) -> None:
    block = CodeBlock(tmp_path / "x.md", 1, "bash", "", None)
    script = f"sleep 60 & echo $! > {tmp_path}/child; wait"
    with pytest.raises(pytest.fail.Exception, match="still running after 1 s"):
        _run(["bash", "-c", script], tmp_path, dict(os.environ), 1, block)
    child = int((tmp_path / "child").read_text())
    stat = Path(f"/proc/{child}/stat")
    for _ in range(50):  # the kill is sent; give the kernel a moment (a zombie waiting to be reaped is dead too)
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    pytest.fail(f"the snippet's child process {child} outlived the timeout")


@pytest.mark.slow
def test_the_snippet_server_runs_a_snippet_as_a_script_without_lightning_sdp(
    snippet_server: WarmPython | None, tmp_path: Path
) -> None:
    if snippet_server is None:
        pytest.skip("LIGHTNING_SDP_TEST_FRESH_PROCESS=1: no server")
    code = (
        "import os, sys\n"
        "assert __name__ == '__main__' and sys.argv == ['snippet.py']\n"
        "assert 'lightning_sdp' not in sys.modules, 'the server must not import the package for the snippet'\n"
        "assert os.getcwd() == os.path.dirname(os.path.abspath(__file__))\n"
        "assert os.environ['OMP_NUM_THREADS'] == '1'\n"
        "open('made_here.txt', 'w').write('x')\n"
    )
    (tmp_path / "snippet.py").write_text(code)
    block = CodeBlock(tmp_path / "x.md", 1, "python", code, None)
    _run_warm(snippet_server, ["snippet.py"], tmp_path, _environment(tmp_path), 60, block)
    assert (tmp_path / "made_here.txt").exists()
    (tmp_path / "snippet.py").write_text("raise ValueError('boom')\n")
    with pytest.raises(pytest.fail.Exception, match="exit status 1(.|\n)*ValueError: boom"):
        _run_warm(snippet_server, ["snippet.py"], tmp_path, _environment(tmp_path), 60, block)
