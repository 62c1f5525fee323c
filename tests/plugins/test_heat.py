"""HEATAccelerator: alias, thread setting and restoring, affinity, precision, device stats."""

from __future__ import annotations

import os
import time

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

import lightning_sdp
from lightning_sdp.plugins.heat import HEATAccelerator, available_cores


class _Probe(LightningModule):
    """Records the thread counts seen inside training."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen: dict[str, object] = {}

    def training_step(self, batch, batch_idx):
        import numba

        self.seen = {
            "torch": torch.get_num_threads(),
            "numba": numba.get_num_threads(),
            "affinity": os.sched_getaffinity(0),
        }
        self.seen["autocast"] = torch.is_autocast_enabled("cpu")
        return self.layer(batch[0]).sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(accelerator, **kw) -> Trainer:
    """A quiet one-step Trainer on one device."""
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return Trainer(accelerator=accelerator, devices=1, max_steps=1, **quiet, **kw)


def _fit(accelerator, **kw) -> tuple[Trainer, _Probe]:
    model = _Probe()
    trainer = _trainer(accelerator, **kw)
    trainer.fit(model)
    return trainer, model


def test_alias_is_registered():
    assert lightning_sdp.HEATAccelerator is HEATAccelerator
    assert "heat" in AcceleratorRegistry
    trainer = Trainer(accelerator="heat", devices=1, logger=False)
    assert isinstance(trainer.accelerator, HEATAccelerator)
    assert type(trainer.precision_plugin) is Precision  # 32-true by default
    assert HEATAccelerator.name() == "heat"


@pytest.mark.numba
def test_threads_are_set_for_the_run_and_restored(monkeypatch):
    import numba

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # tests/conftest.py sets it to 1 for the suite
    torch.set_num_threads(2)
    numba.set_num_threads(2)
    _, model = _fit(HEATAccelerator(num_threads=1))
    assert model.seen["torch"] == 1 and model.seen["numba"] == 1
    assert torch.get_num_threads() == 2 and numba.get_num_threads() == 2
    _, model = _fit("heat")
    assert model.seen["torch"] == available_cores() == model.seen["numba"]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity")
def test_affinity_is_set_and_restored():
    before = os.sched_getaffinity(0)
    cpu = min(before)
    _, model = _fit(HEATAccelerator(cpu_affinity=[cpu]))
    assert model.seen["affinity"] == {cpu} and model.seen["torch"] == 1
    assert os.sched_getaffinity(0) == before


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_threads must be positive"):
        HEATAccelerator(num_threads=0)
    with pytest.raises(ValueError, match="may not use"):
        HEATAccelerator(cpu_affinity=[10_000])


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_gpu_autocast_plugin_is_refused_with_the_plugin_to_pass(precision):
    # Lightning builds MixedPrecision(..., "cuda") for a custom accelerator string; HEAT says what to pass instead
    with pytest.raises(ValueError, match=r"plugins=\[MixedPrecision\('bf16-mixed', 'cpu'\)\]"):
        _fit("heat", precision=precision)


def test_cpu_bf16_autocast_plugin_is_used_as_given():
    plugin = MixedPrecision("bf16-mixed", "cpu")
    trainer, model = _fit("heat", plugins=[plugin])
    assert trainer.strategy.precision_plugin is plugin  # never replaced behind the user's back
    assert model.seen["autocast"] is True


def test_device_stats_report_threads_and_core_use():
    acc = HEATAccelerator(num_threads=1)
    acc.setup_device(torch.device("cpu"))
    try:
        # busy for a few kernel ticks (10 ms each), so that /proc/stat's counters move
        deadline = time.perf_counter() + 0.05
        while time.perf_counter() < deadline:
            sum(i * i for i in range(10_000))
        stats = acc.get_device_stats(torch.device("cpu"))
    finally:
        acc.teardown()
    assert stats["heat_threads"] == 1 and stats["torch_threads"] == 1
    per_core = {k: v for k, v in stats.items() if k.startswith("cpu") and k.endswith("_percent")}
    if os.path.exists("/proc/stat"):
        assert per_core and all(0.0 <= v <= 100.0 for v in per_core.values())


def _ddp_heat_threads(rank: int, world_size: int) -> dict[str, int]:
    # Lightning's own launcher does not export LOCAL_WORLD_SIZE: the split must come from the Trainer
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    os.environ.pop("OMP_NUM_THREADS", None)  # the suite's 1 would win over the split (and a launcher sets cores // N)
    torch.set_num_threads(available_cores())
    model = _Probe()
    trainer = Trainer(
        accelerator="heat",
        devices=world_size,
        strategy="ddp",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    return {"torch": int(model.seen["torch"]), "numba": int(model.seen["numba"]), "cores": available_cores()}


@pytest.mark.numba
@pytest.mark.slow
def test_ddp_splits_the_cores_among_local_processes():
    from tests._distributed import run_distributed

    results = run_distributed(_ddp_heat_threads, 2, init_group=False, timeout=180)
    for r in results:
        expected = max(1, r["cores"] // 2)
        assert r["torch"] == expected and r["numba"] == expected, results


def _fresh_process_threads(rank: int, world_size: int) -> dict[str, int]:
    import numba

    torch.set_num_threads(available_cores())
    acc = HEATAccelerator(num_threads=1)
    acc.setup_device(torch.device("cpu"))  # first numba call of this process: starts numba's thread pool
    try:
        return {"torch": torch.get_num_threads(), "numba": numba.get_num_threads()}
    finally:
        acc.teardown()


@pytest.mark.numba
@pytest.mark.slow
def test_numba_pool_start_up_keeps_torch_thread_count():
    from tests._distributed import run_distributed

    (seen,) = run_distributed(_fresh_process_threads, 1, init_group=False, timeout=120)
    assert seen == {"torch": 1, "numba": 1}


class _ResetsThreadsInSetup(_Probe):
    """Stands for anything in the setup hooks that resets torch's count (a thread pool's start-up, an import)."""

    def setup(self, stage: str) -> None:
        torch.set_num_threads(3)


def test_thread_count_holds_through_the_setup_hooks():
    torch.set_num_threads(2)
    model = _ResetsThreadsInSetup()
    trainer = Trainer(
        accelerator=HEATAccelerator(num_threads=1),
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    assert model.seen["torch"] == 1
    assert torch.get_num_threads() == 2  # restored


def _two_reference_runs(rank: int, world_size: int) -> dict[str, object]:
    """Fresh process (numba's pool not started yet): two SimpleX reference runs on HEATAccelerator(num_threads=1)."""
    from lightning.pytorch import Callback, seed_everything

    from lightning_sdp.datamodules.interactions import InteractionsDataModule
    from lightning_sdp.models import SimpleXModule

    class _Threads(Callback):
        def __init__(self) -> None:
            self.seen: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.seen.append(torch.get_num_threads())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.seen.append(torch.get_num_threads())

    torch.set_num_threads(max(2, available_cores()))  # what a fresh process has, and what numba's start-up sets
    weights, seen = [], []
    for _ in range(2):
        seed_everything(0, verbose=False)
        dm = InteractionsDataModule(num_users=60, num_items=40, batch_size=128, seed=0)
        model = SimpleXModule(g=0.8, backend="reference", dim=8, num_negatives=4, lr=0.05, seed=0)
        threads = _Threads()
        trainer = Trainer(
            accelerator=HEATAccelerator(num_threads=1),
            devices=1,
            max_epochs=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[threads],
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        trainer.fit(model, dm)
        weights.append([p.detach().numpy().copy() for p in model.parameters()])
        seen.append(threads.seen)
    return {"weights": weights, "seen": seen}


@pytest.mark.numba
@pytest.mark.slow
def test_reference_runs_keep_num_threads_and_are_bit_identical():
    import numpy as np

    from tests._distributed import run_distributed

    (out,) = run_distributed(_two_reference_runs, 1, init_group=False, timeout=240)
    first, second = out["weights"]
    assert all(s and set(s) == {1} for s in out["seen"]), out["seen"]
    assert len(first) == len(second) > 0
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------- OMP_NUM_THREADS
@pytest.mark.numba
def test_omp_num_threads_is_used_unless_num_threads_is_given(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(1)
    _, model = _fit("heat")
    assert model.seen["torch"] == 2 == model.seen["numba"]
    assert torch.get_num_threads() == 1  # restored
    _, model = _fit(HEATAccelerator(num_threads=1))  # an explicit count wins
    assert model.seen["torch"] == 1 == model.seen["numba"]


def test_omp_num_threads_counts_the_threads_of_one_process(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two processes on this machine, as torchrun announces them
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert HEATAccelerator().resolved_threads() == 3  # not divided among the processes
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # OpenMP's per-level list: the outer level's count
    assert HEATAccelerator().resolved_threads() == 4
    assert HEATAccelerator(num_threads=5).resolved_threads() == 5
    for unset in ("", " "):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert HEATAccelerator().resolved_threads() == max(1, available_cores() // 2)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert HEATAccelerator().resolved_threads() == max(1, available_cores() // 2)
    assert HEATAccelerator(cpu_affinity=[min(os.sched_getaffinity(0))]).resolved_threads() == 1


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_a_bad_omp_num_threads_is_refused_with_what_to_set(monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert HEATAccelerator(num_threads=2).resolved_threads() == 2  # not read when num_threads is given
    with pytest.raises(ValueError, match=rf"OMP_NUM_THREADS='{value}' is not a positive integer.*num_threads"):
        _fit("heat")


# ---------------------------------------------------------------------------------------------- other modules
def test_a_module_other_than_simplex_is_warned_once_that_only_threads_are_set():
    trainer = _trainer(HEATAccelerator(num_threads=1))
    with pytest.warns(UserWarning, match=r"_Probe is not a SimpleXModule.*only sets the thread count \(1 per") as seen:
        for _ in range(2):  # each fit sets the accelerator up again
            trainer.fit(_Probe())
    assert len([w for w in seen if "is not a SimpleXModule" in str(w.message)]) == 1
    assert "accelerator='cpu'" in str(seen[0].message)


@pytest.mark.numba
def test_simplex_modules_are_not_warned(recwarn):
    from lightning_sdp.datamodules.interactions import InteractionsDataModule
    from lightning_sdp.models import SimpleXModule

    class _MySimpleX(SimpleXModule):  # a subclass is a SimpleXModule too
        pass

    for model in (SimpleXModule(dim=8, num_negatives=4), _MySimpleX(dim=8, num_negatives=4, backend="reference")):
        trainer = _trainer(HEATAccelerator(num_threads=1), limit_val_batches=0)
        trainer.fit(model, InteractionsDataModule(num_users=40, num_items=30, batch_size=64))
    assert not [w for w in recwarn if "is not a SimpleXModule" in str(w.message)]
