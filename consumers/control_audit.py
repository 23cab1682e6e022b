"""Dead letters for control records that will not be applied (unsigned, forged, wrongly keyed, not a
command), written once for the whole fleet.

Every worker's control reader reads every control record (no consumer group), so if readers wrote
the dead letters, N workers would write N copies of each, and every restart would write them again
on replay. The audit is instead one consumer group, `<kafka.group_id>.control-audit`, that every
worker joins: the control topic's single partition is assigned to one member at a time, which
dead-letters each rejected record and commits past it once the dead letter is acked. A record is
dead-lettered once (at least once, if a member dies between the ack and the commit), also when it
was published while no worker ran. The dead letter keeps the record's value, key and headers and
adds the dlq.* headers (consumers/messages.py) with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord
from anyio.abc import TaskStatus

from consumers.control import ControlGate, Rejected
from consumers.messages import (
    HEADER_DLQ_MESSAGE,
    HEADER_DLQ_OFFSET,
    HEADER_DLQ_PARTITION,
    HEADER_DLQ_REASON,
    HEADER_DLQ_TOPIC,
)
from consumers.security import client_options
from schemas import KafkaConfig

log = structlog.get_logger("kev.consumers.control_audit")


def audit_group(cfg: KafkaConfig) -> str:
    return f"{cfg.group_id}.control-audit"


async def run_control_audit(
    cfg: KafkaConfig,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    poll_timeout_ms: int = 200,
    consumer_options: Mapping[str, Any] | None = None,  # extra AIOKafkaConsumer kwargs (group timings)
) -> None:
    """Dead-letter every rejected control record until cancelled; expects the control topic to exist."""
    security = client_options(cfg.security)
    consumer = AIOKafkaConsumer(cfg.control_topic, bootstrap_servers=cfg.bootstrap_servers,
                                group_id=audit_group(cfg), enable_auto_commit=False,
                                auto_offset_reset="earliest", **security, **dict(consumer_options or {}))
    # acks=all without idempotence, as the worker: Tansu rejects idempotent producers.
    producer = AIOKafkaProducer(bootstrap_servers=cfg.bootstrap_servers, acks="all", enable_idempotence=False,
                                **security)
    gate = ControlGate(cfg)
    await producer.start()
    try:
        await consumer.start()
        task_status.started()
        while True:
            batch = await consumer.getmany(timeout_ms=poll_timeout_ms)
            for records in batch.values():
                for record in records:
                    checked = gate.check(record)
                    if isinstance(checked, Rejected):
                        await _dead_letter(producer, cfg.dlq_topic, record, checked)
                        # Past it at once (not the whole batch): a rebalance now must not send it twice.
                        await _commit(consumer, {TopicPartition(record.topic, record.partition): record.offset + 1})
            if batch:
                await _commit(consumer)
    finally:
        with anyio.move_on_after(5.0, shield=True):
            for client in (consumer, producer):
                try:
                    await client.stop()
                except KafkaError as error:
                    log.warning("control.audit_stop_failed", error=repr(error))


async def _commit(consumer: AIOKafkaConsumer, offsets=None) -> None:
    try:
        await consumer.commit(offsets)
    except KafkaError as error:  # a rebalance under way: the next member starts from the last commit
        log.warning("control.audit_commit_failed", error=repr(error))


async def _dead_letter(producer: AIOKafkaProducer, topic: str, record: ConsumerRecord, why: Rejected) -> None:
    headers = [*record.headers,
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

