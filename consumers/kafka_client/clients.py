"""Kev's one way to open a Kafka client: security, acks, idempotence and the stop, written once.

    async with open_consumer(cfg.kafka, cfg.kafka.control_topic) as consumer:
        batch = await fetch(consumer, timeout_ms=100)
    async with open_producer(cfg.kafka) as producer:
        await producer.send_and_wait(topic, value)

Every client gets `kafka.security`. A consumer joins no group unless given one, commits nothing by
itself and starts at the earliest offset; a producer waits for every in-sync replica (`acks="all"`)
and is not idempotent unless asked (`enable_idempotence=True`, or a `transactional_id`). Any keyword
overrides these. A client that fails to start is closed before the error goes on; leaving the block stops it,
shielded from cancellation and bounded (a dead broker must not hang a shutdown), and a failed stop
is a warning, never the error the caller sees.

Importing this module installs the fetch guard (record_guard.py), so no consumer Kev opens can be
stopped by a record's bytes and a read_committed one never sees an aborted transaction's records, and
the InitProducerId adapter (init_producer_id.py), without which aiokafka's idempotent and
transactional producers cannot start on the embedded Tansu, and the coordinator lookup's retry
(coordinator_lookup.py), without which a broker restart mid-lookup ends a producer. `fetch` is `getmany` that also survives
the one error aiokafka raises after it has already skipped past the offset (a record larger than the
fetch size).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError, RecordTooLargeError
from aiokafka.structs import TopicPartition

from consumers.kafka_client import coordinator_lookup, init_producer_id

from consumers.kafka_client import record_guard
from consumers.kafka_client.security import client_options
from schemas import KafkaConfig

log = structlog.get_logger("kev.consumers.kafka_client.clients")

record_guard.install()
init_producer_id.install()
coordinator_lookup.install()

STOP_TIMEOUT_S = 5.0


def consumer_options(cfg: KafkaConfig, **options: Any) -> dict[str, Any]:
    """AIOKafkaConsumer keyword arguments: Kev's defaults, then `options`."""
    return {"bootstrap_servers": cfg.bootstrap_servers, "group_id": None, "enable_auto_commit": False,
            "auto_offset_reset": "earliest", **client_options(cfg.security), **options}


def producer_options(cfg: KafkaConfig, **options: Any) -> dict[str, Any]:
    """AIOKafkaProducer keyword arguments: Kev's defaults, then `options`."""
    return {"bootstrap_servers": cfg.bootstrap_servers, "acks": "all", "enable_idempotence": False,
            "max_request_size": cfg.max_request_size, **client_options(cfg.security), **options}


@asynccontextmanager
async def open_consumer(cfg: KafkaConfig, *topics: str, stop_timeout_s: float = STOP_TIMEOUT_S,
                        **options: Any) -> AsyncIterator[AIOKafkaConsumer]:
    """A started consumer (subscribed to `topics`, if any), stopped when the block ends."""
    consumer = AIOKafkaConsumer(*topics, **consumer_options(cfg, **options))
    async with _running(consumer, "consumer", stop_timeout_s):
        yield consumer


@asynccontextmanager
async def open_producer(cfg: KafkaConfig, *, stop_timeout_s: float = STOP_TIMEOUT_S,
                        **options: Any) -> AsyncIterator[AIOKafkaProducer]:
    """A started producer, flushed and stopped when the block ends."""
    producer = AIOKafkaProducer(**producer_options(cfg, **options))
    async with _running(producer, "producer", stop_timeout_s):
        yield producer


@asynccontextmanager
async def open_admin(cfg: KafkaConfig, **options: Any) -> AsyncIterator[AIOKafkaAdminClient]:
    admin = AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers, **client_options(cfg.security), **options)
    try:
        await admin.start()
        yield admin
    finally:
        with anyio.move_on_after(STOP_TIMEOUT_S, shield=True):
            await quietly(admin.close(), "admin")


async def tracked(producer: AIOKafkaProducer, topic: str) -> None:
    """Make `topic` one the producer's metadata refreshes ask for; call before sending to it.

    aiokafka answers a send's metadata wait from whatever its cluster view holds, and its first view is
    the answer to a request for no topics, which Tansu answers with every topic. A topic known that way
    is not tracked: the next refresh (for a topic the producer adds later, a reply topic) asks for the
    tracked topics only and the view loses the first one's leader. A record queued for it meanwhile
    (in a transaction: held while its partition joins) then waits request_timeout_ms and fails with
    NotLeaderForPartition, and the idempotent retry with OutOfOrderSequenceNumber."""
    await producer.client.add_topic(topic)  # already tracked: a future that is already done


async def fetch(consumer: AIOKafkaConsumer, *partitions: TopicPartition, timeout_ms: int,
                max_records: int | None = None) -> dict:
    """`consumer.getmany` (of `partitions`, else of every assigned one), where a record too large to fetch
    is logged (aiokafka has moved past it) and the call returns nothing this time instead of raising."""
    try:
        return await consumer.getmany(*partitions, timeout_ms=timeout_ms, max_records=max_records)
    except RecordTooLargeError as error:
        log.error("kafka.record_skipped", reason="larger than max_partition_fetch_bytes", error=str(error)[:500])
        return {}


@asynccontextmanager
async def _running(client, kind: str, stop_timeout_s: float):
    try:
        await client.start()
    except BaseException:
        with anyio.move_on_after(stop_timeout_s, shield=True):
            await quietly(client.stop(), kind)  # a client that never started still holds its connections
        raise
    try:
        yield client
    finally:
        with anyio.move_on_after(stop_timeout_s, shield=True):
            await quietly(client.stop(), kind)


async def quietly(stopping, kind: str = "client") -> None:
    """Await a client's stop; its failure is logged, not raised (the caller is leaving anyway)."""
    try:
        await stopping
    except KafkaError as error:
        log.warning("kafka.stop_failed", client=kind, error=repr(error))
    except asyncio.CancelledError:
        # With the broker gone, aiokafka's stop() awaits its own cancelled heartbeat task and passes that
        # task's CancelledError on: not a cancel of ours, and it would hide why the loop stopped.
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise
        log.warning("kafka.stop_failed", client=kind, error="a client task's cancellation leaked out of stop()")
