"""Answers, deltas, error answers and dead letters out to Kafka; each settles its source once acked.

A question with a `reply_topic` gets its deltas and its answer there (keyed by question_id, so in
order on one partition); one without gets them on the deltas and answers topics.

`send()` only queues a record into the producer's batch; a settle task per record waits for the
broker's ack (acks=all) and only then reports the source position as done. Those tasks live in the
publisher's own task group, so leaving `async with Publisher(...)` waits for every ack in flight.

No record stops the loop (consumers/delivery.py `decide` sorts the failures): every answer is cut to
fit `max_request_size` before it is sent (`truncated` says so); a transient failure is sent again
with backoff until `retry_s` after the record's first send (`reply_retry_s` on a caller's reply
topic, then the answer takes the answers topic); a record refused for itself (too large, not
encodable) ends its question another way (an answer becomes an error answer, then a dead letter; a
delta is dropped: the answer carries the text); a reply topic the broker refuses is avoided for
`avoid_s` (its answers take the answers topic). What is left, a failure past its window or a
refusal of the fleet's own topics (answers, dead letters, deltas, questions), raises PublishFailed:
the worker stops, and the source of that record is never settled, so never committed.

An answer finished while a rebalance is under way is decided in a task of its own once the new
assignment is known, so the answers of the partitions this worker keeps are not held up behind it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import anyio
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaTimeoutError, UnknownTopicOrPartitionError
from anyio.streams.memory import MemoryObjectReceiveStream

from consumers import messages as m
from consumers.delivery import (
    DEFAULT_MAX_REQUEST_SIZE,
    SIZE_HEADROOM,
    Next,
    PublishFailed,
    Retries,
    cut_answer,
    decide,
    is_too_large,
    record_size,
    short_error,
)
from consumers.ledger import QuestionLedger
from consumers.messages import Inbound, Outbound, Position
from schemas import SCHEMA_VERSION, AnswerDelta, AnswerEvent, KafkaConfig, encode, error_answer

log = structlog.get_logger("kev.consumers.publisher")

Headers = list[tuple[str, bytes]]
HEADER_DLQ_CUT = "dlq.cut"  # on a dead letter whose value was cut to fit: the original value's size
_MAX_AVOIDED = 1024  # reply topics remembered as refused; the oldest is forgotten first
_LEGAL_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")
_MAX_KEY = 1024  # a dead letter's key beyond this is cut (it is only a copy of the source's)
_ACK_WAIT_S = 1.0  # on revocation, how long the acks in flight are waited for (the rebalance waits too)


@dataclass(frozen=True)
class _Record:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers
    kind: str  # answers | error_answers | deltas | dead_letters | forwarded: the count it adds to
    settles: tuple[Position, ...] = ()
    question_id: str | None = None
    partition: int | None = None
    reply: bool = False  # on a caller's reply topic: a shorter retry window, and a refusal avoids the topic
    timestamp_ms: int | None = None  # None: the producer's clock (a forwarded question keeps its own)
    # What ends the question when this record cannot go: the next record, or None to drop it. No fallback:
    # the worker cannot go on (PublishFailed).
    fallback: Callable[[BaseException], _Record | None] | None = None


class Publisher:
    def __init__(
        self,
        producer: AIOKafkaProducer,
        cfg: KafkaConfig,
        ledger: QuestionLedger,
        on_settled: Callable[[Sequence[Position]], None],
        *,
        max_in_flight: int = 1024,
        max_request_size: int = DEFAULT_MAX_REQUEST_SIZE,  # the producer's: every record is cut to fit it
        retry_s: float = 60.0,  # from a record's first send until the worker gives up on it
        reply_retry_s: float = 15.0,  # the same on a caller's reply topic; then the answers topic instead
        avoid_s: float = 60.0,  # a reply topic the broker refused is not tried again for this long
        ownership=None,  # a RevocationListener: answers of partitions that moved away are left to their new owner
    ) -> None:
        self.producer = producer
        self.cfg = cfg
        self.ledger = ledger
        self.on_settled = on_settled  # positions whose outcome the broker acked
        self.limit = max_request_size - SIZE_HEADROOM
        self.retry_s = retry_s
        self.reply_retry_s = min(reply_retry_s, retry_s)
        self.avoid_s = avoid_s
        self.ownership = ownership
        self.counts = {"answers": 0, "error_answers": 0, "deltas": 0, "dead_letters": 0, "abandoned": 0}
        self._slots = anyio.Semaphore(max_in_flight)
        self._avoided: dict[str, float] = {}  # refused reply topic -> until when its answers take answers_topic
        self._unacked = 0
        self._acked = anyio.Event()
        self._task_group = anyio.create_task_group()

    async def __aenter__(self) -> "Publisher":
        await self._task_group.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        return await self._task_group.__aexit__(*exc)

    async def run(self, answers_in: MemoryObjectReceiveStream[Outbound]) -> None:
        """Publish everything the engine sends until it closes its end."""
        async with answers_in:
            async for outbound in answers_in:
                await self.publish(outbound)

    async def publish(self, outbound: Outbound) -> None:
        source = outbound.source
        match outbound.event:
            case AnswerEvent() as answer:
                await self._answer(answer, source)
            case AnswerDelta() as delta if source.question.stream:
                await self._delta(delta, source)
            case AnswerDelta():
                pass  # the asker did not ask for a stream

    async def quiesce(self, timeout: float = _ACK_WAIT_S) -> None:
        """Wait (bounded) until every record sent so far is acked or has failed."""
        with anyio.move_on_after(timeout):
            while self._unacked:
                await self._acked.wait()

    async def error_answer(self, answer: AnswerEvent, source: Position) -> None:
        """An answer for a question the engine never saw (invalid); settles `source` and its id."""
        await self._send(self._answer_record(self.cfg.answers_topic, answer, "error_answers", (source,),
                                             answer.question_id))

    async def dead_letter(self, value: bytes | None, key: bytes | None, headers: Headers, source: Position,
                          reason: str, message: str) -> None:
        """The raw record, unchanged, plus headers saying why and where it came from."""
        await self._send(self._dead_letter_record(value, key, headers, source, reason, message))

    async def forward(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers, partition: int,
                      source: Position, *, timestamp_ms: int | None = None) -> None:
        """A record re-published to a chosen partition (`kev route`); settles `source` once acked.
        `timestamp_ms`: the source's publish time, which the question's deadline counts from."""
        refused = partial(self._refused_forward, value, key, headers, source)
        await self._send(_Record(topic, key, value, headers, "forwarded", (source,), partition=partition,
                                 timestamp_ms=timestamp_ms, fallback=refused))

    # -- building records ------------------------------------------------------------------------------
    async def _answer(self, answer: AnswerEvent, source: Inbound) -> None:
        ours = self._ours_now(answer, source)
        if ours is None:  # a rebalance is under way: decide when it is over, without holding up the loop
            self._task_group.start_soon(self._answer_after_rebalance, answer, source)
        elif ours:
            await self._publish_answer(answer, source)
        else:
            self._leave_to_new_owner(answer, source)

    async def _answer_after_rebalance(self, answer: AnswerEvent, source: Inbound) -> None:
        if await self._still_ours(answer, source):
            await self._publish_answer(answer, source)
        else:
            self._leave_to_new_owner(answer, source)

    async def _publish_answer(self, answer: AnswerEvent, source: Inbound) -> None:
        topic = self._reply_topic(source.question.reply_topic)
        kind = "error_answers" if answer.finish_reason == "error" else "answers"
        await self._send(self._answer_record(topic, answer, kind, (source.position,), source.question.question_id))

    def _answer_record(self, topic: str, answer: AnswerEvent, kind: str, settles: tuple[Position, ...],
                       question_id: str, *, last_try: bool = False) -> _Record:
        fitted = cut_answer(answer, partial(self._answer_size, topic), self.limit)
        if fitted is None:  # not even its ids fit: nothing can be answered, the DLQ says why
            return self._unanswerable(answer, settles, question_id, "answer_ids_too_large")
        if fitted is not answer:
            log.warning("answer_truncated", question_id=question_id, text_chars=len(answer.text),
                        kept_chars=len(fitted.text), limit=self.limit)
        reply = topic != self.cfg.answers_topic
        fallback = None if last_try else partial(self._refused_answer, topic, answer, kind, settles, question_id)
        return _Record(topic, fitted.question_id.encode(), encode(fitted), _answer_headers(fitted), kind,
                       settles, question_id, reply=reply, fallback=fallback)

    def _answer_size(self, topic: str, answer: AnswerEvent) -> int:
        return record_size(answer.question_id.encode(), encode(answer), _answer_headers(answer))

    def _refused_answer(self, topic: str, answer: AnswerEvent, kind: str, settles: tuple[Position, ...],
                        question_id: str, error: BaseException) -> _Record:
        if topic != self.cfg.answers_topic:  # the reply topic failed: the answer still goes out
            return self._answer_record(self.cfg.answers_topic, answer, kind, settles, question_id)
        code = "answer_too_large" if is_too_large(error) else "answer_unpublishable"
        replacement = error_answer(answer.question_id, answer.request_id, code,
                                   f"the answer could not be published: {short_error(error)}")
        record = self._answer_record(topic, replacement, "error_answers", settles, question_id, last_try=True)
        # Should the error answer be refused too, the question ends in the DLQ.
        return _with_fallback(record, lambda _: self._unanswerable(answer, settles, question_id, code))

    def _unanswerable(self, answer: AnswerEvent, settles: tuple[Position, ...], question_id: str,
                      reason: str) -> _Record:
        source = settles[0]
        message = f"no answer for question {question_id[:200]!r} fits a record of {self.limit} bytes"
        record = self._dead_letter_record(None, question_id.encode()[:_MAX_KEY], [], source, reason, message)
        return _Record(record.topic, record.key, record.value, record.headers, "dead_letters", settles,
                       question_id)

    def _dead_letter_record(self, value: bytes | None, key: bytes | None, headers: Headers, source: Position,
                            reason: str, message: str) -> _Record:
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
        return _Record(self.cfg.dlq_topic, key, value, full, "dead_letters", (source,))

    def _refused_forward(self, value, key, headers: Headers, source: Position, error: BaseException) -> _Record:
        return self._dead_letter_record(value, key, headers, source, "forward_failed", short_error(error))

    async def _delta(self, delta: AnswerDelta, source: Inbound) -> None:
        topic = self._reply_topic(source.question.reply_topic)
        topic = self.cfg.deltas_topic if topic == self.cfg.answers_topic else topic
        await self._send(self._delta_record(topic, delta, source.question.request_id))

    def _delta_record(self, topic: str, delta: AnswerDelta, request_id: str | None) -> _Record:
        headers = _headers(delta.question_id, request_id)
        if topic == self.cfg.deltas_topic:
            fallback = self._dropped_delta
        else:
            def fallback(_error: BaseException) -> _Record:
                return self._delta_record(self.cfg.deltas_topic, delta, request_id)
        return _Record(topic, delta.question_id.encode(), encode(delta), headers, "deltas",
                       reply=topic != self.cfg.deltas_topic, fallback=fallback)

    @staticmethod
    def _dropped_delta(error: BaseException) -> None:
        return None  # a delta is a preview: its answer still carries the whole text

    def _avoid(self, topic: str) -> None:
        self._avoided.pop(topic, None)
        while len(self._avoided) >= _MAX_AVOIDED:
            del self._avoided[next(iter(self._avoided))]
        self._avoided[topic] = anyio.current_time() + self.avoid_s

    def _is_avoided(self, topic: str) -> bool:
        until = self._avoided.get(topic)
        if until is not None and until <= anyio.current_time():
            del self._avoided[topic]  # the topic may have been created or allowed since: try it again
            return False
        return until is not None

    def _reply_topic(self, requested: str | None) -> str:
        if requested is None or requested == self.cfg.answers_topic:
            return self.cfg.answers_topic
        if not _LEGAL_TOPIC.fullmatch(requested) or self._is_avoided(requested):
            # aiokafka would retry an illegal name's metadata for request_timeout_ms (40 s) first.
            log.warning("reply_topic_unusable", topic=requested[:300])
            return self.cfg.answers_topic
        return requested

    def _ours_now(self, answer: AnswerEvent, source: Inbound) -> bool | None:
        """Whether the source's partition (or any redelivery's) is still this worker's; None while a
        rebalance is under way. Not ours: its new owner answers it from the last commit, so publishing
        here too would be a duplicate."""
        if self.ownership is None:
            return True
        verdicts = [self.ownership.owns_now(p.partition_key) for p in self._positions(answer, source)]
        return True if True in verdicts else None if None in verdicts else False

    async def _still_ours(self, answer: AnswerEvent, source: Inbound) -> bool:
        """`_ours_now`, waiting (bounded) for a rebalance to end."""
        for position in self._positions(answer, source):
            if await self.ownership.owns(position.partition_key):
                return True
        return False

    def _positions(self, answer: AnswerEvent, source: Inbound) -> tuple[Position, ...]:
        return source.position, *self.ledger.waiting(answer.question_id)

    def _leave_to_new_owner(self, answer: AnswerEvent, source: Inbound) -> None:
        self.ledger.abandon(answer.question_id)
        self.counts["abandoned"] += 1
        log.info("answer_left_to_new_owner", question_id=answer.question_id, source_partition=source.partition,
                 source_offset=source.offset)

    # -- sending and settling --------------------------------------------------------------------------
    async def _send(self, record: _Record) -> None:
        """Queue the record (in call order, so one question's deltas precede its answer); a task settles it."""
        await self._slots.acquire()
        retries = Retries(self.retry_s)  # the window counts from here, the first send
        try:
            pending = await self._try_send(record, retries.left(self._window(record)))
        except BaseException:
            self._slots.release()
            raise
        self._unacked += 1
        self._task_group.start_soon(self._settle, record, pending, retries)

    async def _try_send(self, record: _Record, within_s: float | None) -> asyncio.Future | Exception:
        """The ack's future, or the error. send() itself can wait request_timeout_ms for a topic's
        metadata (in the publish loop, for a first send): given up after `within_s` (cancelled there,
        nothing was queued)."""
        try:
            with anyio.fail_after(within_s):
                return await self.producer.send(record.topic, value=record.value, key=record.key,
                                                headers=record.headers, partition=record.partition,
                                                timestamp_ms=record.timestamp_ms)
        except TimeoutError:
            if self.producer.client.cluster.partitions_for_topic(record.topic) is None:
                return UnknownTopicOrPartitionError(f"no metadata for topic {record.topic[:300]!r} "
                                                    f"within {within_s:.1f}s")
            return KafkaTimeoutError(f"not queued within {within_s:.1f}s")
        except Exception as error:  # noqa: BLE001 - sorted in _deliver, like a failed ack
            return error

    async def _settle(self, record: _Record, pending: asyncio.Future | Exception, retries: Retries) -> None:
        try:
            delivered = await self._deliver(record, pending, retries)
        finally:
            self._slots.release()
            self._unacked -= 1
            self._acked.set()
            self._acked = anyio.Event()
        if delivered is None:
            return
        record, metadata = delivered
        self.counts[record.kind] = self.counts.get(record.kind, 0) + 1  # "forwarded" appears only in kev route
        settles = list(record.settles)
        if record.question_id is not None:
            settles += self.ledger.finish(record.question_id)
        if settles:
            self.on_settled(settles)
            source = settles[0]
            log.info("published", kind=record.kind, topic=record.topic, partition=metadata.partition,
                     offset=metadata.offset, question_id=record.question_id, source_partition=source.partition,
                     source_offset=source.offset)

    async def _deliver(self, record: _Record, pending: asyncio.Future | Exception, retries: Retries):
        """(the record acked, its metadata), or None when it was dropped; raises PublishFailed. One
        window (`retries`) for the record and what replaces it: the question's, from its first send."""
        first_of_fallback = False
        while True:
            try:
                return record, await self._ack(record, pending, retries, bounded=not first_of_fallback)
            except Exception as error:  # noqa: BLE001 - every failure is sorted below
                following = self._after_failure(record, error, retries)
            if following is None:
                return None
            first_of_fallback = following is not record
            if following is record:
                await retries.wait(self._window(record))
            record = following
            pending = await self._try_send(record, None if first_of_fallback or record.reply else retries.left())

    async def _ack(self, record: _Record, pending: asyncio.Future | Exception, retries: Retries, *, bounded: bool):
        """The broker's ack. Waited for within the record's window, except on a reply topic (given up
        there, it could still arrive after its fallback: the answer twice) and for the first try of
        a record replacing a refused one (its own try, bounded by request_timeout_ms)."""
        if isinstance(pending, Exception):
            raise pending
        if record.reply or not bounded:
            return await pending
        with anyio.move_on_after(retries.left()):
            return await asyncio.shield(pending)  # not cancelled: aiokafka still owns the record
        raise KafkaTimeoutError(f"no ack within {self.retry_s:g}s of the first send")

    def _window(self, record: _Record) -> float:
        return self.reply_retry_s if record.reply else self.retry_s

    def _after_failure(self, record: _Record, error: Exception, retries: Retries) -> _Record | None:
        """The record to send next (the same one to retry it), or None to drop it; raises PublishFailed."""
        step = decide(error, reply=record.reply, exhausted=retries.exhausted(self._window(record)),
                      own_timestamp=record.timestamp_ms is not None)
        if step is Next.RETRY:
            log.warning("publish_retrying", kind=record.kind, topic=record.topic[:300], question_id=record.question_id,
                        attempt=retries.attempts + 1, error=short_error(error))
            return record
        if step is Next.AVOID_TOPIC:
            self._avoid(record.topic)
        if step is not Next.FAIL and record.fallback is not None:
            log.warning("publish_refused", kind=record.kind, topic=record.topic[:300], question_id=record.question_id,
                        error=short_error(error), topic_avoided_s=self.avoid_s if step is Next.AVOID_TOPIC else 0)
            return record.fallback(error)
        raise PublishFailed(f"cannot publish {record.kind} to topic {record.topic[:300]!r} "
                            f"({retries.elapsed():.1f}s after its first send, {retries.attempts} retries): "
                            f"{short_error(error)}") from error


def _with_fallback(record: _Record, fallback: Callable[[BaseException], _Record | None]) -> _Record:
    return dataclasses.replace(record, fallback=fallback)


def _answer_headers(answer: AnswerEvent) -> Headers:
    return _headers(answer.question_id, answer.request_id)


def _headers(question_id: str, request_id: str | None) -> Headers:
    headers = [(m.HEADER_SCHEMA, str(SCHEMA_VERSION).encode()), (m.HEADER_CONTENT_TYPE, m.CONTENT_TYPE_JSON),
               (m.HEADER_QUESTION_ID, question_id.encode())]
    if request_id is not None:
        headers.append((m.HEADER_REQUEST_ID, request_id.encode()))
    return headers
