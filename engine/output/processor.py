"""OutputProcessor: from the tokens a step drew to text deltas, and from an ended question to its answer.

EngineCore hands it each step's new tokens and each finished sequence; it keeps, per question in
flight, the question as asked and its text stream. It never touches the scheduler: the questions
whose text ended them (a stop string, a token that cannot be decoded) go back to EngineCore to finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.output.answers import finished_answer
from engine.output.detokenizer import TextStream
from engine.output.logprobs import TokenTexts
from engine.sequence import Sequence, Status
from schemas import AnswerEvent, QuestionEvent


Ending = tuple[Sequence, Status]  # a question to finish now, and how it ended


@dataclass(frozen=True)
class TokenDelta:
    question_id: str
    token_id: int
    text: str  # newly settled text (may be empty while a character or stop string is pending)
    index: int = 0  # the sample (params.n)
    # params.logprobs: those of the tokens whose text this delta settles (with text only, so each once)
    logprobs: tuple | None = None


@dataclass
class StepEvents:
    deltas: list[TokenDelta] = field(default_factory=list)
    answers: list[AnswerEvent] = field(default_factory=list)  # questions that ended this step


class OutputProcessor:
    """Per sample in flight (a question has params.n, each its own Sequence): the question and its TextStream,
    from `track` until `answer`."""

    def __init__(self, tokenizer, worker: str):
        self.tokenizer = tokenizer
        self.worker = worker  # named in every answer's audit
        self._questions: dict[str, QuestionEvent] = {}
        self._streams: dict[str, TextStream] = {}
        self._samples: dict[str, list[str]] = {}  # question id -> its samples' names, while any is in flight
        self._logprobs_sent: dict[str, int] = {}  # sample name -> logprobs handed out in deltas
        self.texts = TokenTexts(tokenizer)

    def __contains__(self, question_id: str) -> bool:
        return question_id in self._questions

    def track(self, question: QuestionEvent, seq: Sequence) -> None:
        self._questions[seq.question_id] = question
        self._streams[seq.question_id] = TextStream(self.tokenizer, seq.params.stop)
        self._samples.setdefault(question.question_id, []).append(seq.question_id)
        self._logprobs_sent[seq.question_id] = 0

    def samples_of(self, question_id: str) -> list[str]:
        """The names of the question's samples still in flight."""
        return list(self._samples.get(question_id, ()))

    def forget(self, seq: Sequence) -> None:
        """Stop tracking a sample that will have no answer (taken back before it ran)."""
        question = self._questions.pop(seq.question_id, None)
        self._streams.pop(seq.question_id, None)
        self._logprobs_sent.pop(seq.question_id, None)
        if question is not None:
            self._untrack(question.question_id, seq.question_id)

    def _untrack(self, question_id: str, name: str) -> None:
        names = self._samples.get(question_id, [])
        if name in names:
            names.remove(name)
        if not names:
            self._samples.pop(question_id, None)

    def detokenize(self, new_tokens: list[tuple[Sequence, int]]) -> tuple[list[TokenDelta], list[Ending]]:
        """Each new token's settled text, and the questions its text ended, to finish this step."""
        deltas, ended = [], []
        failed: set[str] = set()
        for seq, token in new_tokens:
            stream = self._streams[seq.question_id]
            if stream.stopped or seq.question_id in failed:
                continue  # a step that emitted several tokens (drafts): none after the one that ended it
            try:
                text = stream.push(token)
                deltas.append(TokenDelta(self._questions[seq.question_id].question_id, token, text, seq.sample,
                                         self._settled_logprobs(seq, len(stream.ids)) if text else None))
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

    def _settled_logprobs(self, seq: Sequence, pushed: int) -> tuple | None:
        """The wire logprobs of the sample's tokens up to `pushed` not handed out yet; None if it did not ask."""
        if seq.logprobs is None:
            return None
        sent = self._logprobs_sent[seq.question_id]
        self._logprobs_sent[seq.question_id] = max(sent, pushed)
        return self.texts.wire(seq.logprobs[sent:pushed])

    def answer(self, seq: Sequence) -> AnswerEvent:
        """The finished sample's answer; the processor forgets it."""
        question, stream = self._questions.pop(seq.question_id), self._streams.pop(seq.question_id)
        self._logprobs_sent.pop(seq.question_id, None)
        self._untrack(question.question_id, seq.question_id)
        stream.finish()
        return finished_answer(question, seq, stream, self.worker, self.texts)
