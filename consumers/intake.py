"""The question consumer loop: fetch, decode, route each record to exactly one outcome.

- valid question → `Inbound` into the engine's bounded inbox (settled later by its answer)
- InvalidQuestion → an error AnswerEvent (the asker is told why)
- UndecodableEvent → the raw record to the DLQ with reason headers (nobody can be answered)
- a question_id being answered or answered recently → no second answer (see ledger.py)
- an unsigned or forged record → served with its server-side fields cleared, or refused with an
  error answer (code "unsigned"), per kafka.trust (see trust.py)
- a record the fetch guard could not read as sent (a header name that is not UTF-8, a broken batch:
  record_guard.py) → the DLQ, with the raw bytes that could be read and the reason

Backpressure: above the inbox's high watermark every assigned partition is paused; below the low
watermark they resume. Paused partitions are not fetched, so memory stays bounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import anyio
import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord
from anyio.streams.memory import MemoryObjectSendStream

from consumers.backpressure import Watermarks
from consumers.clients import fetch
from consumers.committer import RevocationListener
from consumers.ledger import Admission, QuestionLedger
from consumers.messages import Inbound, Position
from consumers.offsets import OffsetTracker
from consumers.publisher import Publisher
from consumers.record_guard import printable_headers, unreadable
from consumers.trust import QuestionGate
from schemas import (
    InvalidQuestion,
    LimitsConfig,
    TrustConfig,
    UndecodableEvent,
    decode_question,
    error_answer,
)

log = structlog.get_logger("kev.consumers.intake")


class Intake:
    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        listener: RevocationListener,
        tracker: OffsetTracker,
        ledger: QuestionLedger,
        publisher: Publisher,
        on_settled: Callable[[Sequence[Position]], None],
        questions_out: MemoryObjectSendStream[Inbound],
        watermarks: Watermarks,
        *,
        max_records: int = 64,
        poll_timeout_ms: int = 100,
        trust: TrustConfig = TrustConfig(),
        limits: LimitsConfig = LimitsConfig(),
    ) -> None:
        self.consumer = consumer
        self.listener = listener
        self.tracker = tracker
        self.ledger = ledger
        self.publisher = publisher
        self.on_settled = on_settled
        self.questions_out = questions_out
        self.watermarks = watermarks
        self.max_records = max_records
        self.poll_timeout_ms = poll_timeout_ms
        self.gate = QuestionGate(trust)
        self.limits = limits
        self.counts = {"records": 0, "questions": 0, "duplicates": 0, "pauses": 0, "resumes": 0}
        self.fetched_at = 0.0  # time.time() when the batch being handled came back from the broker

    async def run(self) -> None:
        """Consume until cancelled or the engine closes its inbox; closes `questions_out` on the way out."""
        async with self.questions_out:
            try:
                while True:
                    await self._poll_once()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                log.warning("engine_inbox_closed")

    async def _poll_once(self) -> None:
        used = self._apply_backpressure()
        # Fetch no more than the inbox has room for, so a send rarely waits on a slow engine.
        room = max(1, min(self.max_records, self.watermarks.high - used))
        batch = await fetch(self.consumer, timeout_ms=self.poll_timeout_ms, max_records=room)
        self.last_poll = time.monotonic()  # the worker's /health: the loop is consuming
        self.fetched_at = time.time()
        epoch = self.listener.epoch
        for records in batch.values():
            for record in records:
                if self.listener.epoch != epoch:
                    return  # a rebalance reset positions: the rest is fetched again from the commit point
                await self._handle(record)

    async def _handle(self, record: ConsumerRecord) -> None:
        position = Position(record.topic, record.partition, record.offset)
        self.tracker.track(position.partition_key, record.offset)
        self.counts["records"] += 1
        bound = log.bind(partition=record.partition, offset=record.offset)
        if (broken := unreadable(record)) is not None:
            await self._dead_letter_unreadable(record, broken, position, bound)
            return
        try:
            question = decode_question(record.value if record.value is not None else b"", limits=self.limits)
            admitted = self.gate.admit(question, record.value, record.headers, bound, topic=record.topic,
                                       key=record.key)
            question = admitted.question
        except UndecodableEvent as bad:
            bound.warning("dead_letter", reason=bad.reason, message=bad.message)
            await self.publisher.dead_letter(record.value, record.key, list(record.headers), position,
                                             bad.reason, bad.message)
        except InvalidQuestion as bad:
            bound.info("invalid_question", question_id=bad.question_id, code=bad.code, message=bad.message)
            if self._admit(bad.question_id, position, bound):
                answer = error_answer(bad.question_id, bad.request_id, bad.code, bad.message)
                await self.publisher.error_answer(answer, position)
        except Exception as error:  # a decoder bug must not stop the partition: park the record
            bound.exception("decode_crashed")
            await self.publisher.dead_letter(record.value, record.key, list(record.headers), position,
                                             "decode_crashed", repr(error))
        else:
            if admitted.refused is not None:
                await self._refuse(question, admitted.refused, position, bound, admitted.code)
            elif self._admit(question.question_id, position, bound):
                self.counts["questions"] += 1
                inbound = Inbound(question, record.topic, record.partition, record.offset, time.monotonic(),
                                  published_ms=record.timestamp)
                # Stage stamps for `kev bench kafka --profile` (debug: free at the default level).
                bound.debug("question_taken", question_id=question.question_id, fetched_at=self.fetched_at)
                await self.questions_out.send(inbound)

    async def _dead_letter_unreadable(self, record: ConsumerRecord, broken, position: Position, bound) -> None:
        message = broken.message if broken.first_offset == record.offset else \
            f"{broken.message} (stands for offsets {broken.first_offset} to {record.offset})"
        bound.warning("dead_letter", reason=broken.reason, message=message)
        await self.publisher.dead_letter(record.value, record.key, printable_headers(record.headers), position,
                                         broken.reason, message)

    async def _refuse(self, question, message: str, position: Position, bound, code: str = "unsigned") -> None:
        if self._admit(question.question_id, position, bound):
            await self.publisher.error_answer(error_answer(question.question_id, question.request_id, code,
                                                          message), position)

    def _admit(self, question_id: str, position: Position, bound) -> bool:
        admission = self.ledger.admit(question_id, position)
        if admission is Admission.NEW:
            return True
        self.counts["duplicates"] += 1
        bound.info("duplicate_question", question_id=question_id, admission=admission.value)
        if admission is Admission.ANSWERED:
            self.on_settled([position])
        return False

    def _apply_backpressure(self) -> int:
        used = self.questions_out.statistics().current_buffer_used
        if self.watermarks.update(used):
            unpaused = self.consumer.assignment() - self.consumer.paused()
            if unpaused:
                self.consumer.pause(*unpaused)
                self.counts["pauses"] += 1
                log.info("partitions_paused", partitions=len(unpaused), inbox=used)
        elif paused := self.consumer.paused():
            self.consumer.resume(*paused)
            self.counts["resumes"] += 1
            log.info("partitions_resumed", partitions=len(paused), inbox=used)
        return used
