"""Cancels that arrive before their question, remembered for a while."""

from __future__ import annotations

import time
from collections import OrderedDict


class EarlyCancels:
    """Cancels that came before their question: a gateway's cancel on kev.control can overtake the
    question itself when this worker's kev.questions partition lags. Remembered for `ttl_s` (at most
    `limit` ids, oldest forgotten first), so the question is cancelled the moment it arrives instead of
    being answered to nobody. Every worker hears every cancel; the ones that never get the question
    just forget it."""

    def __init__(self, limit: int = 4096, ttl_s: float = 60.0) -> None:
        self.limit, self.ttl_s = limit, ttl_s
        self._ids: OrderedDict[str, float] = OrderedDict()
        # A cancel that comes after the answer (the asker gave up a moment too late) is not early: a
        # retry under the same id must not be cancelled by it.
        self._answered: OrderedDict[str, None] = OrderedDict()

    def remember(self, question_id: str) -> None:
        if question_id in self._answered:
            return
        self._ids[question_id] = time.monotonic() + self.ttl_s
        self._ids.move_to_end(question_id)
        _trim(self._ids, self.limit)

    def answered(self, question_id: str) -> None:
        self._answered[question_id] = None
        self._answered.move_to_end(question_id)
        _trim(self._answered, self.limit)

    def take(self, question_id: str) -> bool:
        """True (once) when this question was cancelled before it arrived, within the last ttl_s."""
        expires = self._ids.pop(question_id, None)
        return expires is not None and expires >= time.monotonic()


def _trim(ids: OrderedDict, limit: int) -> None:
    while len(ids) > limit:
        ids.popitem(last=False)
