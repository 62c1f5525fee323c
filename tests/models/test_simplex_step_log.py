"""SimpleXModule's training statistics: summed between Lightning's logging steps, logged as window means."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_sdp.datamodules.interactions import InteractionsDataModule
from lightning_sdp.models.simplex import SimpleXModule
from lightning_sdp.models.simplex.step_log import StepLogWindow
from lightning_sdp.plugins.heat import HEATAccelerator

_SMALL = {"num_negatives": 8, "negative_weight": 10.0, "margin": 0.5, "dim": 16, "max_history": 20}


def test_window_means_are_weighted_by_positives_and_reset():
    rng = np.random.default_rng(0)
    window = StepLogWindow()
    losses, sizes, seconds = rng.random(5), rng.integers(1, 100, 5), rng.random(5) + 0.1
    for loss, size, sec, lr in zip(losses, sizes, seconds, [0.5, 0.4, 0.3, 0.2, 0.1], strict=True):
        window.add_loss(float(loss), int(size), lr)
        window.add_batch(int(size), float(sec))
    stats = window.flush()
    assert stats["train/loss"] == pytest.approx(float((losses * sizes).sum() / sizes.sum()))
    assert stats["train/positives_per_sec"] == pytest.approx(float(sizes.sum() / seconds.sum()))
    assert stats["train/lr"] == 0.1  # the last step's rate, not a mean
    assert window.flush() == {}  # reset: nothing is logged twice
    window.add_batch(10, 0.5)  # the reference backend records no loss here (it logs its own per step)
    assert window.flush() == {"train/positives_per_sec": 20.0}
    assert math.isnan(window.lr)


class _RecordLosses(Callback):
    """The per-sample mean loss of every fused step (what the window sums), read from the returned losses."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.sizes: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        window = pl_module.log_window
        # before the module flushes (callbacks run before the module's hook), the window holds this step's loss
        self.losses.append(window.loss_sum)
        self.sizes.append(window.loss_positives)


@pytest.mark.numba
def test_fused_module_logs_window_means_on_logging_steps_and_the_last_step(tmp_path):
    dm = InteractionsDataModule(num_users=120, num_items=80, batch_size=64, eval_batch_size=64, seed=0)
    dm.setup()
    model = SimpleXModule(lr=0.2, lr_schedule="linear", **_SMALL)
    record = _RecordLosses()
    steps = 7
    assert len(dm.train_dataloader()) > steps  # one epoch: no end-of-epoch flush in between
    trainer = Trainer(
        accelerator=HEATAccelerator(num_threads=1),
        devices=1,
        max_steps=steps,
        max_epochs=-1,
        log_every_n_steps=3,
        logger=CSVLogger(tmp_path, name="log"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=[record],
    )
    calls: list[str] = []
    original = model.log

    def counting_log(name, *args, **kwargs):
        calls.append(name)
        return original(name, *args, **kwargs)

    model.log = counting_log  # type: ignore[method-assign]
    trainer.fit(model, dm)
    # three statistics on steps 3 and 6 (log_every_n_steps) and on the last one (7), not three per step
    assert len(calls) == 9, calls
    # the window sums since the last flush (after steps 3 and 6, checked below): undo the sums into per-step losses
    per_step, sizes, previous = [], [], (0.0, 0)
    for step, (total, size) in enumerate(zip(record.losses, record.sizes, strict=True), start=1):
        per_step.append((total - previous[0]) / (size - previous[1]))
        sizes.append(size - previous[1])
        previous = (0.0, 0) if step in (3, 6) else (total, size)
    expected_last = np.average(per_step[6:7], weights=sizes[6:7])
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(expected_last, rel=1e-5)
    rows = list(csv.DictReader(open(next(tmp_path.glob("log/*/metrics.csv")))))
    logged = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    assert sorted(logged) == [2, 5]  # CSVLogger's step is 0-based: steps 3 and 6
    assert logged[5] == pytest.approx(np.average(per_step[3:6], weights=sizes[3:6]), rel=1e-5)
    assert logged[2] == pytest.approx(np.average(per_step[0:3], weights=sizes[0:3]), rel=1e-5)
    lr = trainer.callback_metrics["train/lr"].item()
    assert lr == pytest.approx(0.2 * (1 - (steps - 1) / steps), rel=1e-5)  # the rate the last step used
    assert trainer.callback_metrics["train/positives_per_sec"].item() > 0
