"""The question consumer loop: fetch, decode, route each record to exactly one outcome.

- valid question → `Inbound` into the engine's bounded inbox (settled later by its answer), with its
  principal (the verified key id, or "unsigned", and the tenant: schemas/principal.py) and an attempt
  id of its own
- InvalidQuestion → an error AnswerEvent (the asker is told why)
- UndecodableEvent → the raw record to the DLQ with reason headers (nobody can be answered)
- the same principal's question_id again with the same bytes, being answered or answered recently
  → no second answer; with other bytes → an error answer "duplicate_question_id", the first question
  untouched; another principal's question under that id is another question (see ledger.py)
- an unsigned or forged record → served with its server-side fields cleared, or refused with an
  error answer (code "unsigned"), per kafka.trust (see trust.py)
- an error answer to a signed asker goes to its reply topic (when it names one the pattern allows),
  where it waits, as every other answer of a signed question does
- a record the fetch guard could not read as sent (a header name that is not UTF-8, a broken batch:
  record_guard.py) → the DLQ, with the raw bytes that could be read and the reason

Backpressure: above the inbox's high watermark every assigned partition is paused; below the low
watermark they resume. Paused partitions are not fetched, so memory stays bounded.

Read-ahead: at most `read_ahead` records of one partition are in flight (fetched, their outcome not yet
acked); records a fetch brought past that are held (read_ahead.py) and go in as answers settle the
partition's records, the partition left out of fetches meanwhile. So one principal's backlog in a
partition takes a bounded share of what the engine holds, and the questions behind it, or on other
partitions, reach the engine, whose scheduler picks among them (policy fair: the least-served principal).
Offsets are still committed only up to the last contiguous settled record (offsets.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition
from anyio.streams.memory import MemoryObjectSendStream

from consumers.intake.backpressure import Watermarks
from consumers.kafka_client.clients import fetch
from consumers.intake.committer import RevocationListener
from consumers.intake.ledger import Admission, QuestionLedger, digest
from consumers.messages import Inbound, Position, QuestionKey
from consumers.intake.offsets import OffsetTracker
from consumers.intake.publish_clock import PublishClock
from consumers.publish.publisher import Publisher
from consumers.intake.read_ahead import ReadAhead
from consumers.kafka_client.record_guard import printable_headers, unreadable
from consumers.intake.trust import QuestionGate
from schemas import (
    InvalidQuestion,
    LimitsConfig,
    Principal,
    TrustConfig,
    UndecodableEvent,
    decode_question,
    error_answer,
    principal_of,
)
from schemas.signing import QUESTION, Verification

log = structlog.get_logger("kev.consumers.intake.loop")

COUNTS = ("records", "questions", "duplicates", "pauses", "resumes", "read_ahead_held", "polls")  # Intake.counts


@dataclass(frozen=True)
class Asker:
    """Who asked a question, and where its answers go: a signed asker's reply topic, or None (the fleet's
    answers topic)."""

    principal: Principal
    reply_topic: str | None = None


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
        read_ahead: int | None = None,  # records in flight per partition; None: the watermarks alone
        poll_timeout_ms: int = 100,
        trust: TrustConfig = TrustConfig(),
        limits: LimitsConfig = LimitsConfig(),
        clock: PublishClock | None = None,
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
        self.window = ReadAhead(tracker, read_ahead)
        self.poll_timeout_ms = poll_timeout_ms
        self.gate = QuestionGate(trust)
        self.reply_topic_pattern = re.compile(trust.reply_topic_pattern)
        self.limits = limits
        self.clock = clock or PublishClock(None, head_records=max_records)
        self.counts = dict.fromkeys(COUNTS, 0)

    async def run(self) -> None:
        """Consume until cancelled or the engine closes its inbox; closes `questions_out` on the way out."""
        async with self.questions_out:
            try:
                while True:
                    await self._poll_once()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                log.warning("engine_inbox_closed")

    async def _poll_once(self) -> None:
        self.window.rearm(self.listener.epoch)
        await self._take_held()
        used = self._apply_backpressure()
        # Fetch no more than the inbox has room for, so a send rarely waits on a slow engine.
        room = max(1, min(self.max_records, self.watermarks.high - used))
        batch = await self._fetch(room)
        self.last_poll = time.monotonic()  # the worker's /health: the loop is consuming
        self.counts["polls"] += 1
        fetched_at = time.time()  # the stamp `kev bench kafka --profile` ends the fetch stage at
        epoch = self.listener.epoch
        for partition, records in batch.items():
            for record in records:
                if self.listener.epoch != epoch:
                    return  # a rebalance reset positions: the rest is fetched again from the commit point
                if self.window.admits(partition):
                    await self._handle(record, fetched_at)
                else:
                    self.window.hold(record, fetched_at, epoch)
                    self.counts["read_ahead_held"] += 1

    async def _take_held(self) -> None:
        """Hand in the held records whose partitions have room now."""
        epoch = self.listener.epoch
        for record, fetched_at in self.window.ready():
            if self.listener.epoch != epoch:
                return  # the next poll drops them: their partitions are read again
            await self._handle(record, fetched_at)

    async def _fetch(self, room: int) -> dict:
        """The next records of the partitions holding none; while some are held, cut short when an answer
        makes room for one. A holding partition's next records stay in aiokafka's buffer, which it does not
        fetch past until they are taken: one fetch ahead, and no broker round trip when they are due."""
        holding = self.window.holding()
        if not holding:
            return await fetch(self.consumer, timeout_ms=self.poll_timeout_ms, max_records=room)
        others = self.consumer.assignment() - holding
        batch = {}
        with anyio.move_on_after(self.poll_timeout_ms / 1000):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_when_set, self.window.freed, tg.cancel_scope)
                if others:  # aiokafka takes records off its buffer only after its wait: a cancel loses none
                    batch = await fetch(self.consumer, *others, timeout_ms=self.poll_timeout_ms, max_records=room)
                    tg.cancel_scope.cancel()
        return batch

    def settled(self, positions: Sequence[Position]) -> None:
        """Answers settled these records: a held record of their partitions may go in."""
        for position in positions:
            self.window.settled(TopicPartition(position.topic, position.partition))

    async def _handle(self, record: ConsumerRecord, fetched_at: float) -> None:
        position = Position(record.topic, record.partition, record.offset)
        self.tracker.track(position.partition_key, record.offset)
        self.counts["records"] += 1
        bound = log.bind(partition=record.partition, offset=record.offset)
        if (broken := unreadable(record)) is not None:
            await self._dead_letter_unreadable(record, broken, position, bound)
            return
        value_digest = digest(record.value)
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
            verification = self.gate.verifier.verify(QUESTION, record.topic, record.key, record.value, record.headers)
            asker = self._asker(verification, None, bad.reply_topic)
            await self._turn_away(asker, bad.question_id, bad.request_id, bad.code, bad.message, value_digest,
                                  position, bound)
        except Exception as error:  # a decoder bug must not stop the partition: park the record
            bound.exception("decode_crashed")
            await self.publisher.dead_letter(record.value, record.key, list(record.headers), position,
                                             "decode_crashed", repr(error))
        else:
            asker = self._asker(admitted.verification, question.tenant, question.reply_topic)
            if admitted.refused is not None:
                await self._turn_away(asker, question.question_id, question.request_id, admitted.code,
                                      admitted.refused, value_digest, position, bound)
            elif await self._admit(asker, question.question_id, question.request_id, value_digest, position, bound):
                self.counts["questions"] += 1
                published_ms = self.clock.published_ms(record.timestamp, question.timeout_ms, self._lag(record))
                inbound = Inbound(question, record.topic, record.partition, record.offset, time.monotonic(),
                                  published_ms=published_ms, principal=asker.principal)
                # Stage stamps for `kev bench kafka --profile` (debug: free at the default level).
                bound.debug("question_taken", question_id=question.question_id, fetched_at=fetched_at)
                await self.questions_out.send(inbound)

    def _lag(self, record: ConsumerRecord) -> int | None:
        """Records between this one and its partition's highwater as of the fetch that brought it."""
        highwater = self.consumer.highwater(TopicPartition(record.topic, record.partition))
        return None if highwater is None else highwater - record.offset - 1

    async def _dead_letter_unreadable(self, record: ConsumerRecord, broken, position: Position, bound) -> None:
        message = broken.message if broken.first_offset == record.offset else \
            f"{broken.message} (stands for offsets {broken.first_offset} to {record.offset})"
        bound.warning("dead_letter", reason=broken.reason, message=message)
        await self.publisher.dead_letter(record.value, record.key, printable_headers(record.headers), position,
                                         broken.reason, message)

    def _asker(self, verification: Verification, tenant: str | None, reply_topic: str | None) -> Asker:
        """Who asked (a tenant counts only when signed) and where its answers may go: the reply topic of a
        signed record, when the pattern allows it (the gate clears the others from a served question; a
        refused or invalid one is checked here alike)."""
        trusted = verification.trusted
        principal = principal_of(verification.key_id if trusted else None, tenant)
        allowed = trusted and reply_topic is not None and self.reply_topic_pattern.fullmatch(reply_topic)
        return Asker(principal, reply_topic if allowed else None)

    async def _turn_away(self, asker: Asker, question_id: str, request_id: str | None, code: str, message: str,
                         value_digest: bytes, position: Position, bound) -> None:
        """An error answer for a question that will not be served (invalid, refused). Its redelivery and a
        conflict are told as any question's, but it does not keep its id: the question corrected (other
        bytes), or signed anew (the same bytes), and sent again under that id is served."""
        if await self._admit(asker, question_id, request_id, value_digest, position, bound):
            self.ledger.abandon(QuestionKey(asker.principal, question_id))
            await self._tell(asker, question_id, request_id, code, message, position)

    async def _tell(self, asker: Asker, question_id: str, request_id: str | None, code: str, message: str,
                    position: Position) -> None:
        """An error answer to `asker` (on its reply topic, if it has one), settling `position` once acked."""
        await self.publisher.error_answer(error_answer(question_id, request_id, code, message), position,
                                          principal=asker.principal, reply_topic=asker.reply_topic)

    async def _admit(self, asker: Asker, question_id: str, request_id: str | None, value_digest: bytes,
                     position: Position, bound) -> bool:
        """Whether to answer this record; a duplicate is settled with its first's answer, a conflict told."""
        admission = self.ledger.admit(QuestionKey(asker.principal, question_id), value_digest, position)
        if admission is Admission.NEW:
            return True
        self.counts["duplicates"] += 1
        bound.info("duplicate_question", question_id=question_id, principal=str(asker.principal),
                   admission=admission.value)
        if admission is Admission.ANSWERED:
            self.on_settled([position])
        elif admission is Admission.CONFLICT:
            await self._tell(asker, question_id, request_id, "duplicate_question_id",
                             f"question_id {question_id!r} was asked before, by the same principal, with other "
                             f"content; that question stands and this one is not answered", position)
        return False

    def _apply_backpressure(self) -> int:
        """Pause every partition while the inbox is above its watermark; resume them below it. Returns
        the inbox's depth."""
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


async def _cancel_when_set(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
