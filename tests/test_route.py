"""`kev route` on the embedded broker: each question lands on its strategy's partition, bad events go
to the DLQ, offsets are committed once the re-publishes are acked, and the command stops cleanly."""

from __future__ import annotations

import signal
import time
from collections import Counter, defaultdict

import anyio
import msgspec
import pytest

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures")
from kafka_fixtures import FAST_GROUP, committed, kafka_config, produce, read_topic  # noqa: E402
from serve_fixtures import KevProcess, kev_env, kev_processes  # noqa: E402

from consumers.messages import HEADER_DLQ_REASON  # noqa: E402
from consumers.publish.partitioner import Partitioner  # noqa: E402
from consumers.route import HEADER_ROUTE, RouteService  # noqa: E402
from schemas import decode_question  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures"]
pytestmark = pytest.mark.anyio

SYSTEMS = [f"You are agent {i}. Answer in one line." for i in range(4)]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def route_config(broker, partitions: int):
    kafka = kafka_config(broker, partitions=partitions)
    return msgspec.structs.replace(kafka, intake_topic=f"in-{kafka.group_id}")


def question(qid: str, system: str | None = None, prompt: str = "What is the sea?", **fields) -> bytes:
    body = {"question_id": qid, "prompt": prompt, **fields}
    if system is not None:
        body["system"] = system
    return msgspec.json.encode(body)


@pytest.mark.kafka
async def test_route_places_by_strategy_dead_letters_bad_events_and_commits(kafka_broker):
    kafka = route_config(kafka_broker, 4)
    good = [question(f"q{i:02d}", SYSTEMS[i % 4], f"Question {i}?") for i in range(40)]
    invalid = question("bad-temperature", params={"temperature": -1})
    undecodable = b"this is not JSON"
    service = RouteService(kafka, "prefix_hash", consumer_options=FAST_GROUP)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            await produce(kafka.bootstrap_servers, kafka.intake_topic, [*good, invalid, undecodable], partition=0)
            routed = await read_topic(kafka.bootstrap_servers, kafka.questions_topic, len(good) + 1, linger=0.5)
            dead = await read_topic(kafka.bootstrap_servers, kafka.dlq_topic, 1, linger=0.2)
            service.stop()

    assert len(routed) == len(good) + 1  # each once: nothing lost, nothing doubled
    expected = Partitioner("prefix_hash", 4)
    by_system = defaultdict(set)
    for record in routed:
        assert (HEADER_ROUTE, b"prefix_hash") in record.headers
        if record.value == invalid:  # the worker on its id's partition answers it with the error
            assert record.partition == expected.fallback("bad-temperature")
            continue
        parsed = decode_question(record.value)
        assert record.partition == expected.partition(parsed)
        by_system[parsed.system].add(record.partition)
    assert set(by_system) == set(SYSTEMS) and all(len(p) == 1 for p in by_system.values()), by_system
    assert [r.value for r in dead] == [undecodable]
    assert HEADER_DLQ_REASON in dict(dead[0].headers)
    assert service.counts == {"records": 42, "forwarded": 40, "invalid": 1, "dead_letters": 1}
    # Everything forwarded was acked before run() returned, and the intake offsets are committed past it all.
    got = await committed(kafka.bootstrap_servers, f"{kafka.group_id}.route", kafka.intake_topic, 4)
    assert got[0] == 42


@pytest.mark.kafka
async def test_kev_route_runs_semantic_hash_from_the_models_files(kafka_broker, tiny_model_dir):
    # run_route is `kev route` less its signal handling: it loads core.model_path's embedding layer itself.
    from engine.routing_embedding import EmbeddingHash
    from kev_async.cli.route import run_route
    from kev_async.runtime.lifecycle import Shutdown
    from schemas import config_from_dict

    kafka = route_config(kafka_broker, 4)
    cfg = msgspec.structs.replace(config_from_dict({"router": {"strategy": "semantic_hash"},
                                                    "core": {"model_path": str(tiny_model_dir)}}), kafka=kafka)
    texts = ["How do I get a refund?", "Um,  how do I get a refund???", "怎么退款", "嗯，请问怎么退款",
             "Why is the sky blue?", "Write a poem about the sea.", "What is a hash map?", "Good morning in Spanish?"]
    values = [question(f"s{i}", prompt=text) for i, text in enumerate(texts)]
    shutdown = Shutdown(drain_deadline=10)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            service = await tg.start(run_route, cfg, shutdown)
            await produce(kafka.bootstrap_servers, kafka.intake_topic, values, partition=0)
            routed = await read_topic(kafka.bootstrap_servers, kafka.questions_topic, len(values), linger=0.3)
            shutdown.request("test over")
    expected = Partitioner("semantic_hash", 4, semantic=EmbeddingHash.from_model_dir(tiny_model_dir))
    placed = {}
    for record in routed:
        assert (HEADER_ROUTE, b"semantic_hash") in record.headers
        parsed = decode_question(record.value)
        placed[parsed.prompt] = record.partition
        assert record.partition == expected.partition(parsed)
    assert len(placed) == len(texts) and service.counts["forwarded"] == len(texts)
    assert placed[texts[0]] == placed[texts[1]] and placed[texts[2]] == placed[texts[3]]  # one normalised text


