"""The embedded Tansu broker: starts on a free port, serves Kafka clients, stops for good."""

import socket

import anyio
import pytest
from aiokafka.admin import AIOKafkaAdminClient

pytest.register_assert_rewrite("kafka_fixtures")
from consumers import BrokerStartError, EmbeddedBroker, KafkaWorker, embedded_kafka, ensure_topics  # noqa: E402
from kafka_fixtures import kafka_config, produce, read_topic  # noqa: E402
from schemas import BrokerConfig, KafkaConfig  # noqa: E402

pytest_plugins = ["kafka_fixtures"]
pytestmark = pytest.mark.kafka


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiokafka is asyncio-only


def refuses_connections(host: str, port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex((host, port)) != 0


async def list_topics(bootstrap: str) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


@pytest.mark.anyio
async def test_ensure_topics_creates_kevs_topics_and_is_idempotent(kafka_broker):
    cfg = kafka_config(kafka_broker, partitions=3)
    await ensure_topics(cfg)
    await ensure_topics(cfg)  # "already exists" is fine
    topics = await list_topics(kafka_broker.bootstrap_servers)
    assert {cfg.questions_topic, cfg.answers_topic, cfg.deltas_topic, cfg.dlq_topic, cfg.control_topic} <= topics
    sent = await produce(kafka_broker.bootstrap_servers, cfg.questions_topic, [b"x"] * 3, partition=2)
    assert sent == [(2, 0), (2, 1), (2, 2)]  # the third partition exists


@pytest.mark.anyio
async def test_async_broker_serves_a_round_trip_and_stops():
    async with EmbeddedBroker() as broker:
        host, port = broker.host, broker.port
        await broker.create_topics({"t": 1})
        await produce(broker.bootstrap_servers, "t", [b"hello"], key=b"k")
        [record] = await read_topic(broker.bootstrap_servers, "t", 1, linger=0)
        assert (record.key, record.value) == (b"k", b"hello")
    assert not broker.running
    assert refuses_connections(host, port)


def test_sync_start_and_stop_for_session_fixtures():
    broker = EmbeddedBroker().start()
    host, port = broker.host, broker.port
    assert broker.running and not refuses_connections(host, port)
    assert broker.stop() is not None
    assert broker.stop() is None  # stopping twice is harmless
    assert refuses_connections(host, port)


def test_a_broker_that_cannot_start_says_why(tmp_path):
    fake = tmp_path / "tansu"
    fake.write_text("#!/bin/sh\necho 'no such storage engine' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(BrokerStartError, match="no such storage engine"):
        EmbeddedBroker(binary=str(fake)).start()


@pytest.mark.anyio
async def test_embedded_kafka_starts_a_broker_only_for_embedded():
    external = KafkaConfig(bootstrap_servers="kafka.example:9092")
    async with embedded_kafka(external) as cfg:
        assert cfg is external
    async with embedded_kafka(KafkaConfig()) as cfg:
        host, port = cfg.bootstrap_servers.split(":")
        assert host == "127.0.0.1" and not refuses_connections(host, int(port))
    assert refuses_connections(host, int(port))


@pytest.mark.anyio
async def test_broker_port_puts_the_embedded_broker_where_another_process_can_find_it():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with embedded_kafka(KafkaConfig(), BrokerConfig(port=port)) as cfg:
        assert cfg.bootstrap_servers == f"127.0.0.1:{port}" and not refuses_connections("127.0.0.1", port)


@pytest.mark.anyio
async def test_a_worker_refuses_the_unresolved_embedded_address():
    send, receive = anyio.create_memory_object_stream(1)
    with pytest.raises(ValueError, match="embedded_kafka"):
        KafkaWorker(KafkaConfig(), send, receive)


def test_every_topic_kev_creates_asks_for_the_configured_replication_and_min_insync_replicas():
    from consumers.kafka_client.topics import new_topics, topic_configs, topic_plan

    cfg = KafkaConfig(replication_factor=3, min_insync_replicas=2)
    asked = {t.name: t for t in new_topics(cfg, topic_plan(cfg), topic_configs(cfg))}
    assert {t.replication_factor for t in asked.values()} == {3}
    assert {t.topic_configs["min.insync.replicas"] for t in asked.values()} == {"2"}
    assert asked[cfg.control_topic].topic_configs["cleanup.policy"] == "compact"  # its own config kept
    # By default the broker decides (-1 is valid on the wire only beside an empty replica assignment).
    default = new_topics(KafkaConfig(), {"kev.replies.x": 1})[0]
    assert (default.replication_factor, default.replica_assignments, default.topic_configs) == (-1, {}, {})


@pytest.mark.anyio
async def test_the_brokers_default_replication_creates_topics(kafka_broker):
    cfg = kafka_config(kafka_broker, replication_factor=-1, min_insync_replicas=1)
    await ensure_topics(cfg)
    assert {cfg.questions_topic, cfg.control_topic} <= await list_topics(kafka_broker.bootstrap_servers)


def test_the_embedded_broker_refuses_to_listen_beyond_the_loopback():
    with pytest.raises(ValueError, match="loopback only"):
        EmbeddedBroker(host="0.0.0.0")
    EmbeddedBroker(host="::1")  # loopback in either family is fine
