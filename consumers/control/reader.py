"""The control reader: every command on the control topic, from its first record, into a stream.

    send, receive = anyio.create_memory_object_stream[ControlEvent](16)
    replayed = await tg.start(run_control_reader, cfg, send)   # then: async for event in receive

Every worker must apply every command, so the reader joins no consumer group (group_id=None) and
commits nothing: each time it starts it reads the topic from the earliest offset, and replaying
the whole topic in order rebuilds the adapter registry and the sampling defaults as they were
commanded. "earliest" is also the only reliable choice on the embedded Tansu broker, whose answers
for "latest" / seek_to_end (ListOffsets) are wrong; the highwater it sends with each fetch is
right, and that is what tells the reader it has caught up. Order holds within a partition only,
so the control topic has one partition (consumers.kafka_client.topics creates it so).

Cancels (`action: cancel`) are skipped while catching up: they were meant for questions in flight
then, and a question this worker takes later under the same id must not be cancelled by history.
Only cancels that arrive once the reader is ready are sent on, and only while they are younger than
`cancel_max_age_s` (10 minutes) by their record timestamp and by their signed time (a cancel published
again later keeps the time it was signed): a cancel matters only while its question
may still run, and a reader that fell behind (or whose catch-up timed out) must not send history on
as live cancels. The control audit tombstones each cancel once it is that old, so the compacted
topic does not keep one record per cancelled question for good; a tombstone (a null value) is
skipped silently here: it is compaction's marker, not a bad command.

`wrap(event, offset)` (default: the event alone) lets the caller keep each command's offset, its
identity: `kev serve` passes it on as the command's id, so an engine that has applied a command
already skips it when the topic is replayed again (the control actor restarted): replay is
idempotent, a load is not re-applied as a new adapter version.

Only signed commands are applied: signed (schemas/signing.py) for this topic and record key by a key
in `kafka.trust` whose scopes hold `control` (a cancel: `cancel`), its record key equal to
`control_key(event)` (what it changes, so the compacted topic keeps the latest command per key). A
command also carries a signed sequence number, and is applied only when that number is above the
last applied for its record key (`Sequences`): a signed command published again later (a rollback
to old defaults, an adapter unloaded again) is refused, at once and at every replay, since the
replay goes in topic order. The same record again (same number, same value: a producer's retry, the
audit's restore) is a duplicate, skipped quietly. Cancels carry their signing time instead and are
not sequenced: an old one is ignored anyway (above). Publish with `send_control` or
`control_record(event, signer, topic)`, whose numbers are the time in ms (schemas.signing.next_sequence),
so they are above the last applied as long as the signers' clocks move forward.

A record that is unsigned, forged, out of its key's scope, wrongly keyed, not above its key's last
sequence, or does not decode is logged (`control.skipped`, a structlog warning with its offset and
reason) and skipped: a bad command never stops the reader, nor does a record the fetch guard could
not read (record_guard.py: a header name that is not UTF-8, a broken batch). Dead letters for such
records are not written here (every worker reads every record, so each would write one) but by
`run_control_audit` (control_audit.py), once for the whole fleet.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from consumers.kafka_client.clients import fetch, open_consumer
from consumers.control.gate import (CANCEL_KEY_PREFIX, DUPLICATE, Command, ControlGate, Rejected, Sequences,
                                    purpose_of, shown_key)
from consumers.kafka_client.topics import COMPACTED, create_topics
from schemas import ControlEvent, KafkaConfig, control_key, decode_control, encode
from schemas.signing import Signer

# Re-exported: the readers, the history and the audit name the gate's types beside the reader.
__all__ = ["CANCEL_KEY_PREFIX", "CANCEL_MAX_AGE_S", "DUPLICATE", "Command", "ControlGate", "Rejected", "Sequences",
           "caught_up", "cancel_age_ms", "control_record", "purpose_of", "run_control_reader", "send_control"]

log = structlog.get_logger("kev.consumers.control.reader")

CANCEL_MAX_AGE_S = 600.0  # a cancel older than this (record timestamp) is history: not sent on, tombstoned
# Said with an unsigned command skipped: what an operator upgrading from unsigned control does about it.
UNSIGNED_HINT = ("control commands are applied only when signed (kafka.trust): publish this command again, "
                 "signed (consumers.control.reader.send_control with a key in kafka.trust)")
ROOT_HINT = ("; its path must lie under adapters.root (default ~/.cache/kev/adapters; a relative path is "
             "taken under it): set adapters.root to the directory that holds your adapters")


async def run_control_reader(
    cfg: KafkaConfig,
    out: MemoryObjectSendStream[ControlEvent],
    *,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    create_topic: bool = True,
    catch_up_timeout: float = 15.0,
    poll_timeout_ms: int = 100,
    consumer_options: Mapping[str, Any] | None = None,  # extra AIOKafkaConsumer kwargs
    wrap: Callable[[ControlEvent, int], Any] | None = None,  # builds what is sent from (event, offset)
    cancel_max_age_s: float = CANCEL_MAX_AGE_S,
) -> None:
    """Send each valid command on `cfg.control_topic` to `out`, from the topic's first record, until
    cancelled (or until `out`'s receiver is closed); closes `out` when it ends.

    Ready — `task_status.started(n)` — once every command that was on the topic when it started is
    in `out` (n of them, so the caller can wait until it has applied n before it takes questions);
    if catching up takes longer than `catch_up_timeout` seconds it is ready anyway, with a warning,
    and the rest follows as it is read.
    """
    gate = ControlGate(cfg)  # a bad key fails the start before anything else happens
    async with out:
        if create_topic:
            await create_topics(cfg, {cfg.control_topic: 1}, configs={cfg.control_topic: COMPACTED})
        async with open_consumer(cfg, cfg.control_topic, **dict(consumer_options or {})) as consumer:
            reader = _ControlReader(consumer, out, poll_timeout_ms, wrap or (lambda event, _offset: event),
                                    gate, cancel_max_age_s)
            try:
                replayed = await reader.catch_up(catch_up_timeout)
                log.info("control.reader_ready", topic=cfg.control_topic, replayed=replayed, skipped=reader.skipped,
                         duplicates=reader.duplicates, stale_cancels=reader.stale_cancels)
                task_status.started(replayed)
                while True:
                    await reader.poll_once()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                log.info("control.reader_stopped", reason="its receiver closed")


class _ControlReader:
    def __init__(self, consumer: AIOKafkaConsumer, out: MemoryObjectSendStream[ControlEvent],
                 poll_timeout_ms: int, wrap: Callable[[ControlEvent, int], Any], gate: "ControlGate",
                 cancel_max_age_s: float = CANCEL_MAX_AGE_S) -> None:
        self.consumer, self.out, self.poll_timeout_ms, self.wrap = consumer, out, poll_timeout_ms, wrap
        self.gate = gate
        self.sequences = Sequences()  # rebuilt by every replay, from the topic's first record
        self.cancel_max_age_ms = cancel_max_age_s * 1000
        self.sent = 0
        self.skipped = 0
        self.duplicates = 0  # the same record again (same sequence, same value): not applied twice
        self.stale_cancels = 0  # cancels found while catching up or older than cancel_max_age_s, not sent
        self.replaying = True

    async def catch_up(self, timeout: float) -> int:
        """Read until the position reaches the highwater of every partition; returns how many were sent."""
        deadline = time.monotonic() + timeout
        while not await caught_up(self.consumer):
            if time.monotonic() > deadline:
                log.warning("control.catch_up_timeout", timeout_s=timeout, replayed=self.sent,
                            assigned=len(self.consumer.assignment()))
                break
            await self.poll_once()
        self.replaying = False
        return self.sent

    async def poll_once(self) -> None:
        batch = await fetch(self.consumer, timeout_ms=self.poll_timeout_ms)
        for records in batch.values():
            for record in records:
                if record.value is None:
                    continue  # a tombstone (control_audit.py): nothing to apply, nothing wrong
                command = self._admit(record)
                if command is None:
                    continue
                event = command.event
                if event.action == "cancel" and (self.replaying or self._stale(record, command)):
                    self.stale_cancels += 1
                    if not self.replaying:
                        log.debug("control.cancel_stale", offset=record.offset, question_id=event.question_id)
                else:
                    await self.out.send(self.wrap(event, record.offset))
                    self.sent += 1

    def _stale(self, record: ConsumerRecord, command: Command) -> bool:
        # By its record timestamp and by its signed time: a cancel published again keeps the time it was signed.
        signed_age = time.time() * 1000 - command.stamp
        return max(cancel_age_ms(record), signed_age) > self.cancel_max_age_ms

    def _admit(self, record: ConsumerRecord) -> Command | None:
        """The record's command if it is to be applied: it passed the gate and is above its key's sequence."""
        checked = self.gate.check(record)
        if isinstance(checked, Command):
            checked = self.sequences.admit(record, checked)
        if isinstance(checked, Command):
            return checked
        if checked == DUPLICATE:
            self.duplicates += 1
            log.debug("control.duplicate", offset=record.offset, key=shown_key(record.key))
            return None
        log.warning("control.skipped", topic=record.topic, partition=record.partition, offset=record.offset,
                    reason=checked.reason, message=checked.message,
                    **({"key_id": checked.key_id} if checked.key_id else {}), **_unsigned_hint(checked, record))
        self.skipped += 1
        return None


async def caught_up(consumer: AIOKafkaConsumer) -> bool:
    """Whether `consumer` has read every partition it holds up to the highwater of its last fetch."""
    assigned = consumer.assignment()
    if not assigned:
        return False  # no metadata for the topic yet
    for tp in assigned:
        highwater = consumer.highwater(tp)  # from the last fetch response; None before the first
        if highwater is None or await consumer.position(tp) < highwater:
            return False
    return True


def cancel_age_ms(record: ConsumerRecord, now_ms: float | None = None) -> float:
    """How old a record is by its timestamp; one from the future (or with none) is new."""
    now_ms = time.time() * 1000 if now_ms is None else now_ms
    stamp = record.timestamp if record.timestamp is not None and record.timestamp >= 0 else now_ms
    return max(0.0, now_ms - stamp)


def _unsigned_hint(checked: Rejected, record: ConsumerRecord) -> dict:
    """For an unsigned record that is a well-formed command (one written before commands had to be
    signed, typically): the command, and what the operator does to have it applied again."""
    if checked.reason != "unsigned":
        return {}
    try:
        event = decode_control(record.value or b"")
    except Exception:  # noqa: BLE001 - not a command at all: the reason says enough
        return {}
    if event.action == "cancel":
        return {}
    hint = UNSIGNED_HINT + (ROOT_HINT if event.action == "load_adapter" else "")
    return {"action": event.action, "hint": hint, **({"name": event.name} if event.name else {}),
            **({"path": event.path} if event.path else {}), **({"defaults": event.defaults} if event.defaults else {})}


def control_record(event: ControlEvent, signer: Signer, topic: str, *,
                   sequence: int | None = None) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """(key, value, headers) of a command signed for `topic`, as the control topic takes it. A command's
    sequence number defaults to schemas.signing.next_sequence(); a cancel is stamped with the time."""
    value, key = encode(event), control_key(event)
    return key, value, signer.headers(purpose_of(key), topic, key, value, stamp=sequence)


async def send_control(producer, topic: str, event: ControlEvent, signer: Signer):
    """Publish one signed command with a started AIOKafkaProducer and wait for its ack."""
    key, value, headers = control_record(event, signer, topic)
    return await producer.send_and_wait(topic, value, key=key, headers=headers)
