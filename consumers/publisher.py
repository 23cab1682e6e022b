"""Answers, deltas, error answers and dead letters out to Kafka; each settles its source once acked.

A question with a `reply_topic` gets its deltas and its answer there (keyed by question_id, so in
order on one partition); one without gets them on the deltas and answers topics.

`send()` only queues a record into the producer's batch; a settle task per record waits for the
broker's ack (acks=all) and only then reports the source position as done. Those tasks live in the
publisher's own task group, so leaving `async with Publisher(...)` waits for every ack in flight.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence

import anyio
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from anyio.streams.memory import MemoryObjectReceiveStream

from consumers import messages as m
from consumers.ledger import QuestionLedger
from consumers.messages import Inbound, Outbound, Position
from schemas import SCHEMA_VERSION, AnswerDelta, AnswerEvent, KafkaConfig, encode, error_answer

log = structlog.get_logger("kev.consumers.publisher")

Headers = list[tuple[str, bytes]]
_MAX_UNWRITABLE = 1024
_LEGAL_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


class Publisher:
    def __init__(
        self,
        producer: AIOKafkaProducer,
        cfg: KafkaConfig,
        ledger: QuestionLedger,
        on_settled: Callable[[Sequence[Position]], None],
        *,
        max_in_flight: int = 1024,
    ) -> None:
        self.producer = producer
        self.cfg = cfg
        self.ledger = ledger
        self.on_settled = on_settled  # positions whose outcome the broker acked
        self.counts = {"answers": 0, "error_answers": 0, "deltas": 0, "dead_letters": 0}
        self._slots = anyio.Semaphore(max_in_flight)
        self._unwritable: set[str] = set()  # reply topics that failed: answer on answers_topic instead
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

    async def error_answer(self, answer: AnswerEvent, source: Position) -> None:
        """An answer for a question the engine never saw (invalid); settles `source` and its id."""
        headers = _headers(answer.question_id, answer.request_id)
        await self._send(self.cfg.answers_topic, answer.question_id.encode(), encode(answer), headers,
                         "error_answers", settles=[source], question_id=answer.question_id)

    async def dead_letter(self, value: bytes | None, key: bytes | None, headers: Headers, source: Position,
                          reason: str, message: str) -> None:
        """The raw record, unchanged, plus headers saying why and where it came from."""
        headers = [*headers,
                   (m.HEADER_DLQ_REASON, reason.encode()), (m.HEADER_DLQ_MESSAGE, message.encode()),
                   (m.HEADER_DLQ_TOPIC, source.topic.encode()),
                   (m.HEADER_DLQ_PARTITION, str(source.partition).encode()),
                   (m.HEADER_DLQ_OFFSET, str(source.offset).encode())]
        await self._send(self.cfg.dlq_topic, key, value, headers, "dead_letters", settles=[source])

    async def forward(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers, partition: int,
                      source: Position) -> None:
        """A record re-published to a chosen partition (`kev route`); settles `source` once acked."""
        await self._send(topic, key, value, headers, "forwarded", settles=[source], partition=partition)

    async def _answer(self, answer: AnswerEvent, source: Inbound) -> None:
        topic = self._reply_topic(source.question.reply_topic)
        key, headers = answer.question_id.encode(), _headers(answer.question_id, answer.request_id)
        kind = "error_answers" if answer.finish_reason == "error" else "answers"
        settle = {"settles": [source.position], "question_id": source.question.question_id}
        try:
            await self._send(topic, key, encode(answer), headers, kind, **settle)
        except MessageSizeTooLargeError as error:
            too_large = error_answer(answer.question_id, answer.request_id, "answer_too_large", str(error))
            await self._send(topic, key, encode(too_large), headers, "error_answers", **settle)
        except KafkaError as error:
            if topic == self.cfg.answers_topic:
                raise
            # A reply_topic we cannot write to must not lose the answer, nor stall the next ones on it.
            log.warning("reply_topic_failed", topic=topic, question_id=answer.question_id, error=repr(error))
            self._mark_unwritable(topic)
            await self._send(self.cfg.answers_topic, key, encode(answer), headers, kind, **settle)

    async def _delta(self, delta: AnswerDelta, source: Inbound) -> None:
        topic = self._reply_topic(source.question.reply_topic)
        topic = self.cfg.deltas_topic if topic == self.cfg.answers_topic else topic
        key, headers = delta.question_id.encode(), _headers(delta.question_id, source.question.request_id)
        try:
            await self._send(topic, key, encode(delta), headers, "deltas")
        except KafkaError as error:
            if topic == self.cfg.deltas_topic:
                raise
            log.warning("reply_topic_failed", topic=topic, question_id=delta.question_id, error=repr(error))
            self._mark_unwritable(topic)  # the answer goes to answers_topic too
            await self._send(self.cfg.deltas_topic, key, encode(delta), headers, "deltas")

    def _mark_unwritable(self, topic: str) -> None:
        if len(self._unwritable) >= _MAX_UNWRITABLE:
            self._unwritable.clear()
        self._unwritable.add(topic)

    def _reply_topic(self, requested: str | None) -> str:
        if requested is None or requested == self.cfg.answers_topic:
            return self.cfg.answers_topic
        if not _LEGAL_TOPIC.fullmatch(requested) or requested in self._unwritable:
            # aiokafka would retry an illegal name's metadata for request_timeout_ms (40 s) first.
            log.warning("reply_topic_unusable", topic=requested[:300])
            return self.cfg.answers_topic
        return requested

    async def _send(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers, kind: str, *,
                    settles: Sequence[Position] = (), question_id: str | None = None,
                    partition: int | None = None) -> None:
        await self._slots.acquire()
        try:
            delivery = await self.producer.send(topic, value=value, key=key, headers=headers, partition=partition)
        except BaseException:
            self._slots.release()
            raise
        self._task_group.start_soon(self._settle, delivery, topic, kind, list(settles), question_id)

    async def _settle(self, delivery: asyncio.Future, topic: str, kind: str, settles: list[Position],
                      question_id: str | None) -> None:
        try:
            metadata = await delivery  # raises if the broker never acked: the source stays unsettled
        finally:
            self._slots.release()
        self.counts[kind] = self.counts.get(kind, 0) + 1  # "forwarded" appears only in kev route
        if question_id is not None:
            settles += self.ledger.finish(question_id)
        if settles:
            self.on_settled(settles)
            source = settles[0]
            log.info("published", kind=kind, topic=topic, partition=metadata.partition, offset=metadata.offset,
                     question_id=question_id, source_partition=source.partition, source_offset=source.offset)


def _headers(question_id: str, request_id: str | None) -> Headers:
    headers = [(m.HEADER_SCHEMA, str(SCHEMA_VERSION).encode()), (m.HEADER_CONTENT_TYPE, m.CONTENT_TYPE_JSON),
               (m.HEADER_QUESTION_ID, question_id.encode())]
    if request_id is not None:
        headers.append((m.HEADER_REQUEST_ID, request_id.encode()))
    return headers
