"""Replaying kev.control is idempotent (review finding): a command carries its record offset as its id,
and an engine that applied an id already answers as the first time instead of loading a new version."""

from __future__ import annotations

from functools import partial

import anyio
import msgspec
import pytest

pytest.register_assert_rewrite("kafka_fixtures")
from kafka_fixtures import kafka_config, produce_records  # noqa: E402
from polling import eventually  # noqa: E402

from schemas import AdaptersConfig, ControlEvent, TrustConfig  # noqa: E402
from schemas.signing import Signer  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures"]
pytestmark = pytest.mark.anyio
ADAPTER = "style"
TRUST = TrustConfig(keys={"ops": "a-secret-for-the-tests"})


@pytest.fixture
def anyio_backend():
    return "asyncio"


def named(logs, event: str) -> list[dict]:
    return [e for e in logs if e.get("event") == event]


def engine_options():
    from engine import EngineOptions
    from engine.sampling_defaults import Defaults

    return EngineOptions(max_parallel_queries=4, num_blocks=64, max_context=128, batch_window_ms=0, defaults=Defaults())


async def test_engine_actor_applies_each_command_id_once(tiny_model, tmp_path, logs):
    from engine import Engine
    from engine.adapters.files import AdapterError
    from adapter_fixtures import write_random_adapter
    from kev_async.engine_actor import LoadAdapter, UpdateDefaults, engine_actor
    from kev_async.runtime.actors import Mailbox, ask

    path = write_random_adapter(tmp_path / ADAPTER, tiny_model, rank=4, seed=0)
    questions, answers = Mailbox("q", 8), Mailbox("a", 8)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(partial(engine_actor, questions.receive, answers.send,
                                   engine_factory=lambda: Engine(tiny_model, engine_options())))
            first = await ask(questions.send, LoadAdapter(ADAPTER, path, command_id=3))
            again = await ask(questions.send, LoadAdapter(ADAPTER, path, command_id=3))
            assert first.version == again.version == 1
            reload = await ask(questions.send, LoadAdapter(ADAPTER, path, command_id=4))  # a new command
            assert reload.version == 2
            v1 = await ask(questions.send, UpdateDefaults({"temperature": 0.5}, command_id=5))
            assert await ask(questions.send, UpdateDefaults({"temperature": 0.5}, command_id=5)) == v1
            for _ in range(2):  # a failed command fails the same way, without trying again
                with pytest.raises(AdapterError):
                    await ask(questions.send, LoadAdapter("broken", tmp_path / "missing", command_id=6))
            questions.send.close()
    assert len(named(logs, "lora.loaded")) == 2
    assert len(named(logs, "engine_actor.adapter_failed")) == 1
    assert len(named(logs, "engine_actor.command_replayed")) == 3


@pytest.mark.kafka
async def test_a_restarted_control_actor_replays_without_reapplying(kafka_broker, tiny_model, tmp_path, logs):
    from consumers import control_record, create_topics
    from engine import Engine
    from kev_async.app import control_actor
    from adapter_fixtures import write_random_adapter
    from kev_async.engine_actor import engine_actor
    from kev_async.runtime.actors import Mailbox
    from kev_async.runtime.lifecycle import Shutdown

    kafka = kafka_config(kafka_broker, trust=TRUST)
    signer = Signer.from_config(TRUST)
    await create_topics(kafka, {kafka.control_topic: 1})
    path = write_random_adapter(tmp_path / ADAPTER, tiny_model, rank=4, seed=0)
    await produce_records(kafka.bootstrap_servers, kafka.control_topic, [
        control_record(ControlEvent(action="load_adapter", name=ADAPTER, path=ADAPTER), signer,  # under the root
                       kafka.control_topic),
        control_record(ControlEvent(action="update_defaults", defaults={"temperature": 0.3}), signer,
                       kafka.control_topic),
    ])
    questions, answers = Mailbox("q", 8), Mailbox("a", 8)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(partial(engine_actor, questions.receive, answers.send,
                                   engine_factory=lambda: Engine(tiny_model, engine_options())))
            for _ in range(2):  # the control actor's first run, then its restart after a crash
                async with anyio.create_task_group() as control:
                    await control.start(partial(control_actor, audit=None), kafka, questions, Shutdown(10.0),
                                        AdaptersConfig(root=str(tmp_path)))
                    control.cancel_scope.cancel()
            questions.send.close()

    applied = [(e["action"], e["version"]) for e in named(logs, "control.applied")]
    assert applied == [("load_adapter", 1), ("update_defaults", 2)] * 2  # the same outcome both times
    assert len(named(logs, "lora.loaded")) == 1  # loaded once, not again as version 2
    assert len(named(logs, "engine_actor.command_replayed")) == 2