@pytest.mark.kafka
async def test_a_second_router_resumes_from_the_commit_without_repeats(kafka_broker):
    kafka = route_config(kafka_broker, 2)
    first = [question(f"a{i}") for i in range(10)]
    second = [question(f"b{i}") for i in range(10)]
    for batch in (first, second):
        service = RouteService(kafka, "round_robin", consumer_options=FAST_GROUP)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                await tg.start(service.run)
                await produce(kafka.bootstrap_servers, kafka.intake_topic, batch, partition=0)
                await read_topic(kafka.bootstrap_servers, kafka.questions_topic, 10 if batch is first else 20,
                                 linger=0.3)
                service.stop()
        assert service.counts["forwarded"] == 10  # the second router skipped the first ten
    routed = await read_topic(kafka.bootstrap_servers, kafka.questions_topic, 20, linger=0.5)
    ids = Counter(decode_question(r.value).question_id for r in routed)
    assert len(ids) == 20 and set(ids.values()) == {1}
    assert Counter(r.partition for r in routed) == {0: 10, 1: 10}  # round_robin alternates


@pytest.mark.kafka
async def test_a_routed_question_keeps_its_publish_time(kafka_broker):
    # A question's deadline counts from its record's timestamp: routing must not restart it.
    from aiokafka import AIOKafkaProducer

    kafka = route_config(kafka_broker, 2)
    published_ms = int(time.time() * 1000) - 3_600_000  # an hour ago: a backlog
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(kafka.intake_topic, question("old"), partition=0, timestamp_ms=published_ms)
        await producer.send_and_wait(kafka.intake_topic, question("now"), partition=0)
    finally:
        await producer.stop()
    service = RouteService(kafka, "round_robin", consumer_options=FAST_GROUP)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            routed = await read_topic(kafka.bootstrap_servers, kafka.questions_topic, 2, linger=0.3)
            service.stop()
    stamps = {decode_question(r.value).question_id: r.timestamp for r in routed}
    assert stamps["old"] == published_ms
    assert abs(stamps["now"] - time.time() * 1000) < 60_000  # its own publish time, not an hour ago


@pytest.mark.kafka
async def test_kev_route_command_routes_and_exits_0_on_sigterm(kafka_broker, tmp_path):
    kafka = route_config(kafka_broker, 2)
    env = kev_env(KEV_KAFKA__GROUP_ID=kafka.group_id, KEV_KAFKA__QUESTIONS_TOPIC=kafka.questions_topic,
                  KEV_KAFKA__INTAKE_TOPIC=kafka.intake_topic, KEV_KAFKA__DLQ_TOPIC=kafka.dlq_topic,
                  KEV_KAFKA__ANSWERS_TOPIC=kafka.answers_topic, KEV_KAFKA__DELTAS_TOPIC=kafka.deltas_topic,
                  KEV_KAFKA__CONTROL_TOPIC=kafka.control_topic, KEV_KAFKA__PARTITIONS="2",
                  KEV_KAFKA_SESSION_TIMEOUT_MS="2000")
    with kev_processes() as children:
        route = KevProcess(["route", "--bootstrap-servers", kafka.bootstrap_servers, "--strategy", "consistent_hash"],
                           env, tmp_path / "route.log")
        children.append(route)
        values = [question(f"t{i}", tenant=f"tenant-{i % 3}") for i in range(12)]
        await produce(kafka.bootstrap_servers, kafka.intake_topic, values, partition=0)
        routed = await read_topic(kafka.bootstrap_servers, kafka.questions_topic, 12, timeout=90, linger=0.3)
        assert len(routed) == 12, route.describe()
        tenants = defaultdict(set)
        for record in routed:
            tenants[decode_question(record.value).tenant].add(record.partition)
        assert all(len(p) == 1 for p in tenants.values()), tenants
        route.signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(route.wait, 30) == 0, route.describe()
    assert (await committed(kafka.bootstrap_servers, f"{kafka.group_id}.route", kafka.intake_topic, 2))[0] == 12
