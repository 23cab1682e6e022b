"""A question's several answers (params.n, one per sample) on their way out: gathered until all are in, and
its source position done only once every one of their records is acked."""

from __future__ import annotations

from collections.abc import Sequence

from consumers.messages import Inbound, Position
from schemas import AnswerEvent


class Samples:
    """A question's answers, one per sample (params.n), gathered by attempt until all are in, and the positions
    whose samples' records are not all acked yet (the position is done at the last)."""

    def __init__(self) -> None:
        self._gathering: dict[str, list[AnswerEvent]] = {}  # attempt -> its answers so far
        self._left: dict[Position, int] = {}  # position -> its samples' records not acked yet

    def gather(self, answer: AnswerEvent, source: Inbound) -> list[AnswerEvent] | None:
        """The question's answers, by index, once this one completes them; None while some are missing."""
        n = source.question.params.n
        if n == 1:
            return [answer]
        got = self._gathering.setdefault(source.attempt, [])
        if all(a.index != answer.index for a in got):  # a sample answered twice (an engine failure): the first
            got.append(answer)
        if len(got) < n:
            return None
        del self._gathering[source.attempt]
        return sorted(got, key=lambda a: a.index)

    @property
    def gathering(self) -> int:
        """Samples held for questions whose other samples have not come yet."""
        return sum(len(got) for got in self._gathering.values())

    def settling(self, position: Position, records: int) -> None:
        if records > 1:
            self._left[position] = records

    def settled(self, positions: Sequence[Position]) -> list[Position]:
        done = []
        for position in positions:
            left = self._left.get(position)
            if left is None:
                done.append(position)
            elif left > 1:
                self._left[position] = left - 1
            else:
                del self._left[position]
                done.append(position)
        return done
