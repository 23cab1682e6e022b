"""Read-ahead intake through the real broker and `kev serve` in process (tiny model): one tenant's flood
in a partition does not hide another tenant's question behind it (kafka.read_ahead, consumers/intake/loop.py),
and offsets are still committed only past answered records; records held past a window are dropped at a
rebalance and read again by the partition's owner (a KafkaWorker with a stand-in engine)."""

from __future__ import annotations

from functools import partial

import anyio
import msgspec
import pytest
from aiokafka import AIOKafkaProducer

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures")
from kafka_fixtures import (  # noqa: E402
    HoldingEngine,
    kafka_config,
    produce,
    question,
    read_topic,
    running_worker,
    wait_committed,
)
from polling import eventually  # noqa: E402

from schemas import KevConfig, decode_answer  # noqa: E402
from schemas.kafka_config import TrustConfig  # noqa: E402
from schemas.signing import QUESTION, Signer  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures"]
pytestmark = pytest.mark.anyio

KEY_ID, SECRET = "teams", "read-ahead-test-secret"
FLOOD = 24
BATCH = 4
# The consumer group's session (`kev serve` reads it from the environment): Tansu holds a new group's first
# assignment about half of it.
SESSION = {"KEV_KAFKA_SESSION_TIMEOUT_MS": "2000"}


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _config(kafka_broker, *, partitions: int, read_ahead: int, channel_pool_size: int) -> KevConfig:
    kafka = kafka_config(kafka_broker, partitions=partitions, read_ahead=read_ahead, fetch_max_wait_ms=500,
                         trust=TrustConfig(keys={KEY_ID: SECRET}))
    cfg = KevConfig(kafka=kafka)
    return msgspec.structs.replace(
        cfg, core=msgspec.structs.replace(cfg.core, max_context=96, device="cpu"),
        router=msgspec.structs.replace(cfg.router, max_parallel_queries=BATCH, channel_pool_size=channel_pool_size),
        kv_cache=msgspec.structs.replace(cfg.kv_cache, num_blocks=256),
        metrics=msgspec.structs.replace(cfg.metrics, port=0))


async def _publish(cfg: KevConfig, asks: list[tuple[str, str, int, int]]) -> None:
    """Each (question_id, tenant, max_new_tokens, partition), signed, so its tenant is its principal's."""
    signer = Signer.hmac(KEY_ID, SECRET)
    topic = cfg.kafka.questions_topic
    producer = AIOKafkaProducer(bootstrap_servers=cfg.kafka.bootstrap_servers, acks="all")
    await producer.start()
    try:
        for qid, tenant, tokens, partition in asks:
            value = question(qid, f"Question {qid}: what comes next?", tenant=tenant,
                             params={"max_new_tokens": tokens, "temperature": 0.0})
            key = qid.encode()
            await producer.send_and_wait(topic, value, key=key, partition=partition,
                                         headers=signer.headers(QUESTION, topic, key, value))
    finally:
        await producer.stop()


async def _serve_and_read(cfg: KevConfig, model, count: int) -> list:
    """Every answer, in the order the engine finished them; the group's commits past every question."""
    from kev_async.app import serve
    from kev_async.runtime.lifecycle import Shutdown

    shutdown = Shutdown(drain_deadline=30.0)
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            await tg.start(partial(serve, cfg, shutdown, model=model))
            records = await read_topic(cfg.kafka.bootstrap_servers, cfg.kafka.answers_topic, count,
                                       timeout=60, linger=0.5)
            shutdown.request("test over")
    answers = [decode_answer(record.value) for record in records]
    assert sorted(a.question_id for a in answers) == sorted({a.question_id for a in answers}), "an answer twice"
    assert all(a.error is None for a in answers), [a.error for a in answers if a.error]
    return sorted(answers, key=lambda a: (a.timings.finished_ms, a.question_id))


