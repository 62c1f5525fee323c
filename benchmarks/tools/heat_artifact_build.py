"""Build HEAT's own code (``hipdac-lab/ICS23-HEAT``, the ICS 2023 artifact) as a Python extension, at run time.

The artifact is a C++/OpenMP library (``cf_cpu/src``) with a pybind11 module ``cf_c`` and Eigen 3.4 (its two git
submodules). Nothing of it lives in this repository: this script finds or fetches each part when it runs and
compiles the module with the compiler's release flags (``-O3 -DNDEBUG``, as CMake's ``Release``), the artifact's own
``-DSPLATT_VAL_TYPEWIDTH=32`` and ``-fopenmp``, into a cache folder.

Where the parts come from, in order:

* the artifact: ``--source`` (a checkout, or a git directory without a work tree such as a mirror: its ``HEAD`` is
  exported with ``git archive``), else ``git clone https://github.com/hipdac-lab/ICS23-HEAT`` (needs the internet);
* Eigen: ``--eigen``, else the checkout's ``cf_cpu/extern/eigen`` when its submodule is there, else
  ``/usr/include/eigen3`` (Debian's ``libeigen3-dev``), else ``apt-get download libeigen3-dev`` unpacked into the
  cache (nothing installed);
* pybind11: ``--pybind11``, else the checkout's ``cf_cpu/extern/pybind11``, else the ``pybind11`` Python package,
  else ``pip download pybind11`` unpacked into the cache (nothing installed).

A machine without the internet needs ``--source``: run ``git clone https://github.com/hipdac-lab/ICS23-HEAT`` where
there is a connection (the ``fetch`` tool of these sessions gives a git directory that works as it is) and copy it
over. ``python -m benchmarks.tools.heat_artifact_build --source DIR`` prints the built module's folder;
:func:`build` is what ``benchmarks.heat_artifact`` calls, and :class:`ArtifactUnavailable` says why it could not.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

REPO_URL = "https://github.com/hipdac-lab/ICS23-HEAT"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning_sdp" / "heat_artifact"
FLAGS = ["-O3", "-DNDEBUG", "-fPIC", "-fopenmp", "-DSPLATT_VAL_TYPEWIDTH=32"]
_INCLUDES = ("src", "src/splatt", "src/modules", "src/modules/memory", "src/modules/random")
_SOURCES = (
    "src/splatt",
    "src/modules/behavior_aggregators",
    "src/modules/datasets",
    "src/modules/embeddings",
    "src/modules/models",
    "src/modules/negative_samplers",
    "src/modules/optimizers",
    "src/modules/train",
    "src/pybind",
)


class ArtifactUnavailable(RuntimeError):
    """The artifact cannot be built here; the message says which part is missing and how to provide it."""


def _run(command: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)


def _export(source: Path, into: Path) -> Path:
    """The artifact's files in ``into`` (a checkout is copied, a git directory's ``HEAD`` exported)."""
    if (source / "cf_cpu" / "src").is_dir():
        shutil.copytree(source, into, ignore=shutil.ignore_patterns(".git"), dirs_exist_ok=True)
        return into
    head = _run(["git", "--git-dir", str(source), "rev-parse", "HEAD"])
    if head.returncode != 0:
        raise ArtifactUnavailable(
            f"{source} is neither a checkout of {REPO_URL} (no cf_cpu/src) nor a git directory of it "
            f"({head.stderr.strip()[:200]}); clone it with `git clone {REPO_URL}` and pass --source."
        )
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(f"git --git-dir '{source}' archive --format=tar HEAD | tar -x -C '{into}'", shell=True, check=True)
    return into


def _fetch_source(source: Path | None, work: Path) -> Path:
    if source is not None:
        return _export(source, work / "ICS23-HEAT")
    clone = _run(["git", "clone", "--depth", "1", "--recursive", REPO_URL, str(work / "ICS23-HEAT")])
    if clone.returncode != 0:
        raise ArtifactUnavailable(
            f"could not clone {REPO_URL} ({clone.stderr.strip().splitlines()[-1] if clone.stderr else 'no output'}); "
            "on a machine without the internet, clone it elsewhere, copy it here and pass --source DIR."
        )
    return work / "ICS23-HEAT"


def _eigen(asked: Path | None, tree: Path, work: Path) -> Path:
    for candidate in (asked, tree / "cf_cpu" / "extern" / "eigen", Path("/usr/include/eigen3")):
        if candidate is not None and (candidate / "Eigen" / "Core").is_file():
            return candidate
    unpacked = CACHE / "eigen"
    if (unpacked / "usr" / "include" / "eigen3" / "Eigen" / "Core").is_file():
        return unpacked / "usr" / "include" / "eigen3"
    got = _run(["apt-get", "download", "libeigen3-dev"], cwd=work)
    debs = sorted(work.glob("libeigen3-dev*.deb"))
    if got.returncode != 0 or not debs:
        raise ArtifactUnavailable(
            "Eigen 3 not found (no --eigen, no cf_cpu/extern/eigen submodule, no /usr/include/eigen3) and "
            f"`apt-get download libeigen3-dev` failed ({got.stderr.strip()[:200]}); pass --eigen DIR."
        )
    unpacked.mkdir(parents=True, exist_ok=True)
    if _run(["dpkg", "-x", str(debs[0]), str(unpacked)]).returncode != 0:
        raise ArtifactUnavailable(f"could not unpack {debs[0].name} with dpkg -x; pass --eigen DIR.")
    return unpacked / "usr" / "include" / "eigen3"


def _pybind11(asked: Path | None, tree: Path, work: Path) -> Path:
    for candidate in (asked, tree / "cf_cpu" / "extern" / "pybind11" / "include"):
        if candidate is not None and (candidate / "pybind11" / "pybind11.h").is_file():
            return candidate
    try:
        import pybind11  # type: ignore[import-not-found]

        return Path(pybind11.get_include())
    except ImportError:
        pass
    unpacked = CACHE / "pybind11"
    if not (unpacked / "pybind11" / "include" / "pybind11" / "pybind11.h").is_file():
        got = _run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(work), "pybind11"])
        wheels = sorted(work.glob("pybind11-*.whl"))
        if got.returncode != 0 or not wheels:
            raise ArtifactUnavailable(
                f"pybind11 not found and `pip download pybind11` failed ({got.stderr.strip()[-200:]}); "
                "pass --pybind11 DIR (its include folder)."
            )
        unpacked.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(unpacked)
    return unpacked / "pybind11" / "include"


def _compile(tree: Path, eigen: Path, pybind11: Path, out: Path) -> Path:
    root = tree / "cf_cpu"
    includes = [f"-I{root / d}" for d in _INCLUDES] + [f"-I{eigen}", f"-I{pybind11}"]
    includes.append(f"-I{sysconfig.get_paths()['include']}")
    objects = []
    build = out / "obj"
    build.mkdir(parents=True, exist_ok=True)
    for folder in _SOURCES:
        for source in sorted((root / folder).iterdir()):
            if source.suffix not in (".c", ".cpp"):
                continue
            compiler = ["gcc", "-std=gnu99"] if source.suffix == ".c" else ["g++", "-std=c++14"]
            target = build / f"{source.parent.name}_{source.stem}.o"
            done = _run([*compiler, *FLAGS, *includes, "-c", str(source), "-o", str(target)])
            if done.returncode != 0:
                raise ArtifactUnavailable(f"compiling {source.relative_to(tree)} failed:\n{done.stderr[-2000:]}")
            objects.append(str(target))
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    module = out / f"cf_c{suffix}"
    linked = _run(["g++", "-shared", "-fopenmp", *objects, "-o", str(module)])
    if linked.returncode != 0:
        raise ArtifactUnavailable(f"linking cf_c failed:\n{linked.stderr[-2000:]}")
    return module


def build(source: Path | None = None, eigen: Path | None = None, pybind11: Path | None = None) -> Path:
    """Build (or find already built) the artifact's ``cf_c`` module; returns the folder to put on ``sys.path``.

    Raises:
        ArtifactUnavailable: a part could not be found or fetched, or the compiler failed; the message says which.
    """
    if shutil.which("g++") is None or shutil.which("gcc") is None:
        raise ArtifactUnavailable("no C/C++ compiler (gcc, g++) on PATH; install build-essential.")
    with tempfile.TemporaryDirectory(prefix="heat_artifact_") as tmp:
        work = Path(tmp)
        tree = _fetch_source(source, work)
        digest = hashlib.blake2b(digest_size=8)
        for path in sorted((tree / "cf_cpu" / "src").rglob("*")):
            if path.is_file():
                digest.update(path.read_bytes())
        digest.update(" ".join(FLAGS).encode())
        out = CACHE / digest.hexdigest()
        if list(out.glob("cf_c*.so")):
            return out
        module = _compile(tree, _eigen(eigen, tree, work), _pybind11(pybind11, tree, work), out)
        shutil.rmtree(out / "obj", ignore_errors=True)
        return module.parent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--source", type=Path, default=None, help="checkout or git directory of ICS23-HEAT")
    parser.add_argument("--eigen", type=Path, default=None, help="Eigen 3 include folder (holding Eigen/Core)")
    parser.add_argument("--pybind11", type=Path, default=None, help="pybind11 include folder")
    args = parser.parse_args(argv)
    try:
        print(build(args.source, args.eigen, args.pybind11))
    except ArtifactUnavailable as why:
        raise SystemExit(f"SKIP: {why}") from None


if __name__ == "__main__":
    main()
