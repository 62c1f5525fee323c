"""Short fused SimpleX fits through the Trainer on one training split: what every trial and the final fit run."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import numpy as np
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lightning_sdp.datamodules.interactions import PositivePairs
from lightning_sdp.datamodules.sampling import EpochSeededBatchSampler
from lightning_sdp.models.simplex import SimpleXConfig, SimpleXModule
from lightning_sdp.models.simplex.auto import InteractionStats
from lightning_sdp.plugins.heat import HEATAccelerator
from lightning_sdp.recipes.clocks import _FitClock, _WallClockLinearDecay

#: Settings shared by every configuration (unit-norm rows make a row's step ``lr`` whatever its norm).
BASE_SETTINGS: dict[str, Any] = {"g": 1.0, "optimizer": "sgd", "row_norm": 1.0, "init_std": 0.1, "max_history": 100}


def default_batch_size(num_positives: int) -> int:
    """Positives per step when none is given: ``clip(num_positives // 64, 1024, 16384)``."""
    return int(np.clip(num_positives // 64, 1024, 16384))


class SimpleXRunner:
    """Builds and trains fused SimpleX models on one training CSR with a fixed batch size and thread count.

    Args:
        train: training CSR ``(indptr, indices)``.
        num_items: number of items.
        batch_size: positives per step.
        threads: threads for torch and the kernel; ``None``: ``OMP_NUM_THREADS`` when it is set, else every core.
        seed: seed of the models and the shuffles.
        model_kwargs: fixed :class:`SimpleXModule` arguments under every configuration.
    """

    def __init__(
        self,
        train: tuple[np.ndarray, np.ndarray],
        num_items: int,
        batch_size: int,
        threads: int | None,
        seed: int,
        model_kwargs: dict[str, Any],
    ) -> None:
        self.train, self.num_items, self.batch_size = train, num_items, batch_size
        self.threads, self.seed, self.model_kwargs = threads, seed, model_kwargs
        self.num_users = len(train[0]) - 1
        self.pairs = PositivePairs.from_csr(*train)
        self.steps_per_epoch = math.ceil(len(self.pairs) / batch_size)
        self.stats = InteractionStats.from_csr(*train, num_items)

    def model(self, config: dict[str, Any], lr_schedule: Literal["constant", "linear"] = "linear") -> SimpleXModule:
        """A fresh fused model of ``config`` (over :data:`BASE_SETTINGS` and ``model_kwargs``) on the training CSR."""
        settings = {**BASE_SETTINGS, **self.model_kwargs, **config}
        # "auto" arguments resolved here once for the runner's data, not by every trial's model (and its log line)
        resolved = SimpleXConfig(**settings).with_data(self.stats)
        settings.update({name: getattr(resolved, name) for name in ("loss", "grad_clip")})
        if settings.get("sampler") is None:  # HEAT's tile sampler pays off only when the tile is a small share
            settings["sampler"] = "tile" if self.num_items >= 8 * 512 else "uniform"
        model = SimpleXModule(
            self.num_users, self.num_items, backend="fused", lr_schedule=lr_schedule, seed=self.seed, **settings
        )
        model.set_interactions(*self.train)
        return model

    def fit(
        self,
        config: dict[str, Any],
        steps: int,
        max_seconds: float | None = None,
        init: SimpleXModule | None = None,
        cycle: int = 0,
        seconds: float | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> tuple[SimpleXModule, _FitClock, float]:
        """Train ``config`` for ``steps`` steps (the linear decay reaches 0 at the last one), or for ``seconds``.

        ``max_seconds`` is a guard (Lightning's ``max_time``) against a step-time estimate gone wrong; a fit it cuts
        ends before its schedule does, which the returned clock's ``final_lr`` shows. ``init`` warm-starts the new
        model from another one's weights and sampler state (a warm restart, ``init`` is left unchanged); ``cycle``
        numbers the restart so that it sees a new data order. With ``seconds`` the rate decays linearly with the
        training time instead of the step count (:class:`_WallClockLinearDecay`) and the fit stops when it reaches
        0; ``steps`` is then only a cap. ``callbacks`` are added to the fit's own.

        Returns:
            ``(model, clock, fit_seconds)``: the trained model, the fit's :class:`_FitClock` and the wall time of
            ``Trainer.fit`` (set-up and tear-down included).
        """
        model = self.model(config, lr_schedule="linear" if seconds is None else "constant")
        if init is not None:
            model.load_state_dict(init.state_dict())
        clock = _FitClock()
        # the decay sets the rate before the clock reads it, so the clock's final_lr is the rate after the last step
        own: list[Callback] = [clock] if seconds is None else [_WallClockLinearDecay(seconds), clock]
        order = EpochSeededBatchSampler(len(self.pairs), self.batch_size, self.seed + 1_000_003 * cycle)
        loader = DataLoader(self.pairs, batch_size=None, sampler=order)
        trainer = Trainer(
            accelerator=HEATAccelerator(num_threads=self.threads),
            devices=1,
            max_steps=steps,
            max_epochs=-1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[*own, *callbacks],
            max_time=None if max_seconds is None else timedelta(seconds=max(1.0, max_seconds)),
        )
        start = time.perf_counter()
        trainer.fit(model, train_dataloaders=loader)
        return model, clock, time.perf_counter() - start

    def fit_for_seconds(self, config: dict[str, Any], seconds: float) -> tuple[SimpleXModule, int, float, float]:
        """Train ``config`` with a linear schedule sized (from a probe) to end within ``seconds`` of training.

        Returns:
            ``(model, steps, train_seconds, final_lr)``.

        Raises:
            ValueError: ``seconds`` is shorter than one training step.
        """
        steps = int(seconds * 0.95 / self.probe(config))
        if steps < 1:
            raise ValueError(f"SimpleXRunner: {seconds}s is shorter than one training step; raise the budget.")
        model, clock, _ = self.fit(config, steps)
        return model, steps, clock.train_seconds, clock.final_lr

    def probe(self, config: dict[str, Any], steps: int = 6) -> float:
        """Seconds per training step of ``config`` through the Trainer (kernel and Lightning's per-step cost).

        Measured between the ends of the first and the last of ``steps`` batches (the first one warms up).
        """
        _, clock, _ = self.fit(config, max(2, steps))
        return clock.seconds_per_step
