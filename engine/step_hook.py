"""What may watch each step from beside it: a hook sees every forward and every question that ended,
on the device thread, and changes nothing (the isolation audit, the batch-size metric, a benchmark's
counts). EngineCore.step calls each one; without hooks a step does nothing more."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from engine.sequence import Sequence
from engine.step_plan import StepPlan


class StepHook(Protocol):
    def forward(self, number: int, plan: StepPlan, out) -> None:
        """After forward `number` ran `plan` (`out`: the runner's StepOutput)."""

    def ended(self, finished: list[Sequence]) -> None:
        """After a step, with the questions it ended (often none)."""


class BatchSizes:
    """Calls `observe(questions in the forward)` after each forward: the metrics' batch-size histogram."""

    def __init__(self, observe: Callable[[int], None]) -> None:
        self.observe = observe

    def forward(self, number: int, plan: StepPlan, out) -> None:
        self.observe(len(plan.chunks))

    def ended(self, finished: list[Sequence]) -> None:
        pass
