"""One answer per question per worker: redeliveries wait for, or reuse, the first answer.

A question is keyed by who asked, its question_id and its sample (`QuestionKey`), and remembered with
a digest of its record's value. So a record is a duplicate only when the same principal sends the same
id with the same bytes (a redelivery after a rebalance, a producer retry); another principal's record
under that id is another question (an unsigned record cannot take a tenant's id), and the same
principal's record under that id with other bytes is a conflict: its asker is told, and the first
question is left as it was.

A redelivery whose question is still being answered is not sent to the engine again; its offset is
settled when the first answer is acked. One whose question was answered recently is settled at once.
"Recently" is a bounded LRU.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from enum import Enum

from consumers.messages import Position, QuestionKey


class Admission(Enum):
    NEW = "new"  # first sighting: answer it
    IN_FLIGHT = "in_flight"  # being answered: its position settles with that answer
    ANSWERED = "answered"  # answered recently: settle its position now, answer nothing
    CONFLICT = "conflict"  # the key is taken by other bytes: tell the asker, leave the first one be


def digest(value: bytes | None) -> bytes:
    """What tells a redelivery (the same bytes) from another question under the same id."""
    return hashlib.sha256(value or b"").digest()[:16]


class QuestionLedger:
    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._answered: OrderedDict[QuestionKey, bytes] = OrderedDict()  # -> its digest
        self._in_flight: dict[QuestionKey, tuple[bytes, list[Position]]] = {}  # -> its digest, its redeliveries

    def admit(self, key: QuestionKey, value_digest: bytes, position: Position) -> Admission:
        if key in self._in_flight:
            first, waiting = self._in_flight[key]
            if first != value_digest:
                return Admission.CONFLICT
            waiting.append(position)
            return Admission.IN_FLIGHT
        if key in self._answered:
            self._answered.move_to_end(key)
            return Admission.ANSWERED if self._answered[key] == value_digest else Admission.CONFLICT
        self._in_flight[key] = (value_digest, [])
        return Admission.NEW

    def finish(self, key: QuestionKey) -> list[Position]:
        """The question's answer was acked; returns the redeliveries' positions that it settles."""
        value_digest, waiting = self._in_flight.pop(key, (None, []))
        if value_digest is None:  # not in flight (abandoned meanwhile): only a known digest is remembered
            return waiting
        self._answered[key] = value_digest
        self._answered.move_to_end(key)
        while len(self._answered) > self.capacity:
            self._answered.popitem(last=False)
        return waiting

    def waiting(self, key: QuestionKey) -> list[Position]:
        """The redeliveries of an in-flight question that wait on its answer."""
        in_flight = self._in_flight.get(key)
        return list(in_flight[1]) if in_flight else []

    def abandon(self, key: QuestionKey) -> None:
        """Forget a question this worker will not answer (its partition moved to another worker, with its
        redeliveries), so a later redelivery here is answered afresh."""
        self._in_flight.pop(key, None)

    def in_flight(self) -> int:
        return len(self._in_flight)

    def answered(self) -> int:
        return len(self._answered)
