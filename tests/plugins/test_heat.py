"""HEATAccelerator: alias, thread setting and restoring, affinity, precision, device stats."""

from __future__ import annotations

import os

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

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        import numba

        self.seen = {"torch": torch.get_num_threads(), "numba": numba.get_num_threads(), "affinity": os.sched_getaffinity(0)}
        self.seen["autocast"] = torch.is_autocast_enabled("cpu")
        return self.layer(batch[0]).sum()

    def train_dataloader(self):  # noqa: ANN201
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(accelerator, **kw) -> tuple[Trainer, _Probe]:  # noqa: ANN001
    model = _Probe()
    trainer = Trainer(
        accelerator=accelerator, devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kw,
    )
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
def test_threads_are_set_for_the_run_and_restored():
    import numba

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


def test_mixed_precision_becomes_cpu_bf16_autocast():
    trainer, model = _fit("heat", precision="bf16-mixed")
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, MixedPrecision) and plugin.device == "cpu"
    assert model.seen["autocast"] is True


def test_device_stats_report_threads_and_core_use():
    acc = HEATAccelerator(num_threads=1)
    acc.setup_device(torch.device("cpu"))
    try:
        sum(i * i for i in range(200_000))
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
    torch.set_num_threads(available_cores())
    model = _Probe()
    trainer = Trainer(
        accelerator="heat", devices=world_size, strategy="ddp", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model)
    return {"torch": int(model.seen["torch"]), "numba": int(model.seen["numba"]), "cores": available_cores()}


@pytest.mark.numba
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
def test_numba_pool_start_up_keeps_torch_thread_count():
    from tests._distributed import run_distributed

    (seen,) = run_distributed(_fresh_process_threads, 1, init_group=False, timeout=120)
    assert seen == {"torch": 1, "numba": 1}
