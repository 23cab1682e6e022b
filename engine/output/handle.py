"""Handle: what an async caller holds for a submitted question: its streamed deltas, then its answer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from schemas import AnswerDelta, AnswerEvent, QuestionEvent


@dataclass(eq=False)
class Handle:
    """A submitted question: its streamed deltas so far and, once it ends, its answer."""

    question: QuestionEvent
    deltas: list[AnswerDelta] = field(default_factory=list)
    answer: AnswerEvent | None = None
    cancelling: bool = False  # a cancel is on its way; the answer (finish_reason "cancelled") follows
    _changed: anyio.Event = field(default_factory=anyio.Event)

    @property
    def question_id(self) -> str:
        return self.question.question_id

    async def wait(self, timeout: float | None = None) -> AnswerEvent:
        """The answer, once the question has ended (TimeoutError after `timeout` seconds)."""
        with anyio.fail_after(timeout):
            while self.answer is None:
                await self._changed.wait()
        return self.answer

    async def stream(self) -> AsyncIterator[AnswerDelta]:
        """Every delta, from the first, as it comes; the last has done=True."""
        sent = 0
        while True:
            while sent < len(self.deltas):
                sent += 1
                yield self.deltas[sent - 1]
            if self.answer is not None:
                return
            await self._changed.wait()

    def add_text(self, text: str) -> None:
        """The next streamed piece of the answer's text; waiters learn of it at `_notify`."""
        self.deltas.append(AnswerDelta(self.question_id, len(self.deltas), text))

    def end(self, answer: AnswerEvent) -> None:
        """Hold the answer; the last delta carries what was held back (a possible stop string, an
        unfinished character)."""
        self.answer = answer
        tail = answer.text[sum(len(d.text) for d in self.deltas):]
        self.deltas.append(AnswerDelta(answer.question_id, len(self.deltas), tail, done=True))

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
