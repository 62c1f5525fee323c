"""The first run on a machine: the fused kernel compiles at set-up, before the Trainer's clock starts, and an
installed, read-only package caches it in the user's cache folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.numba

ROOT = Path(__file__).resolve().parents[2]

_TIMED_FIT = """
import json
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import Timer
import lightning_sdp
from lightning_sdp import InteractionsDataModule, SimpleXModule
from lightning_sdp.kernels import cf_numba

class Watch(Callback):
    def on_train_start(self, trainer, pl_module):
        self.at_start = cf_numba.compile_counts()

    def on_train_end(self, trainer, pl_module):
        self.at_end = cf_numba.compile_counts()

dm = InteractionsDataModule(num_users=300, num_items=200, batch_size=64)
model = SimpleXModule(dim=8, num_negatives=4, backend="fused", loss="ccl")
watch = Watch()
trainer = Trainer(
    accelerator="heat", max_time={"seconds": 3}, callbacks=[watch], limit_val_batches=0, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(model, dm)
timer = next(c for c in trainer.callbacks if isinstance(c, Timer))
prep = model.kernel_preparation
print("RESULT " + json.dumps({
    "compiled": prep.compiled, "finished_at": prep.finished_at, "timer_start": timer.start_time("train"),
    "at_start": watch.at_start, "at_end": watch.at_end, "epochs": trainer.current_epoch,
    "cache_dir": prep.cache_dir,
}))
"""


def _run(code: str, env: dict[str, str], prefix: list[str] | None = None, cwd: Path | None = None) -> dict:
    command = [*(prefix or []), sys.executable, "-c", code]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=cwd)
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line[len("RESULT ") :]), "stderr": out.stderr, "stdout": out.stdout}


@pytest.mark.slow
def test_a_first_run_compiles_before_max_time_starts_counting(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "empty_cache"), "PYTHONPATH": str(ROOT)}
    first = _run(_TIMED_FIT, env)
    assert first["compiled"] >= 1  # the cache was empty: set-up compiled the kernel
    assert first["cache_dir"].startswith(str(tmp_path / "empty_cache"))
    assert first["timer_start"] >= first["finished_at"]  # the Timer started after the compilation ended
    assert first["at_end"] == first["at_start"]  # nothing compiled while the Timer counted
    assert first["epochs"] >= 2  # so max_time bought epochs of training, not one compiling step
    said = first["stdout"] + first["stderr"]
    assert "compiles it once per configuration" in said and "was compiled (once" in said
    again = _run(_TIMED_FIT, env)  # a second run loads what the first one cached
    assert again["compiled"] == 0 and "loaded from the cache" in again["stdout"] + again["stderr"]


_CACHE_PROBE = """
import json
import numpy as np
from lightning_sdp.kernels import cf_numba
cf_numba.project_rows(np.ones((4, 3), np.float32), 1.0)
stats = cf_numba.project_rows.stats
print("RESULT " + json.dumps({
    "module": cf_numba.__file__,
    "cache_dir": cf_numba.cache_dir(), "project_cache": str(stats.cache_path),
    "misses": sum(stats.cache_misses.values()), "hits": sum(stats.cache_hits.values()),
}))
"""


def _read_only_prefix(site: Path) -> list[str] | None:
    """How to run a command with ``site`` read-only: a read-only bind mount in a private mount namespace as root
    (root ignores permissions; the mount ends with the process), else plain permissions; ``None``: neither works."""
    if os.geteuid() != 0:
        for path in [site, *site.rglob("*")]:
            path.chmod(path.stat().st_mode & ~0o222)
        return []
    if shutil.which("unshare") is None:
        return None
    script = f'mount --bind "{site}" "{site}" && mount -o remount,ro,bind "{site}" && exec "$0" "$@"'
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "true"])
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script] if probe.returncode == 0 else None


@pytest.mark.slow
def test_a_read_only_install_caches_the_kernels_in_the_user_cache_folder():
    work = Path(tempfile.mkdtemp(prefix="lightning_sdp_readonly_"))
    try:
        site = work / "site-packages"
        shutil.copytree(ROOT / "lightning_sdp", site / "lightning_sdp", ignore=shutil.ignore_patterns("__pycache__"))
        prefix = _read_only_prefix(site)
        if prefix is None:
            pytest.skip("running as root without a way to mount the package read-only (unshare --mount failed)")
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
        env.update(PYTHONPATH=str(site), HOME=str(work / "home"), XDG_CACHE_HOME=str(work / "user_cache"))
        first = _run(_CACHE_PROBE, env, prefix, cwd=work)  # not the checkout's folder: its package would win
        assert first["module"].startswith(str(site))  # the read-only copy was imported
        assert first["cache_dir"].startswith(str(work / "user_cache" / "numba"))
        assert first["project_cache"].startswith(str(work / "user_cache" / "numba"))
        assert first["misses"] == 1
        assert list((work / "user_cache" / "numba").rglob("*.nbi"))  # numba's cache index files are there
        assert not list(site.rglob("__pycache__"))  # and nothing was written into the package
        second = _run(_CACHE_PROBE, env, prefix, cwd=work)
        assert second["hits"] == 1 and second["misses"] == 0  # a later run loads it from the user folder
    finally:
        for path in [work, *work.rglob("*")]:
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | 0o700)
        shutil.rmtree(work)


def test_the_preparation_says_what_it_did(monkeypatch):
    from lightning_sdp.models.simplex import SimpleXModule, kernel

    said: list[str] = []  # what rank zero would log (the logging set-up of other tests cannot hide it)
    monkeypatch.setattr(kernel, "rank_zero_info", said.append)
    model = SimpleXModule(20, 10, dim=8, num_negatives=4, loss="softmax", grad_clip=0.1, row_norm=1.0)
    model.set_interactions(np.array([0, 2] + [2] * 19), np.array([1, 3]))
    kernel._PREPARED.discard(kernel._specialisation(model))
    done = kernel.prepare_kernels(model)
    assert done is not None and done.seconds > 0 and done.cache_dir
    text = "\n".join(said)
    assert "before training starts" in text and "once per configuration" in text and done.cache_dir in text
    assert f"in {done.seconds:.1f} s" in text
    assert kernel.prepare_kernels(model) is None  # once per process and specialisation
