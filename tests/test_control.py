"""Hot control over Kafka: the `kev.control` topic's commands (load / unload an adapter, update the
sampling defaults), applied by a serving worker without a restart.

- decoding: good commands of each action, and bad ones with the reason and message they get;
- the engine actor: LoadAdapter / UnloadAdapter, plainly and with `ask`; a failure never ends it;
- the control reader on the embedded broker: replays the topic from its start, reports how many it
  replayed, skips what is unsigned, forged, wrongly keyed or does not decode, goes on reading;
- `serve` in process: commands already on the topic apply before the first question is taken, and
  commands published while it serves apply too; a garbage record changes nothing.
"""

from __future__ import annotations

from functools import partial

import anyio
import msgspec
import pytest

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures")
from kafka_fixtures import kafka_config, produce, produce_records  # noqa: E402
from polling import eventually  # noqa: E402
from serve_fixtures import AnswerReader  # noqa: E402

from schemas import (  # noqa: E402
    AdaptersConfig,
    ControlEvent,
    InvalidControl,
    KevConfig,
    Params,
    QuestionEvent,
    TrustConfig,
    decode_control,
    encode,
)
from schemas.signing import CONTROL, Signer  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures"]

ADAPTER = "style"


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiokafka is asyncio-only


TRUST = TrustConfig(keys={"ops": "a-secret-for-the-tests"})
SIGNER = Signer.from_config(TRUST)


def control(**fields) -> bytes:
    return msgspec.json.encode(fields)


def signed(topic: str, **fields) -> tuple[bytes, bytes, list]:
    """A signed, keyed command record (key, value, headers) for `topic`, as an operator's tool publishes it."""
    from consumers import control_record

    return control_record(ControlEvent(**fields), SIGNER, topic)


def signed_raw(topic: str, value: bytes, key: bytes | None = None,
               signer: Signer = SIGNER) -> tuple[bytes | None, bytes, list]:
    """Any bytes, signed for `topic`: what a trusted producer with a bug could send."""
    return key, value, signer.headers(CONTROL, topic, key, value)


def events(logs, event: str, **fields) -> list[dict]:
    return [e for e in logs if e["event"] == event and all(e.get(k) == v for k, v in fields.items())]


async def wait_event(logs, event: str, timeout: float = 20.0, **fields) -> dict:
    """The first captured `event` log entry with `fields`, once there is one."""
    found = await eventually(lambda: events(logs, event, **fields), timeout=timeout, what=f"{event} {fields}")
    return found[0]


# -- decoding -----------------------------------------------------------------------------------------

GOOD = [
    (control(action="load_adapter", name="a", path="/adapters/a"),
     ControlEvent(action="load_adapter", name="a", path="/adapters/a")),
    (control(action="unload_adapter", name="a"), ControlEvent(action="unload_adapter", name="a")),
    (control(action="update_defaults", defaults={"temperature": 0.7, "max_new_tokens": 64}),
     ControlEvent(action="update_defaults", defaults={"temperature": 0.7, "max_new_tokens": 64})),
    (control(action="update_defaults", defaults={"temperature": 1}),  # normalised to a float
     ControlEvent(action="update_defaults", defaults={"temperature": 1.0})),
    (control(action="unload_adapter", name="a", schema=1), ControlEvent(action="unload_adapter", name="a")),
]


@pytest.mark.parametrize(("raw", "expected"), GOOD)
def test_decode_control_accepts_each_action(raw, expected):
    event = decode_control(raw)
    assert event == expected
    assert decode_control(raw.decode()) == expected  # str as well as bytes
    assert decode_control(encode(event)) == event  # what a producer encodes, a worker decodes
    if event.defaults:
        assert type(event.defaults["temperature"]) is float


