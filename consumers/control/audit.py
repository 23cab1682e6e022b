"""The fleet's one-per-record chores on the control topic: dead letters for control records that will
not be applied (unsigned, forged, out of scope, wrongly keyed, replayed, not a command), restores of
the commands a replay would displace on the compacted topic, and tombstones for old cancels.

Every worker's control reader reads every control record (no consumer group), so if readers did
these, N workers would do each N times, and every restart would do them again on replay. The audit
is instead one consumer group, `<kafka.group_id>.control-audit`, that every worker joins: the control
topic's single partition is assigned to one member at a time.

- Dead letters: the member dead-letters each rejected record (its value, key and headers, plus the
  dlq.* headers of consumers/messages.py with the reason; a record the fetch guard could not read
  comes with the raw bytes it could, record_guard.py), at least once: again if the partition
  moves to another member before the commit past it (see below for when that is held back).
- Restores: a signed command published again later (its sequence number not above its key's last,
  control.py) is refused by every reader, but it is now the latest record under its key, so compaction
  would keep it and drop the command in force: after compaction a restart would apply the old one.
  The member publishes the command in force again, byte for byte (its signature still holds), right
  after the replay; readers take that copy as a duplicate (not applied twice), and compaction keeps
  it. To know which command is in force, the member reads the partition from its first record each
  time it is assigned, as every reader does, and does its chores only from the group's committed
  offset on.
- Tombstones: the control topic is compacted and each cancel has its own key (`cancel:<question
  id>`), so without a tombstone (same key, null value) every cancel would stay on the topic for good
  and make every worker's catch-up longer. A tombstone must not remove a cancel before the workers
  have read it (compaction may run as soon as the tombstone's segment is closed, with the default
  min.compaction.lag.ms of 0), so the member writes it only once the cancel is older than
  `cancel_max_age_s` (control.CANCEL_MAX_AGE_S, the age past which workers ignore a cancel anyway).
  Until then the group's committed offset stays at the oldest cancel not yet tombstoned, so a member
  that takes the partition over reads it again and tombstones it in its turn (a second tombstone
  for a key changes nothing); rejected records after it may then be dead-lettered a second time.

The audit is not essential: a broker that is away, or any other failure, is logged
(`control.audit_failed`) and the audit starts again after a backoff (1 s doubling to 30 s). It never
raises, so it never takes the control reader down with it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import anyio
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord
from anyio.abc import TaskStatus

from consumers.kafka_client.clients import fetch, open_consumer, open_producer
from consumers.control.reader import (
    CANCEL_KEY_PREFIX,
    CANCEL_MAX_AGE_S,
    Command,
    ControlGate,
    Rejected,
    Sequences,
    cancel_age_ms,
)
from consumers.messages import (
    HEADER_DLQ_MESSAGE,
    HEADER_DLQ_OFFSET,
    HEADER_DLQ_PARTITION,
    HEADER_DLQ_REASON,
    HEADER_DLQ_TOPIC,
)
from consumers.kafka_client.record_guard import printable_headers
from schemas import KafkaConfig

log = structlog.get_logger("kev.consumers.control.audit")


def audit_group(cfg: KafkaConfig) -> str:
    return f"{cfg.group_id}.control-audit"


async def run_control_audit(
    cfg: KafkaConfig,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    poll_timeout_ms: int = 200,
    consumer_options: Mapping[str, Any] | None = None,  # extra AIOKafkaConsumer kwargs (group timings)
    cancel_max_age_s: float = CANCEL_MAX_AGE_S,
    backoff_s: tuple[float, float] = (1.0, 30.0),  # the first wait after a failure, and the longest
) -> None:
    """Dead-letter rejected control records and tombstone old cancels until cancelled; never raises.
    Ready at once (it is best effort); expects the control topic to exist."""
    audit = _Audit(cfg, cancel_max_age_s)
    task_status.started()
    wait = backoff_s[0]
    while True:
        try:
            await audit.run(poll_timeout_ms, consumer_options)
        except Exception as error:  # noqa: BLE001 - the audit is best effort; the control reader goes on
            if audit.healthy:  # it had been running: a new failure, not the same one again
                wait = backoff_s[0]
            fields = {"error": repr(error)[:500], "retry_in_s": wait}
            if isinstance(error, (KafkaError, OSError)):
                log.warning("control.audit_failed", **fields)
            else:  # a bug: said loudly, still retried
                log.exception("control.audit_failed", **fields)
        audit.healthy = False
        await anyio.sleep(wait)
        wait = min(wait * 2, backoff_s[1])


class _Audit:
    """One member's state: the cancels it read and has not tombstoned yet, how far it read, and the command
    in force per record key."""

    def __init__(self, cfg: KafkaConfig, cancel_max_age_s: float) -> None:
        self.cfg, self.gate = cfg, ControlGate(cfg)
        self.max_age_ms = cancel_max_age_s * 1000
        self.cancels: dict[TopicPartition, dict[int, bytes]] = {}  # offset -> key, not yet tombstoned
        self.stamps: dict[tuple[TopicPartition, int], float] = {}  # when each cancel may be tombstoned (ms)
        self.read_to: dict[TopicPartition, int] = {}  # the offset after the last record handled
        self.committed: dict[TopicPartition, int] = {}  # what this member last committed
        self.chores_from: dict[TopicPartition, int] = {}  # the group's commit when assigned: chores start there
        self.sequences = Sequences()  # the command in force per key, read from the first record
        self.healthy = False  # both clients started since the last failure

    async def run(self, poll_timeout_ms: int, consumer_options: Mapping[str, Any] | None) -> None:
        self.forget({*self.read_to, *self.chores_from})  # start again as any member would
        async with open_producer(self.cfg) as producer, \
                open_consumer(self.cfg, group_id=audit_group(self.cfg), **dict(consumer_options or {})) as consumer:
            consumer.subscribe([self.cfg.control_topic], listener=_Rebalance(self, consumer))
            self.healthy = True
            while True:
                batch = await fetch(consumer, timeout_ms=poll_timeout_ms)
                for records in batch.values():
                    for record in records:
                        await self._handle(consumer, producer, record)
                await self._tombstone_due(producer)
                await self._commit(consumer)

    async def assigned(self, consumer: AIOKafkaConsumer, partitions) -> None:
        """Read each assigned partition from its first record again; chores resume at the group's commit."""
        self.sequences = Sequences()
        for tp in partitions:
            self.chores_from[tp] = await consumer.committed(tp) or 0
            consumer.seek(tp, 0)

    async def _handle(self, consumer: AIOKafkaConsumer, producer: AIOKafkaProducer, record: ConsumerRecord) -> None:
        tp = TopicPartition(record.topic, record.partition)
        if record.offset < self.chores_from.get(tp, 0):
            self._judge(record)  # done by whoever audited it before: only learn which command is in force
            return
        self.read_to[tp] = record.offset + 1
        if record.value is None:
            return  # a tombstone: compaction's marker, not a command
        if record.key is not None and record.key.startswith(CANCEL_KEY_PREFIX):
            # Its due time counts from when it was published (or from now, if stamped in the future).
            self.cancels.setdefault(tp, {})[record.offset] = record.key
            self.stamps[(tp, record.offset)] = time.time() * 1000 - cancel_age_ms(record) + self.max_age_ms
        checked = self._judge(record)
        if isinstance(checked, Rejected):
            await _dead_letter(producer, self.cfg.dlq_topic, record, checked)
            if checked.reason == "stale_sequence":
                await self._restore(producer, record)
            # Past it at once (not the whole batch): a rebalance now must not send it twice.
            await self._commit(consumer)

    def _judge(self, record: ConsumerRecord) -> Command | Rejected | str | None:
        """What every reader makes of the record (None for a tombstone), with the command in force updated."""
        if record.value is None:
            return None
        checked = self.gate.check(record)
        return self.sequences.admit(record, checked) if isinstance(checked, Command) else checked

    async def _restore(self, producer: AIOKafkaProducer, replayed: ConsumerRecord) -> None:
        """Publish the command in force for the replayed record's key again, so compaction keeps it, not the replay."""
        if (in_force := self.sequences.current(replayed.key)) is None:
            return
        current = in_force[1]
        try:
            await producer.send_and_wait(current.topic, current.value, key=current.key, headers=list(current.headers),
                                         partition=current.partition)
        except KafkaError as error:  # readers refuse the replay anyway; only a compaction before a retry could hurt
            log.warning("control.restore_failed", offset=replayed.offset, error=repr(error))
            return
        log.warning("control.command_restored", replayed_offset=replayed.offset, restored_offset=current.offset,
                    key=current.key[:100] if current.key is not None else None)

    async def _tombstone_due(self, producer: AIOKafkaProducer) -> None:
        now = time.time() * 1000
        # Chosen before any await: a revocation (the listener) may forget a partition meanwhile.
        due = [(tp, offset, key) for tp, pending in self.cancels.items() for offset, key in pending.items()
               if self.stamps[(tp, offset)] <= now]
        if not due:
            return
        # Sent together, then awaited: the producer batches them.
        acks = [await producer.send(tp.topic, None, key=key, partition=tp.partition) for tp, _, key in due]
        for ack in acks:
            await ack
        for tp, offset, _ in due:
            self.cancels.get(tp, {}).pop(offset, None)
            self.stamps.pop((tp, offset), None)
        log.info("control.cancels_tombstoned", count=len(due), topic=self.cfg.control_topic)

    def forget(self, partitions) -> None:
        """Drop what this member held of `partitions`: whoever reads them next starts at the commit."""
        for tp in partitions:
            for offset in self.cancels.pop(tp, {}):
                self.stamps.pop((tp, offset), None)
            self.read_to.pop(tp, None)
            self.committed.pop(tp, None)
            self.chores_from.pop(tp, None)

    async def _commit(self, consumer: AIOKafkaConsumer) -> None:
        """Commit what was read, but not past a cancel still to be tombstoned; only what moved."""
        offsets = {tp: min(self.cancels[tp]) if self.cancels.get(tp) else end for tp, end in self.read_to.items()}
        offsets = {tp: offset for tp, offset in offsets.items() if self.committed.get(tp) != offset}
        if not offsets:
            return
        try:
            await consumer.commit(offsets)
        except KafkaError as error:  # a rebalance under way: the next member starts from the last commit
            log.warning("control.audit_commit_failed", error=repr(error))
            return
        self.committed.update(offsets)


