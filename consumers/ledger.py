"""One answer per question_id per worker: redeliveries wait for, or reuse, the first answer.

A redelivered record (after a rebalance, or a producer retry) whose question_id is still being
answered is not sent to the engine again; its offset is settled when the first answer is acked.
One whose question_id was answered recently is settled at once. "Recently" is a bounded LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from enum import Enum

from consumers.messages import Position


class Admission(Enum):
    NEW = "new"  # first sighting: answer it
    IN_FLIGHT = "in_flight"  # being answered: its position settles with that answer
    ANSWERED = "answered"  # answered recently: settle its position now, answer nothing


class QuestionLedger:
    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._answered: OrderedDict[str, None] = OrderedDict()
        self._in_flight: dict[str, list[Position]] = {}

    def admit(self, question_id: str, position: Position) -> Admission:
        if question_id in self._in_flight:
            self._in_flight[question_id].append(position)
            return Admission.IN_FLIGHT
        if question_id in self._answered:
            self._answered.move_to_end(question_id)
            return Admission.ANSWERED
        self._in_flight[question_id] = []
        return Admission.NEW

    def finish(self, question_id: str) -> list[Position]:
        """The question's answer was acked; returns the redeliveries' positions that it settles."""
        waiting = self._in_flight.pop(question_id, [])
        self._answered[question_id] = None
        self._answered.move_to_end(question_id)
        while len(self._answered) > self.capacity:
            self._answered.popitem(last=False)
        return waiting

    def waiting(self, question_id: str) -> list[Position]:
        """The redeliveries of an in-flight question that wait on its answer."""
        return list(self._in_flight.get(question_id, ()))

    def abandon(self, question_id: str) -> None:
        """Forget a question this worker will not answer (its partition moved to another worker, with its
        redeliveries), so a later redelivery here is answered afresh."""
        self._in_flight.pop(question_id, None)

    def in_flight(self) -> int:
        return len(self._in_flight)

    def answered(self) -> int:
        return len(self._answered)
