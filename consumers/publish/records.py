"""The records the publisher sends, each cut to fit the producer's size limit, each carrying what ends
its question should the broker refuse it (its fallback).

Every answer is cut to fit `max_request_size` (`truncated` says so) and carries its asker's principal
in a header. One refused for itself (too large, not encodable) becomes an error answer on the same
topic, then a dead letter. An answer a caller's reply topic cannot take (refused, unreachable until
the question's deadline) is never sent to another topic, which a different principal may read: it
becomes a dead letter on the operator's topic holding the answer's metadata without its text, token
ids or cached prompt tokens (`reply_topic_unwritable`). A delta that cannot go is dropped: the answer
carries the text. A dead letter too large to park whole keeps its reasons and as much of the value as
fits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import msgspec
import structlog

from consumers import messages as m
from consumers.publish.delivery import cut_answer, is_own_fault, is_too_large, record_size, short_error
from consumers.messages import Position, QuestionKey
from schemas import SCHEMA_VERSION, AnswerDelta, AnswerEvent, Audit, KafkaConfig, encode, error_answer

log = structlog.get_logger("kev.consumers.publish.publisher")  # the publisher's lines, whichever of its modules writes them

Headers = list[tuple[str, bytes]]
HEADER_DLQ_CUT = "dlq.cut"  # on a dead letter whose value was cut to fit: the original value's size
_MAX_KEY = 1024  # a dead letter's key beyond this is cut (it is only a copy of the source's)


@dataclass(frozen=True)
class Record:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers
    kind: str  # answers | error_answers | deltas | dead_letters | forwarded: the count it adds to
    settles: tuple[Position, ...] = ()
    question_id: str | None = None  # for the log lines
    finishes: QuestionKey | None = None  # the question it answers: acked, the ledger marks it answered
    partition: int | None = None
    reply: bool = False  # on a caller's reply topic: its window is the question's, a refusal avoids the topic
    window_s: float | None = None  # how long it may be retried from its first send; None: the fleet's window
    timestamp_ms: int | None = None  # None: the producer's clock (a forwarded question keeps its own)
    # What ends the question when this record cannot go: the next record, or None to drop it. No fallback:
    # the worker cannot go on (PublishFailed).
    fallback: Callable[[BaseException], Record | None] | None = None


class RecordBuilder:
    """Records for one fleet's topics (`cfg`), each within `limit` bytes."""

    def __init__(self, cfg: KafkaConfig, limit: int) -> None:
        self.cfg = cfg
        self.limit = limit

    def answer(self, topic: str, answer: AnswerEvent, kind: str, settles: tuple[Position, ...], question_id: str,
               *, finishes: QuestionKey | None, window_s: float | None = None, last_try: bool = False) -> Record:
        fitted = cut_answer(answer, _answer_size, self.limit)
        if fitted is None:  # not even its ids fit: nothing can be answered, the DLQ says why
            return self._unanswerable(answer, settles, question_id, finishes, "answer_ids_too_large")
        if fitted is not answer:
            log.warning("answer_truncated", question_id=question_id, text_chars=len(answer.text),
                        kept_chars=len(fitted.text), limit=self.limit)
        fallback = None if last_try else partial(self._refused_answer, topic, answer, kind, settles, question_id,
                                                 finishes, window_s)
        return Record(topic, fitted.question_id.encode(), encode(fitted), _answer_headers(fitted), kind,
                      settles, question_id, finishes, reply=topic != self.cfg.answers_topic, window_s=window_s,
                      fallback=fallback)

    def dead_letter(self, value: bytes | None, key: bytes | None, headers: Headers, source: Position,
                    reason: str, message: str) -> Record:
        """The raw record, unchanged, plus headers saying why and where it came from."""
        why = [(m.HEADER_DLQ_REASON, reason.encode()), (m.HEADER_DLQ_MESSAGE, message.encode()[:1000]),
               (m.HEADER_DLQ_TOPIC, source.topic.encode()),
               (m.HEADER_DLQ_PARTITION, str(source.partition).encode()),
               (m.HEADER_DLQ_OFFSET, str(source.offset).encode())]
        full = [*headers, *why]
        if record_size(key, value, full) > self.limit:
            # Too large to park whole: keep the reasons and as much of the value as fits.
            key = key[:_MAX_KEY] if key else key
            full = [*why, (HEADER_DLQ_CUT, str(len(value or b"")).encode())]
            room = self.limit - record_size(key, b"", full)
            value = value[:max(0, room)] if value is not None else None
            if key is None and value is None:
                value = b""
        return Record(self.cfg.dlq_topic, key, value, full, "dead_letters", (source,))

    def forward(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers, partition: int,
                source: Position, timestamp_ms: int | None) -> Record:
        """A question re-published to a chosen partition; refused, it becomes a dead letter."""
        refused = partial(self._refused_forward, value, key, headers, source)
        return Record(topic, key, value, headers, "forwarded", (source,), partition=partition,
                      timestamp_ms=timestamp_ms, fallback=refused)

    def delta(self, topic: str, delta: AnswerDelta, request_id: str | None, principal: str,
              window_s: float | None = None) -> Record:
        """A delta; one that cannot go is dropped (on a reply topic, never sent to the shared deltas topic)."""
        return Record(topic, delta.question_id.encode(), encode(delta), _headers(delta.question_id, request_id,
                                                                                 principal),
                      "deltas", question_id=delta.question_id, reply=topic != self.cfg.deltas_topic,
                      window_s=window_s, fallback=_dropped_delta)

    def _refused_answer(self, topic: str, answer: AnswerEvent, kind: str, settles: tuple[Position, ...],
                        question_id: str, finishes: QuestionKey | None, window_s: float | None,
                        error: BaseException) -> Record:
        if topic != self.cfg.answers_topic and not is_own_fault(error):
            return self._unwritable_reply(topic, answer, settles, question_id, finishes, error)
        # The answer itself was refused: its error answer goes where the answer was going.
        code = "answer_too_large" if is_too_large(error) else "answer_unpublishable"
        replacement = error_answer(answer.question_id, answer.request_id, code,
                                   f"the answer could not be published: {short_error(error)}")
        replacement = msgspec.structs.replace(replacement, audit=Audit(principal=answer.audit.principal,
                                                                       attempt=answer.audit.attempt))
        record = self.answer(topic, replacement, "error_answers", settles, question_id, finishes=finishes,
                             window_s=window_s, last_try=True)
        # Should the error answer be refused too, the question ends in the DLQ.
        return _with_fallback(record, lambda _: self._unanswerable(answer, settles, question_id, finishes, code))

    def _unwritable_reply(self, topic: str, answer: AnswerEvent, settles: tuple[Position, ...], question_id: str,
                          finishes: QuestionKey | None, error: BaseException) -> Record:
        """A dead letter for the operator: whose answer, to which question, why; never what it said."""
        metadata = _without_content(answer)
        message = f"reply topic {topic[:300]!r} could not take the answer: {short_error(error)}"
        record = self.dead_letter(encode(metadata), question_id.encode()[:_MAX_KEY],
                                  [*_answer_headers(metadata), (m.HEADER_DLQ_REPLY_TOPIC, topic.encode())],
                                  settles[0], "reply_topic_unwritable", message)
        return dataclasses.replace(record, settles=settles, question_id=question_id, finishes=finishes)

    def _unanswerable(self, answer: AnswerEvent, settles: tuple[Position, ...], question_id: str,
                      finishes: QuestionKey | None, reason: str) -> Record:
        source = settles[0]
        message = f"no answer for question {question_id[:200]!r} fits a record of {self.limit} bytes"
        record = self.dead_letter(None, question_id.encode()[:_MAX_KEY], [], source, reason, message)
        return dataclasses.replace(record, settles=settles, question_id=question_id, finishes=finishes)

    def _refused_forward(self, value, key, headers: Headers, source: Position, error: BaseException) -> Record:
        return self.dead_letter(value, key, headers, source, "forward_failed", short_error(error))