# -- cancels are history after CANCEL_MAX_AGE_S: ignored by readers, tombstoned by the audit -------------

ELEVEN_MINUTES_MS = 11 * 60 * 1000


async def produce_stamped(bootstrap: str, topic: str, records, stamps) -> list[int]:
    """Send (key, value, headers) records with the given timestamps (ms; None = now); their offsets."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=False)
    await producer.start()
    try:
        sent = [await producer.send_and_wait(topic, value, key=key, headers=headers, timestamp_ms=stamp)
                for (key, value, headers), stamp in zip(records, stamps)]
    finally:
        await producer.stop()
    return [meta.offset for meta in sent]


def cancel(topic: str, question_id: str, signer=None):
    from consumers import control_record

    return control_record(ControlEvent(action="cancel", question_id=question_id), signer or Signer.from_config(TRUST),
                          topic)


@pytest.mark.kafka
async def test_a_reader_sends_no_old_cancel_on_as_live_and_skips_tombstones(kafka_broker, logs):
    """The review's case: catch-up timed out (here at once), so the topic's history is read as live."""
    import time

    from consumers import create_topics, run_control_reader

    kafka = kafka_config(kafka_broker, trust=TRUST)
    ctl = kafka.control_topic
    await create_topics(kafka, {kafka.control_topic: 1})
    old = int(time.time() * 1000) - ELEVEN_MINUTES_MS
    await produce_stamped(kafka.bootstrap_servers, kafka.control_topic,
                          [cancel(ctl, "q-old-1"), cancel(ctl, "q-old-2"), (b"cancel:q-gone", None, []),
                           cancel(ctl, "q-new")],
                          [old, old, None, None])
    send, receive = anyio.create_memory_object_stream[ControlEvent](16)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg, receive:
            assert await tg.start(partial(run_control_reader, catch_up_timeout=0.0), kafka, send) == 0
            assert await receive.receive() == ControlEvent(action="cancel", question_id="q-new")
            await produce_stamped(kafka.bootstrap_servers, kafka.control_topic,  # a live one, sent late
                                  [cancel(ctl, "q-late"), cancel(ctl, "q-live")], [old, None])
            assert await receive.receive() == ControlEvent(action="cancel", question_id="q-live")
            tg.cancel_scope.cancel()
    assert named(logs, "control.skipped") == []  # a tombstone is no bad command


async def _committed(bootstrap: str, group: str, topic: str) -> int | None:
    from kafka_fixtures import committed

    return (await committed(bootstrap, group, topic, 1))[0]


@pytest.mark.kafka
async def test_the_audit_tombstones_old_cancels_only_and_holds_its_commit_at_a_young_one(kafka_broker, logs):
    import time

    from kafka_fixtures import FAST_GROUP, read_topic

    from consumers import create_topics, run_control_audit
    from consumers.control.audit import audit_group

    kafka = kafka_config(kafka_broker, trust=TRUST)
    ctl = kafka.control_topic
    await create_topics(kafka, {kafka.control_topic: 1, kafka.dlq_topic: 1})
    old = int(time.time() * 1000) - ELEVEN_MINUTES_MS
    unsigned = (b"defaults:temperature", b'{"action":"update_defaults","defaults":{"temperature":2.0}}', [])
    offsets = await produce_stamped(kafka.bootstrap_servers, kafka.control_topic,
                                    [cancel(ctl, "q-old"), cancel(ctl, "q-young"), unsigned, cancel(ctl, "q-older")],
                                    [old, None, None, old - 1000])
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(partial(run_control_audit, consumer_options=FAST_GROUP), kafka)
            records = await read_topic(kafka.bootstrap_servers, kafka.control_topic, 6, linger=1.0)
            # Not past q-young: it is not tombstoned yet, so whoever audits next must read it again.
            group = audit_group(kafka)

            async def up_to_the_young_cancel() -> bool:
                return await _committed(kafka.bootstrap_servers, group, kafka.control_topic) == offsets[1]

            await eventually(up_to_the_young_cancel, timeout=20, every=0.2)
            dead = await read_topic(kafka.bootstrap_servers, kafka.dlq_topic, 1, linger=0.5)
            tg.cancel_scope.cancel()

    tombstones = [r.key for r in records[4:] if r.value is None]
    assert sorted(tombstones) == [b"cancel:q-old", b"cancel:q-older"]  # not q-young: workers may still need it
    assert len(records) == 6
    assert [dict(r.headers)["dlq.reason"] for r in dead] == [b"unsigned"]  # and no dead letter for a tombstone


@pytest.mark.kafka
async def test_a_young_cancel_is_tombstoned_once_it_is_old_enough(kafka_broker):
    from kafka_fixtures import FAST_GROUP, read_topic

    from consumers import create_topics, run_control_audit

    kafka = kafka_config(kafka_broker, trust=TRUST)
    ctl = kafka.control_topic
    await create_topics(kafka, {kafka.control_topic: 1, kafka.dlq_topic: 1})
    await produce_stamped(kafka.bootstrap_servers, kafka.control_topic, [cancel(ctl, "q-1")], [None])
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(partial(run_control_audit, consumer_options=FAST_GROUP, cancel_max_age_s=1.0), kafka)
            records = await read_topic(kafka.bootstrap_servers, kafka.control_topic, 2, linger=0.5)
            tg.cancel_scope.cancel()
    assert [(r.key, r.value is None) for r in records] == [(b"cancel:q-1", False), (b"cancel:q-1", True)]
    assert records[1].timestamp - records[0].timestamp >= 1000


@pytest.mark.kafka
async def test_the_audit_outlives_a_broker_that_is_away_and_then_does_its_work(logs):
    """A failing audit retries on its own; it never raises into the control actor."""
    import socket

    from kafka_fixtures import FAST_GROUP, read_topic

    from consumers import EmbeddedBroker, create_topics, run_control_audit
    from schemas import KafkaConfig

    with socket.socket() as probe:  # a port nobody listens on, until the broker is started there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    kafka = KafkaConfig(bootstrap_servers=f"127.0.0.1:{port}", group_id="away", control_topic="ctl-away",
                        dlq_topic="dlq-away", trust=TRUST)
    unsigned = (b"adapter:x", b'{"action":"load_adapter","name":"x","path":"x"}', [])
    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            await tg.start(partial(run_control_audit, consumer_options=FAST_GROUP, backoff_s=(0.2, 1.0)), kafka)
            await eventually(lambda: len(named(logs, "control.audit_failed")) >= 2, timeout=60, every=0.1)
            async with EmbeddedBroker(port=port) as broker:
                await create_topics(msgspec.structs.replace(kafka, bootstrap_servers=broker.bootstrap_servers),
                                    {kafka.control_topic: 1, kafka.dlq_topic: 1})
                await produce_records(broker.bootstrap_servers, kafka.control_topic, [unsigned])
                dead = await read_topic(broker.bootstrap_servers, kafka.dlq_topic, 1, timeout=40)
                tg.cancel_scope.cancel()
    assert [(r.value, dict(r.headers)["dlq.reason"]) for r in dead] == [(unsigned[1], b"unsigned")]
    failures = named(logs, "control.audit_failed")
    assert failures[0]["retry_in_s"] == 0.2 and failures[1]["retry_in_s"] == 0.4  # backing off


# -- a signed command published again later is refused, live and at every replay ---------------------------

async def wait_logged(logs, event: str, timeout: float = 20.0, **fields) -> dict:
    """The first captured `event` log entry with `fields`, once there is one."""
    def matching() -> list[dict]:
        return [e for e in named(logs, event) if all(e.get(k) == v for k, v in fields.items())]

    found = await eventually(matching, timeout=timeout, what=f"{event} {fields}")
    return found[0]


@pytest.mark.kafka
async def test_an_old_command_published_again_is_refused_live_and_at_a_restart(kafka_broker, logs):
    """The rollback of the finding: defaults set to 0.3, then 0.9, then the first record published again byte for
    byte. No reader applies it, neither live nor replaying at a restart; the audit dead-letters it once and
    publishes the command in force again, so the record the compacted topic keeps under the key is 0.9's."""
    from kafka_fixtures import FAST_GROUP, read_topic

    from consumers import control_record, create_topics, run_control_audit, run_control_reader

    kafka = kafka_config(kafka_broker, trust=TRUST)
    ctl, signer = kafka.control_topic, Signer.from_config(TRUST)
    await create_topics(kafka, {ctl: 1, kafka.dlq_topic: 1})
    first = control_record(ControlEvent(action="update_defaults", defaults={"temperature": 0.3}), signer, ctl)
    second = control_record(ControlEvent(action="update_defaults", defaults={"temperature": 0.9}), signer, ctl)
    await produce_records(kafka.bootstrap_servers, ctl, [first, second])
    send, receive = anyio.create_memory_object_stream[ControlEvent](16)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg, receive:
            assert await tg.start(run_control_reader, kafka, send) == 2
            live = [receive.receive_nowait().defaults for _ in range(2)]
            await produce_records(kafka.bootstrap_servers, ctl, [first])  # the replay, while serving
            await wait_logged(logs, "control.skipped", offset=2)
            with pytest.raises(anyio.WouldBlock):
                receive.receive_nowait()  # not sent on
            await tg.start(partial(run_control_audit, consumer_options=FAST_GROUP), kafka)
            dead = await read_topic(kafka.bootstrap_servers, kafka.dlq_topic, 1, linger=0.5)
            records = await read_topic(kafka.bootstrap_servers, ctl, 4, linger=0.5)  # the audit's restore: 4th
            restarted, restarted_receive = anyio.create_memory_object_stream[ControlEvent](16)
            async with restarted_receive:  # a worker's restart: the whole topic replayed, in order
                assert await tg.start(run_control_reader, kafka, restarted) == 2
                replayed = [restarted_receive.receive_nowait().defaults for _ in range(2)]
            tg.cancel_scope.cancel()

    assert live == replayed == [{"temperature": 0.3}, {"temperature": 0.9}]  # 0.9 stays in force
    skipped = [e for e in named(logs, "control.skipped") if e["offset"] == 2]
    assert [e["reason"] for e in skipped] == ["stale_sequence"] * 2  # live, then at the restart
    assert "is not above" in skipped[0]["message"]
    assert [(dict(r.headers)["dlq.source.offset"], dict(r.headers)["dlq.reason"]) for r in dead] == [
        (b"2", b"stale_sequence")]
    # The latest record under the key, what compaction keeps and a restart then replays, is 0.9's again.
    assert [r.offset for r in records if r.key == second[0]][-1] == 3
    assert (records[3].key, records[3].value, records[3].headers) == (second[0], second[1], tuple(second[2]))
    assert named(logs, "control.command_restored")[0]["restored_offset"] == 1
