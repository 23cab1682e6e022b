"""Request: one `kev.Engine.submit` — its questions in slots 0..n-1 and their answers as they come.

Answers are recorded on the engine's event-loop thread and read on the caller's; each record is one
list store and one append, so a reader sees a consistent prefix without a lock.
"""

from __future__ import annotations

from concurrent.futures import Future

from kev.result import Result
from schemas import AnswerEvent, QuestionEvent

AGGREGATOR_MODES = ("slot_map", "seq_append", "priority")  # aggregator.mode


class Request:
    def __init__(self, request_id: str, questions: tuple[QuestionEvent, ...]) -> None:
        self.request_id = request_id
        self.questions = questions
        self.answers: list[AnswerEvent | None] = [None] * len(questions)
        self.finished: list[int] = []  # slots, in the order their answers came
        self.future: Future | None = None  # the portal task feeding them to the engine

    def record(self, slot: int, answer: AnswerEvent) -> None:
        self.answers[slot] = answer
        self.finished.append(slot)

    def missing(self) -> list[int]:
        return [slot for slot, answer in enumerate(self.answers) if answer is None]

    def results(self, mode: str) -> list[Result]:
        """Every answer so far, ordered as `aggregator.mode` says: slot_map as submitted, seq_append as they
        finished, priority highest first (then as submitted)."""
        if mode == "seq_append":
            slots = list(self.finished)
        elif mode == "priority":
            slots = sorted(range(len(self.questions)), key=lambda slot: -self.questions[slot].priority)
        else:
            slots = range(len(self.questions))
        return [Result.of(self.answers[slot], slot) for slot in slots if self.answers[slot] is not None]


class WaitTimeout(TimeoutError):
    """`wait` ran out of time: which queries have no result yet (the request goes on; wait again or close)."""

    def __init__(self, request: Request, timeout: float | None, mode: str) -> None:
        self.request_id = request.request_id
        self.missing = tuple(request.missing())
        self.results = request.results(mode)  # those that did come, in the aggregator's order
        shown = ", ".join(f"{slot} ({_preview(request.questions[slot])})" for slot in self.missing[:8])
        more = f" and {len(self.missing) - 8} more" if len(self.missing) > 8 else ""
        super().__init__(f"request {self.request_id}: {len(self.missing)} of {len(request.questions)} results "
                         f"missing after {timeout:g} s: slots {shown}{more}; it goes on: wait again, or close() "
                         f"the engine to cancel it")


def _preview(question: QuestionEvent) -> str:
    """A glimpse of which query it was: the start of its prompt (or of its last message)."""
    text = question.prompt if question.prompt is not None else question.messages[-1].content if question.messages \
        else ""
    return repr(text if len(text) <= 30 else text[:27] + "...")
