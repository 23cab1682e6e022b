"""Where a batch's state lives: a compacted Kafka topic (`kafka.batches_topic`, default kev.batches).

Two kinds of record, both keyed by what they describe, so compaction keeps the latest of each:
- the batch (key `<batch id>`): OpenAI's batch object less its counts, plus the tenant, rewritten on
  every change of status with a higher `version`;
- a line's result (key `<batch id>/<line>`): the output or error line for one custom_id, written
  once the line is settled; its presence is what says "answered, never ask again";
- a cancel (key `<batch id>/cancel`), which the batch's runner acts on.
Only the runner rewrites a batch (one at a time, under a lock), so versions never collide.
At start the gateway reads the topic from its beginning to its end before serving, then keeps
following it, so whatever one gateway process writes the others read. The counts a batch shows are
its line records counted, never a number kept beside them that could drift.

The records are not signed: whoever may write this topic may change batches, so grant it to the
gateways alone (docs/gateway.md#batch-api).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import anyio
import msgspec
import structlog
from aiokafka import AIOKafkaProducer, TopicPartition
from anyio.abc import TaskStatus

from consumers import create_topics
from consumers.kafka_client.clients import fetch, open_consumer
from consumers.kafka_client.topics import COMPACTED
from schemas import KafkaConfig

log = structlog.get_logger("kev.gateway.batches")

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
_STAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
           "cancelled_at")


class BatchRecord(msgspec.Struct, frozen=True, kw_only=True, tag="batch", tag_field="kind"):
    id: str
    tenant: str | None
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str  # validating | in_progress | finalizing | completed | failed | expired | cancelling | cancelled
    total: int = 0
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None  # why it failed: OpenAI's {code, message, param, line}
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    version: int = 0


class LineRecord(msgspec.Struct, frozen=True, kw_only=True, tag="line", tag_field="kind"):
    batch_id: str
    index: int
    outcome: Literal["completed", "failed"]  # completed: the output file; failed: the error file
    line: dict[str, Any]  # the file's line: {id, custom_id, response, error}


class CancelRecord(msgspec.Struct, frozen=True, kw_only=True, tag="cancel", tag_field="kind"):
    """A client's cancel: a record of its own, so it never races the runner's rewrites of the batch."""

    batch_id: str
    at: int


Record = BatchRecord | LineRecord | CancelRecord
_RECORD = msgspec.json.Decoder(Record)


def batch_json(batch: BatchRecord, counts: dict[str, int], cancelled_at: int | None = None) -> dict[str, Any]:
    """OpenAI's batch object; a batch whose cancel its runner has not taken up yet shows as cancelling."""
    if cancelled_at is not None and batch.status not in TERMINAL and batch.status != "cancelling":
        batch = msgspec.structs.replace(batch, status="cancelling", cancelling_at=cancelled_at)
    body = {"id": batch.id, "object": "batch", "endpoint": batch.endpoint,
            "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
            "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
            "status": batch.status, "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
            "created_at": batch.created_at, "expires_at": batch.expires_at,
            "request_counts": {"total": batch.total, **counts}, "metadata": batch.metadata}
    body.update({stamp: getattr(batch, stamp) for stamp in _STAMPS})
    return body


class BatchStore:
    """The batches and their settled lines, as the topic says; `put` writes (acked) and applies."""

    def __init__(self, kafka: KafkaConfig, topic: str, producer: AIOKafkaProducer) -> None:
        self.kafka, self.topic, self.producer = kafka, topic, producer
        self.batches: dict[str, BatchRecord] = {}
        self.lines: dict[str, dict[int, LineRecord]] = {}
        self.cancels: dict[str, int] = {}  # batch id -> when a cancel was asked
        # A finished batch's counts; its lines are in its files and leave memory
        self._final_counts: dict[str, dict[str, int]] = {}
        self._writing = anyio.Lock()
        self.watchers: list[Callable[[BatchRecord], None]] = []  # told of every batch record applied

    def counts(self, batch_id: str) -> dict[str, int]:
        """Settled lines by outcome; once a batch is cancelled or expired, its lines never asked count as failed
        (they are in its error file)."""
        if batch_id in self._final_counts:
            return self._final_counts[batch_id]
        outcomes = [line.outcome for line in self.lines.get(batch_id, {}).values()]
        completed, failed = outcomes.count("completed"), outcomes.count("failed")
        batch = self.batches.get(batch_id)
        if batch is not None and batch.status in ("cancelled", "expired"):
            failed = batch.total - completed
        return {"completed": completed, "failed": failed}

    def view(self, batch_id: str) -> dict[str, Any]:
        return batch_json(self.batches[batch_id], self.counts(batch_id), self.cancels.get(batch_id))

    async def put(self, record: LineRecord | CancelRecord) -> None:
        key = f"{record.batch_id}/{record.index}" if isinstance(record, LineRecord) else f"{record.batch_id}/cancel"
        await self._send(key, record)

    async def update(self, batch: BatchRecord, **changes: Any) -> BatchRecord:
        """Write the batch with `changes` as its next version, and wait for the broker's ack."""
        async with self._writing:
            known = self.batches.get(batch.id, batch)
            record = msgspec.structs.replace(known, **changes, version=known.version + 1)
            await self._send(record.id, record)
        return record

    async def _send(self, key: str, record: Record) -> None:
        await self.producer.send_and_wait(self.topic, msgspec.json.encode(record), key=key.encode())
        self.apply(record)

    def apply(self, record: Record) -> None:
        """Newer batch versions replace older ones; a line's first record stands, as does a batch's first cancel."""
        if isinstance(record, LineRecord):
            if record.batch_id not in self._final_counts:
                self.lines.setdefault(record.batch_id, {}).setdefault(record.index, record)
            return
        if isinstance(record, CancelRecord):
            self.cancels.setdefault(record.batch_id, record.at)
            if record.batch_id in self.batches:
                for watcher in self.watchers:
                    watcher(self.batches[record.batch_id])
            return
        known = self.batches.get(record.id)
        if known is not None and known.version >= record.version:
            return
        self.batches[record.id] = record
        if record.status in TERMINAL:
            self._final_counts[record.id] = self.counts(record.id)
            self.lines.pop(record.id, None)
        for watcher in self.watchers:
            watcher(record)

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Create the topic if missing, read it to its end (then ready), and follow it until cancelled."""
        await create_topics(self.kafka, {self.topic: 1}, configs={self.topic: COMPACTED})
        partition = TopicPartition(self.topic, 0)
        async with open_consumer(self.kafka) as consumer:
            consumer.assign([partition])
            await consumer.seek_to_beginning(partition)
            end = (await consumer.end_offsets([partition]))[partition]
            while await consumer.position(partition) < end:
                await self._read(consumer, 200)
            log.info("gateway.batches_loaded", topic=self.topic, batches=len(self.batches),
                     lines=sum(map(len, self.lines.values())))
            task_status.started()
            while True:
                await self._read(consumer, 1000)

    async def _read(self, consumer, timeout_ms: int) -> None:
        for records in (await fetch(consumer, timeout_ms=timeout_ms)).values():
            for record in records:
                try:
                    self.apply(_RECORD.decode(record.value or b""))
                except msgspec.DecodeError as error:  # a tombstone, or a record no gateway wrote
                    log.warning("gateway.batch_record_skipped", offset=record.offset, error=str(error)[:200])
