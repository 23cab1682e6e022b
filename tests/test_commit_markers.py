"""Transactional commits across a broker SIGKILL, on the durable embedded broker. Both found by `kev drill
--exactly-once` in CI:

- a commit the broker answered without writing its marker (consumers/publish/commit_markers.py): Tansu,
  SIGKILLed while a producer's EndTxn(commit) is on its way, comes back with the group's offsets committed
  and the records undecided (a question answered, its offset committed, its answer never shown
  read_committed); here it is made on purpose, then mended;
- a producer whose coordinator lookup lost its connection as the broker went down: aiokafka ended its
  sender for good (consumers/kafka_client/coordinator_lookup.py), and the worker with it."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition

from consumers import EmbeddedBroker, create_topics
from consumers.kafka_client.clients import fetch, open_consumer, producer_options
from consumers.messages import Partition
from consumers.publish.commit_markers import unmarked
from consumers.publish.partition_transaction import Deferred, Transaction
from schemas import KafkaConfig

pytest_plugins = ["serve_fixtures"]
pytestmark = [pytest.mark.anyio, pytest.mark.kafka]

OUT, SOURCE, GROUP = TopicPartition("out", 0), TopicPartition("in", 0), "g"
KILL_AFTER_MS = (1, 2, 3, 2, 4)  # the EndTxn is in flight a few ms after commit_transaction begins: one try each


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiokafka


@pytest.fixture
async def broker(tmp_path: Path):
    from serve_fixtures import free_port

    broker = EmbeddedBroker(port=free_port(), storage="durable", data_dir=tmp_path / "broker")
    await broker.astart()
    try:
        yield broker
    finally:
        broker.stop()


async def read_committed(cfg: KafkaConfig) -> list[bytes]:
    """Every record of `out` a read_committed reader is handed (Kev's reader: the fetch guard drops aborted ones)."""
    values: list[bytes] = []
    async with open_consumer(cfg, isolation_level="read_committed") as consumer:
        consumer.assign([OUT])
        await consumer.seek_to_beginning(OUT)
        with anyio.move_on_after(3):
            while True:
                for records in (await fetch(consumer, timeout_ms=200)).values():
                    values += [record.value for record in records]
    return values


async def half_done_commit(broker: EmbeddedBroker, cfg: KafkaConfig) -> tuple[AIOKafkaProducer, list[Deferred]]:
    """A producer whose transaction (three records, the source offset 3) the broker answered as committed
    but left unmarked; tried afresh (new topics' offsets) until the kill lands mid-EndTxn."""
    for attempt, delay_ms in enumerate(KILL_AFTER_MS):
        producer = AIOKafkaProducer(**producer_options(cfg, transactional_id=f"t{attempt}", enable_idempotence=True,
                                                       request_timeout_ms=1000))
        await producer.start()
        await producer.begin_transaction()
        records = [record(producer, f"r{i}".encode()) for i in range(3)]
        for deferred in records:
            deferred.offset = (await (await deferred.again(producer))).offset
        await producer.send_offsets_to_transaction({SOURCE: 3}, GROUP)
        async with anyio.create_task_group() as tg:
            tg.start_soon(producer.commit_transaction)
            await anyio.sleep(delay_ms / 1000)
            await broker.arestart(kill=True)
        if await unmarked(producer, {OUT: records[-1].offset}):
            return producer, records
        await producer.stop()
    pytest.fail(f"no SIGKILL at {KILL_AFTER_MS} ms into a commit left it unmarked: has Tansu changed? "
                "(consumers/publish/commit_markers.py may no longer be needed)")


def record(producer: AIOKafkaProducer, value: bytes) -> Deferred:
    async def again(into: AIOKafkaProducer):
        return await into.send(OUT.topic, value, partition=OUT.partition)

    nothing = lambda: None  # noqa: E731 - settlement is the publisher's, not under test here
    return Deferred(nothing, nothing, nothing, again, OUT, -1)


async def test_tansu_killed_mid_commit_leaves_its_records_undecided_and_mend_shows_each_once(broker):
    cfg = KafkaConfig(bootstrap_servers=broker.bootstrap_servers)
    await create_topics(cfg, {OUT.topic: 1, SOURCE.topic: 1})
    await read_committed(cfg)  # nothing before: the topic's first records are the transaction's
    producer, records = await half_done_commit(broker, cfg)
    try:
        before = len(await read_committed(cfg))
        txn = Transaction(Partition(SOURCE.topic, SOURCE.partition), producer, deferred=records)
        aborted = await txn.mend({Partition(SOURCE.topic, SOURCE.partition): 3}, GROUP, window_s=30.0)
        after = await read_committed(cfg)
        still = await unmarked(producer, txn.last_offsets(), wait_s=0.0)
    finally:
        await producer.stop()
    assert aborted == 1 and not still
    # Undecided before; after, each record once: the originals aborted with a copy each, then sent again.
    assert after[before:] == [b"r0", b"r1", b"r2"] and len(after) - before == 3


async def test_a_marked_commit_is_found_marked_and_left_alone(broker):
    cfg = KafkaConfig(bootstrap_servers=broker.bootstrap_servers)
    await create_topics(cfg, {OUT.topic: 1, SOURCE.topic: 1})
    producer = AIOKafkaProducer(**producer_options(cfg, transactional_id="plain", enable_idempotence=True))
    await producer.start()
    try:
        await producer.begin_transaction()
        records = [record(producer, b"one"), record(producer, b"two")]
        for deferred in records:
            deferred.offset = (await (await deferred.again(producer))).offset
        await producer.send_offsets_to_transaction({SOURCE: 2}, GROUP)
        await producer.commit_transaction()
        txn = Transaction(Partition(SOURCE.topic, SOURCE.partition), producer, deferred=records)
        aborted = await txn.mend({Partition(SOURCE.topic, SOURCE.partition): 2}, GROUP, window_s=30.0)
    finally:
        await producer.stop()
    assert aborted == 0 and await read_committed(cfg) == [b"one", b"two"]


async def test_a_producer_whose_commit_meets_a_broker_restart_commits_once_it_is_back(broker):
    # Each try a fresh producer and group, so the commit looks up the group's coordinator, and the broker is
    # SIGKILLed 0-5 ms into it. Stock aiokafka's sender died in 2 of 18 such tries ("Unexpected error during
    # batch delivery": a lookup whose connection closed); every commit must go through.
    cfg = KafkaConfig(bootstrap_servers=broker.bootstrap_servers)
    await create_topics(cfg, {OUT.topic: 1, SOURCE.topic: 1})
    outcomes = []
    for attempt in range(10):
        producer = AIOKafkaProducer(**producer_options(cfg, transactional_id=f"restart-{attempt}",
                                                       enable_idempotence=True, request_timeout_ms=1000))
        await producer.start()
        try:
            await producer.begin_transaction()
            await producer.send_and_wait(OUT.topic, f"v{attempt}".encode(), partition=OUT.partition)

            async def commit() -> None:
                try:
                    with anyio.fail_after(30):
                        await producer.send_offsets_to_transaction({SOURCE: attempt + 1}, f"group-{attempt}")
                        await producer.commit_transaction()
                    outcomes.append("committed")
                except Exception as error:  # noqa: BLE001 - the outcome is what is asserted
                    outcomes.append(repr(error))

            async with anyio.create_task_group() as tg:
                tg.start_soon(commit)
                await anyio.sleep((attempt % 6) / 1000)
                await broker.arestart(kill=True)
        finally:
            await producer.stop()
    assert outcomes == ["committed"] * 10