BAD = [
    (control(action="reload", name="a"), "invalid_field",
     "action: 'reload' is not one of: cancel, load_adapter, unload_adapter, update_defaults"),
    (control(name="a"), "invalid_field", "action: missing required field"),
    (control(action="load_adapter", path="/adapters/a"), "invalid_field",
     "name: missing; load_adapter needs name and path"),
    (control(action="load_adapter", name="a"), "invalid_field", "path: missing; load_adapter needs name and path"),
    (control(action="unload_adapter"), "invalid_field", "name: missing; unload_adapter needs name"),
    (control(action="unload_adapter", name="a", path="/x"), "invalid_field",
     "path: not used by unload_adapter (it takes name)"),
    (control(action="load_adapter", name="", path="/x"), "invalid_field", "name: empty"),
    (control(action="update_defaults"), "invalid_field", "defaults: missing; update_defaults needs defaults"),
    (control(action="update_defaults", defaults={}), "invalid_field",
     "defaults: empty; give at least one of max_new_tokens, temperature, top_p, top_k, repetition_penalty, seed"),
    (control(action="update_defaults", defaults={"temprature": 0.5}), "invalid_field",
     "defaults.temprature: unknown key (did you mean 'temperature'? allowed: max_new_tokens, repetition_penalty, "
     "seed, temperature, top_k, top_p)"),
    (control(action="update_defaults", defaults={"temperature": 11}), "invalid_field",
     "defaults.temperature: 11 is above 10 (allowed: 0 to 10)"),
    (control(action="update_defaults", defaults={"max_new_tokens": 1.5}), "invalid_field",
     "defaults.max_new_tokens: expected int, got float 1.5"),
    (control(action="update_defaults", defaults={"temperature": "hot"}), "invalid_field",
     "defaults.temperature: expected float, got str 'hot'"),
    (control(action="update_defaults", defaults={"top_k": True}), "invalid_field",
     "defaults.top_k: expected int, got bool true"),
    (control(action="unload_adapter", name="a", schema=2), "unsupported_schema",
     "schema: version 2 is not supported (supported: 1)"),
    (b"{not json", "not_json", "not valid JSON"),
    (b"", "not_json", "not valid JSON"),
    (b"\xff\xfe", "not_utf8", "not valid UTF-8"),
    (b"[1, 2]", "not_object", "expected a JSON object, got an array"),
    (control(action="load_adapter", name="a", path="/" + "x" * 70_000), "too_large", "event is 70"),
]


@pytest.mark.parametrize(("raw", "reason", "message"), BAD)
def test_decode_control_says_what_is_wrong(raw, reason, message):
    with pytest.raises(InvalidControl) as raised:
        decode_control(raw)
    assert raised.value.reason == reason
    assert raised.value.message.startswith(message), raised.value.message
    assert str(raised.value) == f"{reason}: {raised.value.message}"


# -- the engine actor -----------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_engine_actor_loads_and_unloads_adapters_and_survives_bad_ones(tiny_model, tmp_path, logs):
    from engine import Engine, EngineOptions
    from engine.sampling_defaults import Defaults
    from engine.adapters.files import AdapterError
    from adapter_fixtures import write_random_adapter
    from kev_async.engine_actor import EngineClient, LoadAdapter, UnloadAdapter, engine_actor
    from kev_async.runtime.actors import Mailbox, ask

    path = write_random_adapter(tmp_path / ADAPTER, tiny_model, rank=4, seed=0)
    options = EngineOptions(max_parallel_queries=4, num_blocks=64, max_context=128, batch_window_ms=0,
                            defaults=Defaults())
    questions, answers = Mailbox("q", 8), Mailbox("a", 8)

    def question(qid: str, adapter: str | None = None) -> QuestionEvent:
        return QuestionEvent(question_id=qid, prompt="Hello there", adapter=adapter,
                             params=Params(max_new_tokens=3))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(partial(engine_actor, questions.receive, answers.send,
                                   engine_factory=lambda: Engine(tiny_model, options)))
            client = EngineClient(questions.send, answers.receive)
            await tg.start(client.run)

            adapter = await ask(questions.send, LoadAdapter(ADAPTER, path))
            assert (adapter.name, adapter.version) == (ADAPTER, 1)
            with pytest.raises(AdapterError):
                await ask(questions.send, LoadAdapter("broken", tmp_path / "missing"))
            await questions.send.send(LoadAdapter("broken", tmp_path / "missing"))  # plain: logged only
            answer = await client.ask(question("with", ADAPTER))
            assert answer.error is None and answer.audit.adapter == ADAPTER

            assert await ask(questions.send, UnloadAdapter(ADAPTER)) is None
            with pytest.raises(KeyError):
                await ask(questions.send, UnloadAdapter(ADAPTER))
            await questions.send.send(UnloadAdapter("never-loaded"))  # plain: logged only
            refused = await client.ask(question("after", ADAPTER))
            assert refused.error is not None and refused.error.code == "unknown_adapter"
            assert (await client.ask(question("plain"))).error is None  # the actor is still serving
            await client.aclose()

    failed = events(logs, "engine_actor.adapter_failed")
    assert [(e["command"], e["adapter"]) for e in failed] == [
        ("LoadAdapter", "broken"), ("LoadAdapter", "broken"),
        ("UnloadAdapter", ADAPTER), ("UnloadAdapter", "never-loaded")]
    assert failed[-1]["error"] == "adapter 'never-loaded' is not loaded"


