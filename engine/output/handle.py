"""Handle: what an async caller holds for a submitted question: its streamed deltas, then its answer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from schemas import AnswerDelta, AnswerEvent, QuestionEvent


@dataclass(eq=False)
class Handle:
    """A submitted question: its streamed deltas so far and, once it ends, its answer (with params.n > 1, its
    n answers, one per sample: `answer` is sample 0's once every sample has ended, `answers` all of them)."""

    question: QuestionEvent
    deltas: list[AnswerDelta] = field(default_factory=list)
    answer: AnswerEvent | None = None
    answers: list[AnswerEvent] = field(default_factory=list)  # the samples' answers as they end
    cancelling: bool = False  # a cancel is on its way; the answer (finish_reason "cancelled") follows
    _changed: anyio.Event = field(default_factory=anyio.Event)
    _seqs: dict[int, int] = field(default_factory=dict)  # sample -> its deltas so far
    _texts: dict[int, int] = field(default_factory=dict)  # sample -> characters its deltas carried
    _logprobs: dict[int, int] = field(default_factory=dict)  # sample -> logprobs its deltas carried

    @property
    def question_id(self) -> str:
        return self.question.question_id

    @property
    def complete(self) -> bool:
        """Every sample has its answer."""
        return len(self.answers) >= self.question.params.n

    async def wait(self, timeout: float | None = None) -> AnswerEvent:
        """The answer (sample 0's), once the question has ended (TimeoutError after `timeout` seconds)."""
        with anyio.fail_after(timeout):
            while self.answer is None:
                await self._changed.wait()
        return self.answer

    async def wait_all(self, timeout: float | None = None) -> list[AnswerEvent]:
        """Every sample's answer, by index, once all have ended."""
        await self.wait(timeout)
        return sorted(self.answers, key=lambda answer: answer.index)

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

    def add_text(self, text: str, index: int = 0, logprobs: tuple | None = None) -> None:
        """The next streamed piece of sample `index`'s text; waiters learn of it at `_notify`."""
        self.deltas.append(AnswerDelta(self.question_id, self._next_seq(index), text, index=index, logprobs=logprobs))
        self._texts[index] = self._texts.get(index, 0) + len(text)
        self._logprobs[index] = self._logprobs.get(index, 0) + len(logprobs or ())

    def end(self, answer: AnswerEvent) -> None:
        """Hold a sample's answer; its last delta carries what was held back (a possible stop string, an
        unfinished character, their logprobs). The question's `answer` is set once every sample ended."""
        index = answer.index
        tail = answer.text[self._texts.get(index, 0):]
        logprobs = None if answer.logprobs is None else answer.logprobs[self._logprobs.get(index, 0):]
        self.deltas.append(AnswerDelta(answer.question_id, self._next_seq(index), tail, done=True, index=index,
                                       logprobs=logprobs))
        self.answers.append(answer)
        if self.complete:
            self.answer = min(self.answers, key=lambda a: a.index)

    def _next_seq(self, index: int) -> int:
        seq = self._seqs.get(index, 0)
        self._seqs[index] = seq + 1
        return seq

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
