"""Replaying kev.control is idempotent (review finding): a command carries its record offset as its id,
and an engine that applied an id already answers as the first time instead of loading a new version."""

from __future__ import annotations

from functools import partial

import anyio
import pytest

pytest.register_assert_rewrite("kafka_fixtures")
from kafka_fixtures import kafka_config, produce_records  # noqa: E402

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
    from engine.defaults import Defaults

    return EngineOptions(max_batch_size=4, num_blocks=64, max_context=128, batch_window_ms=0, defaults=Defaults())


async def test_engine_actor_applies_each_command_id_once(tiny_model, tmp_path, logs):
    from engine import Engine
    from engine.adapters import AdapterError
    from kev_async.bench.lora import write_random_adapter
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
    from kev_async.bench.lora import write_random_adapter
    from kev_async.engine_actor import engine_actor
    from kev_async.runtime.actors import Mailbox
    from kev_async.runtime.lifecycle import Shutdown

    kafka = kafka_config(kafka_broker, trust=TRUST)
    signer = Signer.from_config(TRUST)
    await create_topics(kafka.bootstrap_servers, {kafka.control_topic: 1})
    path = write_random_adapter(tmp_path / ADAPTER, tiny_model, rank=4, seed=0)
    await produce_records(kafka.bootstrap_servers, kafka.control_topic, [
        control_record(ControlEvent(action="load_adapter", name=ADAPTER, path=ADAPTER), signer),  # under the root
        control_record(ControlEvent(action="update_defaults", defaults={"temperature": 0.3}), signer),
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
