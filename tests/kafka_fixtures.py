"""Shared Kafka test helpers: one embedded Tansu broker per session, plain clients to feed and read it.

Load with `pytest_plugins = ["kafka_fixtures"]` (one broker for every module that does).
Each test gets its own topics and consumer group, so tests never see each other's records.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import anyio
import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.structs import ConsumerRecord
from polling import eventually

from consumers import EmbeddedBroker, Inbound, KafkaWorker, Outbound
from schemas import AnswerDelta, AnswerEvent, KafkaConfig

# Tansu makes a new group wait about half a session timeout, and a member that left wait about two:
# short sessions keep the suite fast. Production keeps aiokafka's defaults.
FAST_GROUP = {"session_timeout_ms": 2000, "heartbeat_interval_ms": 200, "rebalance_timeout_ms": 2000}

Engine = Callable[[object, object], Awaitable[None]]


@pytest.fixture(scope="session")
def kafka_broker() -> Iterable[EmbeddedBroker]:
    broker = EmbeddedBroker().start()
    yield broker
    broker.stop()


def kafka_config(broker: EmbeddedBroker, **overrides) -> KafkaConfig:
    """A config whose topics and group are this test's alone."""
    tag = uuid.uuid4().hex[:8]
    fields = {
        "bootstrap_servers": broker.bootstrap_servers, "group_id": f"kev-test-{tag}",
        "questions_topic": f"q-{tag}", "answers_topic": f"a-{tag}", "deltas_topic": f"d-{tag}",
        "dlq_topic": f"dlq-{tag}", "control_topic": f"ctl-{tag}", "partitions": 2,
        "commit_interval_ms": 100,
    }
    return KafkaConfig(**(fields | overrides))


def question(question_id: str, prompt: str = "hello", **fields) -> bytes:
    return msgspec.json.encode({"question_id": question_id, "prompt": prompt, **fields})


async def produce(bootstrap: str, topic: str, values: Iterable[bytes | None], *, key: bytes | None = None,
                  partition: int | None = None) -> list[tuple[int, int]]:
    """Send each value and wait for its ack; returns (partition, offset) of each."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        sent = [await producer.send_and_wait(topic, value, key=key, partition=partition) for value in values]
    finally:
        await producer.stop()
    return [(meta.partition, meta.offset) for meta in sent]


async def read_topic(bootstrap: str, topic: str, count: int, *, timeout: float = 20.0,
                     linger: float = 0.5) -> list[ConsumerRecord]:
    """Every record of `topic` from the start: wait for `count`, then `linger` to catch extras."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    records: list[ConsumerRecord] = []
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(records) < count:
            batch = await consumer.getmany(timeout_ms=100)
            records += [record for part in batch.values() for record in part]
        linger_until = time.monotonic() + linger
        while time.monotonic() < linger_until:
            batch = await consumer.getmany(timeout_ms=100)
            records += [record for part in batch.values() for record in part]
    finally:
        await consumer.stop()
    return records


async def committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int | None]:
    """The group's committed position per partition (None: nothing committed)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        return {p: await consumer.committed(TopicPartition(topic, p)) for p in range(partitions)}
    finally:
        await consumer.stop()


async def end_offsets(bootstrap: str, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
    """The offset the next record of each partition will get: what is acked lies below it."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    await consumer.start()
    try:
        return await consumer.end_offsets(partitions)
    finally:
        await consumer.stop()


