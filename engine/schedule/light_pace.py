"""Pacing backlogged principals beside a light one (policy fair).

A light principal has questions decoding and none waiting: it asks for no more channels than it holds.
Its streams wait for every step, and on a CPU every row makes a step dearer: beside a flood's 26
decoding rows, a light principal's 6 get each token about 2.5 times later than alone. So while a light
principal is served less than a backlogged one (questions waiting), the backlogged principals served
more than it get rows in a step only while these add at most PACE - 1 of what the step's other rows
cost (measured forwards, StepCost): the light streams keep at least 1/PACE of their pace alone. Each
backlogged principal keeps one row a step, so none starves; where a row costs little beside a step's
fixed part (a GPU), nobody is held back. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.schedule.step_cost import StepCost
from engine.sequence import Sequence
from engine.step_plan import chunk_keys
from schemas.principal import Principal

PACE = 1.5  # a light stream's step costs at most this times what its own rows (and the uncapped) cost


class LightPace:
    """One step's allowance for the rows of backlogged principals served more than a light one."""

    def __init__(self, costs: StepCost, counters: Mapping[Principal, float], running: list[Sequence],
                 waiting: list[Sequence]) -> None:
        self.costs = costs
        self.capped = _capped(counters, running, waiting) if costs.ready else set()
        self.rows: dict[Principal, int] = {}
        self.left = 0.0
        if self.capped:
            uncapped = [s for s in running if s.principal not in self.capped]
            self.left = (PACE - 1) * (costs.seconds(0, 0) + sum(self._row_cost(s) for s in uncapped))

    def allows(self, seq: Sequence) -> bool:
        """Whether `seq` may have a row in this step; if so, its cost is taken from the allowance."""
        if seq.principal not in self.capped:
            return True
        cost = self._row_cost(seq)
        if cost > self.left and self.rows.get(seq.principal):
            return False
        self.left -= cost
        self.rows[seq.principal] = self.rows.get(seq.principal, 0) + 1
        return True

    def _row_cost(self, seq: Sequence) -> float:
        """What one more row of `seq` adds to a step: a row, and the keys it reads."""
        return self.costs.seconds(1, chunk_keys(seq.num_computed_tokens, 1)) - self.costs.seconds(0, 0)


def _capped(counters: Mapping[Principal, float], running: list[Sequence], waiting: list[Sequence]) -> set[Principal]:
    """Backlogged principals served more than the least-served light one (none without a light one)."""
    backlogged = {s.principal for s in waiting}
    light = [counters.get(s.principal, 0.0) for s in running if s.decoding and s.principal not in backlogged]
    if not light:
        return set()
    return {p for p in backlogged if counters.get(p, 0.0) > min(light)}
