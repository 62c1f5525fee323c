"""How a budget splits between the search and the final fit, re-estimated from what every fit measures."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from lightning_sdp.recipes.clocks import _FitClock


def shape_key(config: dict[str, Any]) -> str:
    """The part of a configuration that sets the cost of a step (``dim`` and ``num_negatives``), as a key."""
    return f"d{config['dim']}_n{config['num_negatives']}"


@dataclass
class BudgetPlan:
    """The budget of :func:`~lightning_sdp.recipes.fit_simplex_within_budget` and the costs measured against it.

    A seconds budget sizes each trial and the final fit from the measured time of a step of each shape, the
    Trainer's set-up per fit and one validation scoring; every fit replaces the estimates it measured. An epoch
    budget counts steps and needs none of them.

    Args:
        budget_seconds: wall-clock budget, or ``None`` for an epoch budget.
        search_fraction: share of the budget the search may spend.
        total_steps: the whole epoch budget in steps (``0`` for a seconds budget).
        start: ``time.perf_counter()`` when the budget's clock started.
        step_seconds: seconds per training step of each shape measured so far (:func:`shape_key`).
        overhead: the Trainer's set-up and tear-down per fit; a guess until the first fit measures it.
        eval_seconds: one validation scoring of the search's user sample; a guess until it is measured.
    """

    budget_seconds: float | None
    search_fraction: float
    total_steps: int = 0
    start: float = field(default_factory=time.perf_counter)
    step_seconds: dict[str, float] = field(default_factory=dict)
    overhead: float = 0.5
    eval_seconds: float = 1.0

    @classmethod
    def create(
        cls, budget_seconds: float | None, budget_epochs: float | None, search_fraction: float, steps_per_epoch: int
    ) -> BudgetPlan:
        """A plan whose clock starts now; an epoch budget is turned into steps (at least one)."""
        total = 0 if budget_epochs is None else max(1, round(budget_epochs * steps_per_epoch))
        return cls(budget_seconds, search_fraction, total)

    @property
    def timed(self) -> bool:
        """Whether the budget is wall-clock seconds (else epochs)."""
        return self.budget_seconds is not None

    @property
    def search_seconds(self) -> float:
        """The search's share of a seconds budget."""
        return (self.budget_seconds or 0.0) * self.search_fraction

    @property
    def search_steps(self) -> int:
        """The search's share of an epoch budget, in steps."""
        return int(self.total_steps * self.search_fraction)

    def elapsed(self) -> float:
        """Seconds since the budget's clock started."""
        return time.perf_counter() - self.start

    def search_left(self) -> float:
        """Seconds of the search's share still unspent (negative once overspent)."""
        return self.search_seconds - self.elapsed()

    def knows(self, config: dict[str, Any]) -> bool:
        """Whether the step time of ``config``'s shape has been measured."""
        return shape_key(config) in self.step_seconds

    def step_time(self, config: dict[str, Any]) -> float:
        """Measured seconds per step of ``config``'s shape."""
        return self.step_seconds[shape_key(config)]

    def record_fit(
        self, config: dict[str, Any], clock: _FitClock, fit_seconds: float, steps: int | None = None
    ) -> None:
        """Take the Trainer's overhead and ``config``'s step time from a fit of ``steps`` steps (``None``: a probe,
        timed between the first and the last batch's ends)."""
        self.overhead = max(0.0, fit_seconds - clock.train_seconds)
        per_step = clock.seconds_per_step if steps is None else clock.train_seconds / steps
        self.step_seconds[shape_key(config)] = per_step

    def trial_steps(self, config: dict[str, Any], seconds: float) -> int:
        """Steps of a trial given ``seconds``: its share less the Trainer's set-up and the validation scoring."""
        return int((seconds - self.overhead - self.eval_seconds) / self.step_time(config))

    def final_steps(self, config: dict[str, Any]) -> float:
        """The final fit's planned length in steps (the horizon the search extrapolates its trials to)."""
        if self.budget_seconds is None:
            return float(self.total_steps - self.search_steps)
        return self.budget_seconds * (1.0 - self.search_fraction) / self.step_time(config)

    def final_cycles(self, config: dict[str, Any], cycles: int) -> tuple[list[int], list[float | None]]:
        """Steps and seconds of each of the final fit's ``cycles`` (doubling in length: 1 : 2 : 4 ...).

        A seconds budget gives each cycle a share of the time left (the schedule runs on the clock, so the steps
        are counted afterwards: ``-1`` here); an epoch budget gives each a share of the steps left.

        Raises:
            ValueError: what is left cannot train a step per cycle.
        """
        weights = [2**i for i in range(cycles)]
        if self.budget_seconds is None:
            max_steps = self.total_steps - self.search_steps
            steps = [max_steps * w // sum(weights) for w in weights]
            steps[-1] += max_steps - sum(steps)
            if min(steps) < 1:
                raise ValueError(
                    f"fit_simplex_within_budget: {max_steps} steps cannot make {cycles} restart cycles; lower cycles "
                    "or raise the budget."
                )
            return steps, [None] * cycles
        left = self.budget_seconds - self.elapsed()
        step = self.step_time(config)
        # the schedule runs on the clock (the step time drifts as training goes on), so the margin only covers the
        # Trainer's set-up, one step past the end and a scoring per restart cycle
        train_time = (left - cycles * self.overhead - (cycles - 1) * self.eval_seconds) * 0.98 - step
        if train_time <= step * cycles:
            raise ValueError(
                f"fit_simplex_within_budget: the budget of {self.budget_seconds:g}s leaves {left:.2f}s after the "
                f"probe and search, less than one step ({step:.3f}s) plus the Trainer's set-up ({self.overhead:.2f}s); "
                "raise budget_seconds, lower search_fraction or lower batch_size."
            )
        return [-1] * cycles, [train_time * w / sum(weights) for w in weights]