# -- the control reader on the embedded broker ---------------------------------------------------------

@pytest.mark.kafka
@pytest.mark.anyio
async def test_control_reader_replays_from_the_start_and_skips_garbage(kafka_broker, logs):
    from consumers import create_topics, run_control_reader

    kafka = kafka_config(kafka_broker, trust=TRUST)
    ctl = kafka.control_topic
    other_key = Signer.hmac("ops", "not-the-configured-secret")
    await create_topics(kafka, {kafka.control_topic: 1})
    await produce_records(kafka.bootstrap_servers, kafka.control_topic, [
        signed(ctl, action="load_adapter", name="a", path="/adapters/a"),
        signed_raw(ctl, b"{garbage"),
        signed_raw(ctl, b""),  # an empty value
        signed_raw(ctl, control(action="reload")),
        signed(ctl, action="update_defaults", defaults={"temperature": 0.5}),
        (b"adapter:b", control(action="load_adapter", name="b", path="/adapters/b"), []),  # unsigned
        signed_raw(ctl, control(action="unload_adapter", name="a"), b"adapter:a", signer=other_key),
        signed_raw(ctl, control(action="unload_adapter", name="a"), b"defaults"),  # keyed as something else
    ])
    send, receive = anyio.create_memory_object_stream[ControlEvent](16)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg, receive:
            replayed = await tg.start(run_control_reader, kafka, send)
            assert replayed == 2  # only the signed, well-keyed commands
            got = [receive.receive_nowait(), receive.receive_nowait()]  # already in the stream when ready
            assert [e.action for e in got] == ["load_adapter", "update_defaults"]
            assert got[1].defaults == {"temperature": 0.5}

            # Read on while serving; a second reader (another worker) sees every command too.
            await produce_records(kafka.bootstrap_servers, kafka.control_topic,
                                  [signed(ctl, action="unload_adapter", name="a")])
            assert await receive.receive() == ControlEvent(action="unload_adapter", name="a")
            other, other_receive = anyio.create_memory_object_stream[ControlEvent](16)
            async with other_receive:
                assert await tg.start(run_control_reader, kafka, other) == 3
            tg.cancel_scope.cancel()

    skipped = events(logs, "control.skipped", topic=kafka.control_topic)
    assert [(e["offset"], e["reason"]) for e in skipped[:6]] == [
        (1, "not_json"), (2, "not_json"), (3, "invalid_field"), (5, "unsigned"), (6, "forged"), (7, "wrong_key")]
    assert skipped[4]["key_id"] == "ops"
    # An unsigned command (as written before commands had to be signed) says what to do about it.
    assert (skipped[3]["action"], skipped[3]["name"], skipped[3]["path"]) == ("load_adapter", "b", "/adapters/b")
    assert "publish this command again, signed" in skipped[3]["hint"] and "adapters.root" in skipped[3]["hint"]
    assert all("hint" not in e for e in skipped[:3] + skipped[4:6])


@pytest.mark.kafka
@pytest.mark.anyio
async def test_control_reader_on_an_empty_topic_is_ready_at_once(kafka_broker):
    from consumers import run_control_reader

    kafka = kafka_config(kafka_broker)  # the reader creates its topic
    send, receive = anyio.create_memory_object_stream[ControlEvent](16)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, receive:
            assert await tg.start(run_control_reader, kafka, send) == 0
            tg.cancel_scope.cancel()


# -- serve, end to end ------------------------------------------------------------------------------------

def ask_bytes(question_id: str, adapter: str | None = None) -> bytes:
    fields = {"question_id": question_id, "prompt": "Tell me about the sea.", "params": {"max_new_tokens": 4}}
    return msgspec.json.encode(fields | ({"adapter": adapter} if adapter else {}))