async def read_to_end(bootstrap: str, topic: str, *, timeout: float = 20.0) -> list[ConsumerRecord]:
    """Every record of `topic` up to its end offsets as they are at the first look: once it returns, no
    record already acked on `topic` was missed (a positive signal, unlike lingering a while)."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    records: list[ConsumerRecord] = []
    ends: dict[TopicPartition, int] = {}

    async def at_the_end() -> bool:
        batch = await consumer.getmany(timeout_ms=100)
        records.extend(record for part in batch.values() for record in part)
        if not ends and consumer.assignment():
            ends.update(await consumer.end_offsets(list(consumer.assignment())))
        return bool(ends) and all([await consumer.position(tp) >= end for tp, end in ends.items()])

    try:
        await eventually(at_the_end, timeout=timeout, every=0, what=lambda: f"read {topic} up to {ends}")
    finally:
        await consumer.stop()
    return records


async def wait_committed(bootstrap: str, group: str, topic: str, expected: dict[int, int | None],
                         timeout: float = 20.0) -> None:
    """Until the group's committed positions on `topic` are exactly `expected`."""
    seen: dict[int, int | None] = {}

    async def as_expected() -> bool:
        seen.update(await committed(bootstrap, group, topic, len(expected)))
        return seen == expected

    await eventually(as_expected, timeout=timeout, every=0.1,
                     what=lambda: f"committed {seen} on {topic}, expected {expected}")


def answer_for(inbound: Inbound) -> AnswerEvent:
    q = inbound.question
    return AnswerEvent(question_id=q.question_id, request_id=q.request_id, text=f"echo: {q.prompt}")


class StandInEngine:
    """Test code in the engine's place: answers each Inbound with an echo, once `gate` is open."""

    def __init__(self, *, open_gate: bool = True, never_answer: frozenset[str] = frozenset()) -> None:
        self.gate = anyio.Event()
        self.never_answer = never_answer  # question_ids it takes and sits on, like a stuck engine
        self.received: list[Inbound] = []
        if open_gate:
            self.gate.set()

    async def __call__(self, inbox, outbox) -> None:
        async with inbox, outbox:
            await self.gate.wait()
            async for inbound in inbox:
                self.received.append(inbound)
                if inbound.question.question_id in self.never_answer:
                    continue
                if inbound.question.stream:
                    for seq, word in enumerate(("echo", ":", " done")):
                        delta = AnswerDelta(inbound.question.question_id, seq, word, done=seq == 2)
                        await outbox.send(Outbound(delta, inbound))
                await outbox.send(Outbound(answer_for(inbound), inbound))


class HoldingEngine:
    """Takes every question at once but answers only when `release` is set."""

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.received: list[Inbound] = []

    async def __call__(self, inbox, outbox) -> None:
        async with inbox, outbox:
            held: list[Inbound] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._collect, inbox, held)
                await self.release.wait()
                for inbound in held:
                    await outbox.send(Outbound(answer_for(inbound), inbound))
                held.clear()
                tg.cancel_scope.cancel()
            async for inbound in inbox:  # after release, answer the rest as they come
                self.received.append(inbound)
                await outbox.send(Outbound(answer_for(inbound), inbound))

    async def _collect(self, inbox, held: list[Inbound]) -> None:
        async for inbound in inbox:
            self.received.append(inbound)
            held.append(inbound)


@contextlib.asynccontextmanager
async def running_worker(cfg: KafkaConfig, engine: Engine | None = None, *, buffer: int = 16,
                         **options) -> AsyncIterator[KafkaWorker]:
    """A KafkaWorker and a stand-in engine; on exit a graceful stop (intake off, engine drains)."""
    questions_out, questions_in = anyio.create_memory_object_stream[Inbound](buffer)
    answers_out, answers_in = anyio.create_memory_object_stream[Outbound](buffer)
    options = {"consumer_options": FAST_GROUP, **options}
    worker = KafkaWorker(cfg, questions_out, answers_in, **options)
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine or StandInEngine(), questions_in, answers_out)
        await tg.start(worker.run)
        with anyio.fail_after(20):
            await worker.wait_assigned()
        yield worker
        worker.stop_intake()


async def produce_records(bootstrap: str, topic: str,
                          records: Iterable[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]]
                          ) -> list[tuple[int, int]]:
    """Send each (key, value, headers) and wait for its ack; returns (partition, offset) of each."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        sent = [await producer.send_and_wait(topic, value, key=key, headers=headers)
                for key, value, headers in records]
    finally:
        await producer.stop()
    return [(meta.partition, meta.offset) for meta in sent]