def _dropped_delta(error: BaseException) -> None:
    return None  # a delta is a preview: its answer still carries the whole text


def _with_fallback(record: Record, fallback: Callable[[BaseException], Record | None]) -> Record:
    return dataclasses.replace(record, fallback=fallback)


def _without_content(answer: AnswerEvent) -> AnswerEvent:
    """The answer less everything it says: its text, its tokens, and how much of its prompt was cached
    (a count that tells about other questions of its tenant)."""
    return msgspec.structs.replace(
        answer, text="", token_ids=(), usage=msgspec.structs.replace(answer.usage, cached_prompt_tokens=0),
        audit=msgspec.structs.replace(answer.audit, cached_prompt_tokens=0))


def _answer_size(answer: AnswerEvent) -> int:
    return record_size(answer.question_id.encode(), encode(answer), _answer_headers(answer))


def _answer_headers(answer: AnswerEvent) -> Headers:
    return _headers(answer.question_id, answer.request_id, answer.audit.principal)


def _headers(question_id: str, request_id: str | None, principal: str) -> Headers:
    headers = [(m.HEADER_SCHEMA, str(SCHEMA_VERSION).encode()), (m.HEADER_CONTENT_TYPE, m.CONTENT_TYPE_JSON),
               (m.HEADER_QUESTION_ID, question_id.encode())]
    if request_id is not None:
        headers.append((m.HEADER_REQUEST_ID, request_id.encode()))
    if principal:  # every answer the publisher sends has one; a record built elsewhere may not
        headers.append((m.HEADER_PRINCIPAL, principal.encode()))
    return headers