class _Rebalance(ConsumerRebalanceListener):
    """Before the partition moves: commit what this member did, then let go of what it held. Once it is
    assigned: read it from the start (which command is in force), with chores from the commit on."""

    def __init__(self, audit: _Audit, consumer: AIOKafkaConsumer) -> None:
        self.audit, self.consumer = audit, consumer

    async def on_partitions_revoked(self, revoked) -> None:
        await self.audit._commit(self.consumer)
        self.audit.forget(revoked)

    async def on_partitions_assigned(self, assigned) -> None:
        await self.audit.assigned(self.consumer, assigned)


async def _dead_letter(producer: AIOKafkaProducer, topic: str, record: ConsumerRecord, why: Rejected) -> None:
    headers = [*printable_headers(record.headers),
               (HEADER_DLQ_REASON, why.reason.encode()), (HEADER_DLQ_MESSAGE, why.message.encode()),
               (HEADER_DLQ_TOPIC, record.topic.encode()), (HEADER_DLQ_PARTITION, str(record.partition).encode()),
               (HEADER_DLQ_OFFSET, str(record.offset).encode())]
    try:
        await producer.send_and_wait(topic, record.value, key=record.key, headers=headers)
    except KafkaError as error:  # the readers have logged the record (control.skipped); the audit goes on
        log.warning("control.dead_letter_failed", offset=record.offset, reason=why.reason, error=repr(error))
        return
    log.warning("control.dead_letter", offset=record.offset, reason=why.reason, topic=topic,
                **({"key_id": why.key_id} if why.key_id else {}))
