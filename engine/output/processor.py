"""OutputProcessor: from the tokens a step drew to text deltas, and from an ended question to its answer.

EngineCore hands it each step's new tokens and each finished sequence; it keeps, per question in
flight, the question as asked and its text stream. It never touches the scheduler: the questions
whose text ended them (a stop string, a token that cannot be decoded) go back to EngineCore to finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.output.answers import finished_answer
from engine.output.detokenizer import TextStream
from engine.sequence import Sequence, Status
from schemas import AnswerEvent, QuestionEvent


Ending = tuple[Sequence, Status]  # a question to finish now, and how it ended


@dataclass(frozen=True)
class TokenDelta:
    question_id: str
    token_id: int
    text: str  # newly settled text (may be empty while a character or stop string is pending)


@dataclass
class StepEvents:
    deltas: list[TokenDelta] = field(default_factory=list)
    answers: list[AnswerEvent] = field(default_factory=list)  # questions that ended this step


class OutputProcessor:
    """Per question in flight: the question and its TextStream, from `track` until `answer`."""

    def __init__(self, tokenizer, worker: str):
        self.tokenizer = tokenizer
        self.worker = worker  # named in every answer's audit
        self._questions: dict[str, QuestionEvent] = {}
        self._streams: dict[str, TextStream] = {}

    def __contains__(self, question_id: str) -> bool:
        return question_id in self._questions

    def track(self, question: QuestionEvent, seq: Sequence) -> None:
        self._questions[seq.question_id] = question
        self._streams[seq.question_id] = TextStream(self.tokenizer, seq.params.stop)

    def detokenize(self, new_tokens: list[tuple[Sequence, int]]) -> tuple[list[TokenDelta], list[Ending]]:
        """Each new token's settled text, and the questions its text ended, to finish this step."""
        deltas, ended = [], []
        failed: set[str] = set()
        for seq, token in new_tokens:
            stream = self._streams[seq.question_id]
            if stream.stopped or seq.question_id in failed:
                continue  # a step that emitted several tokens (drafts): none after the one that ended it
            try:
                deltas.append(TokenDelta(seq.question_id, token, stream.push(token)))
            except Exception as exc:  # this question's failure is its own: the batch goes on
                seq.error = f"detokenizing failed: {exc}"
                ended.append((seq, Status.ERROR))
                failed.add(seq.question_id)
                continue
            if stream.stopped and seq.status == Status.LENGTH:  # ended by both on one token: the stop string counts
                seq.status = Status.STOPPED
            elif stream.stopped:  # a stop string ended it: its blocks are freed this very step
                ended.append((seq, Status.STOPPED))
        return deltas, ended

    def answer(self, seq: Sequence) -> AnswerEvent:
        """The finished question's answer; the processor forgets it."""
        question, stream = self._questions.pop(seq.question_id), self._streams.pop(seq.question_id)
        stream.finish()
        return finished_answer(question, seq, stream, self.worker)