@pytest.mark.kafka
@pytest.mark.anyio
async def test_serve_applies_control_commands_without_a_restart(kafka_broker, tiny_model, tmp_path, monkeypatch,
                                                                 logs):
    from consumers import create_topics, topic_plan
    from kev_async.app import serve
    from adapter_fixtures import write_random_adapter
    from kev_async.runtime.lifecycle import Shutdown

    monkeypatch.setenv("KEV_KAFKA_SESSION_TIMEOUT_MS", "3000")
    kafka = kafka_config(kafka_broker, partitions=1, trust=TRUST)
    ctl = kafka.control_topic
    cfg = KevConfig(kafka=kafka, adapters=AdaptersConfig(root=str(tmp_path)))
    cfg = msgspec.structs.replace(
        cfg, core=msgspec.structs.replace(cfg.core, max_context=64, device="cpu"),
        router=msgspec.structs.replace(cfg.router, max_parallel_queries=4),
        kv_cache=msgspec.structs.replace(cfg.kv_cache, num_blocks=64),
        metrics=msgspec.structs.replace(cfg.metrics, port=0))
    path = write_random_adapter(tmp_path / ADAPTER, tiny_model, rank=4, seed=0)
    bootstrap = kafka.bootstrap_servers
    await create_topics(kafka, topic_plan(kafka))

    # On the topics before the worker starts: it applies the commands before it takes the question.
    await produce_records(bootstrap, kafka.control_topic,
                          [signed_raw(ctl, b"not a command"),
                           signed(ctl, action="load_adapter", name=ADAPTER, path=str(path))])
    await produce(bootstrap, kafka.questions_topic, [ask_bytes("with-adapter", ADAPTER)])
    reader = AnswerReader(bootstrap, kafka.answers_topic)
    shutdown = Shutdown(drain_deadline=20.0)
    with anyio.fail_after(50):
        async with anyio.create_task_group() as tg:
            await tg.start(reader.run)
            async with anyio.create_task_group() as serving:
                await serving.start(partial(serve, cfg, shutdown, model=tiny_model))
                await reader.wait_for({"with-adapter"}, 20)

                # While it serves: unload, garbage, new defaults.
                await produce_records(bootstrap, kafka.control_topic, [
                    signed(ctl, action="unload_adapter", name=ADAPTER), signed_raw(ctl, b"\xff"),
                    signed(ctl, action="update_defaults", defaults={"temperature": 0.7})])
                await wait_event(logs, "control.applied", action="update_defaults")
                await produce(bootstrap, kafka.questions_topic,
                              [ask_bytes("after-unload", ADAPTER), ask_bytes("after-defaults")])
                await reader.wait_for({"after-unload", "after-defaults"}, 20)
                shutdown.request("test over")  # serve returns once drained and committed
            tg.cancel_scope.cancel()  # the answers reader

    answers = {answer.question_id: answer for answer in reader.answers}
    first = answers["with-adapter"]
    assert first.error is None, first.error
    assert first.audit.adapter == ADAPTER
    unloaded = answers["after-unload"]
    assert unloaded.finish_reason == "error" and unloaded.error.code == "unknown_adapter"
    later = answers["after-defaults"]
    assert later.error is None and later.audit.adapter is None
    assert later.audit.defaults_version > first.audit.defaults_version

    applied = [(e["action"], e["name"], e["version"]) for e in events(logs, "control.applied")]
    assert applied == [("load_adapter", ADAPTER, 1), ("unload_adapter", ADAPTER, None),
                       ("update_defaults", None, first.audit.defaults_version + 1)]
    assert [e["reason"] for e in events(logs, "control.skipped")] == ["not_json", "not_utf8"]
    assert events(logs, "control.ready", replayed=1)
    assert not events(logs, "actor.crashed")


def test_cancel_names_its_question_and_only_that():
    assert decode_control(b'{"action": "cancel", "question_id": "q1"}') == ControlEvent(action="cancel", question_id="q1")
    with pytest.raises(InvalidControl, match="question_id: missing; cancel needs question_id"):
        decode_control(b'{"action": "cancel"}')
    with pytest.raises(InvalidControl, match="name: not used by cancel"):
        decode_control(b'{"action": "cancel", "question_id": "q1", "name": "a"}')