@pytest.mark.kafka
async def test_a_question_behind_a_flood_in_its_partition_is_answered_before_the_flood_s_tail(
        kafka_broker, tiny_model, monkeypatch):
    for name, value in SESSION.items():
        monkeypatch.setenv(name, value)
    read_ahead = 12  # under the flood: the chat question is read once 13 of bulk's are answered
    cfg = _config(kafka_broker, partitions=1, read_ahead=read_ahead, channel_pool_size=16)
    asks = [(f"bulk-{i:02d}", "bulk", 32, 0) for i in range(FLOOD)] + [("chat-0", "chat", 4, 0)]
    await _publish(cfg, asks)  # all there before the worker reads: one partition, the flood first

    answers = await _serve_and_read(cfg, tiny_model, len(asks))

    assert sorted(a.question_id for a in answers) == sorted(qid for qid, *_ in asks)
    # The window bounds what the engine holds of the partition: never more than read_ahead of the flood at
    # once, whatever the engine's speed against the broker's.
    bulk = [(a.timings.started_ms, a.timings.finished_ms) for a in answers if a.question_id.startswith("bulk")]
    assert max(sum(start <= at < end for start, end in bulk) for at, _ in bulk) <= read_ahead
    # Records past the window are held by the worker and go in as the flood's answers settle, without a
    # fetch round trip (the embedded broker holds each fetch for its whole wait, 500 ms here, while the tiny
    # model answers a window in about 100 ms). So chat-0 is read while the flood still holds most of the
    # window (13 of bulk's answered, 11 still in the engine) and takes a channel then: a batch or more of
    # the flood is answered after it.
    order = [a.question_id for a in answers]
    assert len(order) - 1 - order.index("chat-0") >= BATCH, order
    # Commit-after-ack: the group's position is past every question once all are answered.
    await wait_committed(cfg.kafka.bootstrap_servers, cfg.kafka.group_id, cfg.kafka.questions_topic,
                         {0: len(asks)})


@pytest.mark.kafka
async def test_a_flood_in_one_partition_leaves_the_engine_room_for_another_partition_s_question(
        kafka_broker, tiny_model, monkeypatch):
    for name, value in SESSION.items():
        monkeypatch.setenv(name, value)
    # One batch of the flood is read ahead; the channel pool's other half is the other partition's.
    cfg = _config(kafka_broker, partitions=2, read_ahead=BATCH, channel_pool_size=2 * BATCH)
    asks = [(f"bulk-{i:02d}", "bulk", 32, 0) for i in range(FLOOD)] + [("chat-0", "chat", 4, 1)]
    await _publish(cfg, asks)

    order = [a.question_id for a in await _serve_and_read(cfg, tiny_model, len(asks))]

    assert order.index("chat-0") <= BATCH, order  # at worst behind the flood's first batch, not its backlog
    await wait_committed(cfg.kafka.bootstrap_servers, cfg.kafka.group_id, cfg.kafka.questions_topic,
                         {0: FLOOD, 1: 1})


@pytest.mark.kafka
async def test_records_held_past_the_window_are_read_again_after_a_rebalance(kafka_broker):
    # The first worker takes two records per partition and holds the rest of each fetch; a second worker
    # joins and takes one partition. What the first held is dropped, not handed in under the new assignment
    # (its tracker would see an offset go back): each partition is read again from its committed position.
    cfg = kafka_config(kafka_broker, partitions=2)
    bootstrap = kafka_broker.bootstrap_servers
    engine = HoldingEngine()
    names = [f"h{i}" for i in range(12)]
    async with running_worker(cfg, engine, read_ahead=2) as first:
        sent = []
        for partition in (0, 1):
            sent += await produce(bootstrap, cfg.questions_topic, [question(n) for n in names[partition::2]],
                                  partition=partition)
        await eventually(lambda: first.statistics().read_ahead_held > 0 and first.statistics().in_flight == 4)
        async with running_worker(cfg) as second:
            await eventually(lambda: len(first.statistics().assigned) == 1 == len(second.statistics().assigned))
            engine.release.set()
            await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, {0: 6, 1: 6})
            answers = await read_topic(bootstrap, cfg.answers_topic, 12, linger=1.0)

    assert sorted(r.key.decode() for r in answers) == sorted(names)  # each exactly once
    assert max(offset for _, offset in sent) == 5
