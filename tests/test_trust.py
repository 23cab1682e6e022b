"""The trust boundary on the embedded broker: who may set a question's server-side fields, who may
command the fleet, and what a record over the wire's bounds gets.

Questions go through a real KafkaWorker (intake, trust gate, publisher, DLQ) with a stand-in engine
that records what it was given and echoes; control commands through the real control actor, reader
and audit in front of a real engine actor on the tiny model.
"""

from __future__ import annotations

import time
from functools import partial

import anyio
import msgspec
import pytest

pytest.register_assert_rewrite("kafka_fixtures")
from kafka_fixtures import (  # noqa: E402
    StandInEngine,
    kafka_config,
    produce_records,
    question,
    read_topic,
    running_worker,
)
from polling import eventually  # noqa: E402

from schemas import (  # noqa: E402
    AdaptersConfig,
    ControlEvent,
    LimitsConfig,
    TrustConfig,
    decode_answer,
)
from schemas.kafka_config import TrustKey  # noqa: E402
from schemas.signing import CONTROL, QUESTION, Signer, TrustKeyError  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures"]
pytestmark = [pytest.mark.kafka, pytest.mark.anyio]

TRUST = TrustConfig(keys={"gw": "the-gateway-secret-1"})
SIGNER = Signer.from_config(TRUST)
IMPOSTOR = Signer.hmac("gw", "a-guessed-secret-000")  # the right key id, the wrong secret
SERVER_SIDE = dict(tenant="acme", cache_salt="salt", priority=100, timeout_ms=86_400_000)


@pytest.fixture
def anyio_backend():
    return "asyncio"


def unsigned(value: bytes) -> tuple[bytes, bytes, list]:
    return b"k", value, []


def signed(value: bytes, topic: str, signer: Signer = SIGNER, *, key: bytes = b"k",
           stamp: int | None = None) -> tuple[bytes, bytes, list]:
    """A question record signed for `topic` under `key` (as the gateway signs it), stamped now unless told."""
    return key, value, signer.headers(QUESTION, topic, key, value, stamp=stamp)


def named(logs, event: str) -> list[dict]:
    return [e for e in logs if e.get("event") == event]


def seen(engine: StandInEngine) -> dict:
    return {inbound.question.question_id: inbound.question for inbound in engine.received}


async def answers_on(bootstrap: str, topic: str, count: int) -> dict:
    return {r.key.decode(): decode_answer(r.value) for r in await read_topic(bootstrap, topic, count)}


async def test_only_signed_questions_keep_their_server_side_fields(kafka_broker, logs):
    cfg = kafka_config(kafka_broker, partitions=1, trust=TRUST)
    bootstrap, replies = kafka_broker.bootstrap_servers, f"kev.replies.{cfg.group_id}"
    engine = StandInEngine()
    async with running_worker(cfg, engine):
        await produce_records(bootstrap, cfg.questions_topic, [
            unsigned(question("forger", **SERVER_SIDE, reply_topic=replies)),
            signed(question("trusted", **SERVER_SIDE, reply_topic=replies), cfg.questions_topic),
            signed(question("impostor", **SERVER_SIDE), cfg.questions_topic, IMPOSTOR),
            signed(question("off-pattern", tenant="acme", reply_topic=f"{cfg.answers_topic}-private"),
                   cfg.questions_topic),
            unsigned(question("modest", timeout_ms=1000, priority=0)),
        ])
        private = await answers_on(bootstrap, replies, 1)
        public = await answers_on(bootstrap, cfg.answers_topic, 4)
        await eventually(lambda: len(engine.received) == 4)

    got = seen(engine)
    for qid in ("forger", "impostor"):  # served, as if the fields had not been sent
        q = got[qid]
        assert (q.tenant, q.cache_salt, q.priority, q.reply_topic) == (None, None, 0, None), qid
        assert q.timeout_ms == TRUST.max_unsigned_timeout_ms
    trusted = got["trusted"]
    assert (trusted.tenant, trusted.cache_salt, trusted.priority, trusted.timeout_ms, trusted.reply_topic) == (
        "acme", "salt", 100, 86_400_000, replies)
    assert "off-pattern" not in got  # signed, with a reply topic it may not have: refused, never answered in full
    assert got["modest"].timeout_ms == 1000
    assert set(private) == {"trusted"}
    assert set(public) == {"forger", "impostor", "off-pattern", "modest"}  # nobody's question is lost
    refusal = public["off-pattern"]
    assert (refusal.error.code, refusal.text, refusal.token_ids) == ("reply_topic_refused", "", ())

    untrusted = {e["question_id"]: e for e in named(logs, "question.untrusted")}
    assert untrusted["forger"]["verdict"] == "unsigned" and untrusted["forger"]["log_level"] == "info"
    assert untrusted["forger"]["cleared"] == ["cache_salt", "priority", "reply_topic", "tenant", "timeout_ms"]
    assert untrusted["modest"]["log_level"] == "debug"  # nothing to clear, nothing to shout about
    forged, = named(logs, "question.forged_signature")
    assert (forged["question_id"], forged["key_id"], forged["log_level"]) == ("impostor", "gw", "warning")
    refused, = named(logs, "question.reply_topic_refused")
    assert refused["question_id"] == "off-pattern"


async def test_refuse_mode_answers_unsigned_questions_with_an_error(kafka_broker):
    trust = msgspec.structs.replace(TRUST, unsigned_questions="refuse")
    cfg = kafka_config(kafka_broker, partitions=1, trust=trust)
    bootstrap = kafka_broker.bootstrap_servers
    engine = StandInEngine()
    async with running_worker(cfg, engine):
        await produce_records(bootstrap, cfg.questions_topic, [
            unsigned(question("plain", request_id="r1")),
            signed(question("forged"), cfg.questions_topic, IMPOSTOR),
            signed(question("signed"), cfg.questions_topic),
        ])
        answers = await answers_on(bootstrap, cfg.answers_topic, 3)

    assert [i.question.question_id for i in engine.received] == ["signed"]
    assert answers["signed"].error is None
    for qid, verdict in (("plain", "unsigned"), ("forged", "forged")):
        error = answers[qid].error
        assert answers[qid].finish_reason == "error" and error.code == "unsigned", qid
        assert f"the question was {verdict}" in error.message
    assert answers["plain"].request_id == "r1"


async def test_ids_over_their_bounds_get_error_answers_and_the_worker_serves_on(kafka_broker):
    cfg = kafka_config(kafka_broker, partitions=1, limits=LimitsConfig(max_id_chars=64))
    bootstrap = kafka_broker.bootstrap_servers
    engine = StandInEngine()
    async with running_worker(cfg, engine) as worker:
        await produce_records(bootstrap, cfg.questions_topic, [unsigned(v) for v in (
            question("huge-request-id", request_id="r" * 900_000),  # the worker-stopper
            question("long-tenant", tenant="t" * 100),  # over the configured 64, under the ceiling
            question("long-adapter", adapter="a" * 300),
            question("q" * 300),  # no usable id: nobody to answer
            question("after"),
        )])
        answers = await answers_on(bootstrap, cfg.answers_topic, 4)
        dead = await read_topic(bootstrap, cfg.dlq_topic, 1)
        stats = worker.statistics()

    assert [i.question.question_id for i in engine.received] == ["after"]
    assert answers["after"].error is None
    expected = {"huge-request-id": "request_id: 900000 characters, at most 256 allowed",
                "long-tenant": "tenant: 100 characters, at most 64 allowed",
                "long-adapter": "adapter: 300 characters, at most 256 allowed"}
    for qid, message in expected.items():
        answer = answers[qid]
        assert (answer.error.code, answer.error.message) == ("invalid_field", message)
        assert answer.request_id is None
    assert [dict(r.headers)["dlq.reason"] for r in dead] == [b"unusable_question_id"]
    assert stats.dead_letters == 1 and stats.error_answers == 3


async def test_the_control_topic_is_created_compacted(kafka_broker):
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    from consumers import ensure_topics

    cfg = kafka_config(kafka_broker)
    await ensure_topics(cfg)
    admin = AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers)
    await admin.start()
    try:
        response, = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, cfg.control_topic)])
    finally:
        await admin.close()
    (*_, entries), = response.resources
    assert {entry[0]: entry[1] for entry in entries}["cleanup.policy"] == "compact"


async def test_control_commands_must_be_signed_and_adapters_come_from_the_root(
        kafka_broker, tiny_model, tmp_path, logs, monkeypatch):
    from consumers import control_record, create_topics
    from engine import Engine
    from kev_async.app import control_actor
    from adapter_fixtures import write_random_adapter
    from kev_async.engine_actor import engine_actor
    from kev_async.runtime.actors import Mailbox
    from kev_async.runtime.lifecycle import Shutdown
    from test_control_replay import engine_options

    monkeypatch.setenv("KEV_KAFKA_SESSION_TIMEOUT_MS", "2000")  # the audit group forms in about a second
    cfg = kafka_config(kafka_broker, trust=TRUST)
    root, outside = tmp_path / "root", tmp_path / "outside"
    write_random_adapter(root / "good", tiny_model, rank=4, seed=0)
    write_random_adapter(outside / "evil", tiny_model, rank=4, seed=1)
    (root / "link").symlink_to(outside / "evil")  # inside by name, outside once resolved

    def command(**fields) -> tuple[bytes, bytes, list]:
        return control_record(ControlEvent(**fields), SIGNER, cfg.control_topic)

    unsigned_defaults = command(action="update_defaults", defaults={"temperature": 2.0})[:2] + ([],)
    forged_load = control_record(ControlEvent(action="load_adapter", name="x", path="good"), IMPOSTOR,
                                 cfg.control_topic)
    await create_topics(cfg, {cfg.control_topic: 1, cfg.dlq_topic: 1})
    await produce_records(cfg.bootstrap_servers, cfg.control_topic, [
        unsigned_defaults, forged_load,
        command(action="load_adapter", name="good", path="good"),
        command(action="load_adapter", name="abs", path=str(outside / "evil")),
        command(action="load_adapter", name="dots", path="../outside/evil"),
        command(action="load_adapter", name="link", path="link"),
    ])
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            questions, answers = Mailbox("q", 8), Mailbox("a", 8)
            await tg.start(partial(engine_actor, questions.receive, answers.send,
                                   engine_factory=lambda: Engine(tiny_model, engine_options())))
            for _ in range(2):  # two workers' control actors (one device here): the fleet dead-letters once
                await tg.start(control_actor, cfg, questions, Shutdown(10.0), AdaptersConfig(root=str(root)))
            dead = await read_topic(cfg.bootstrap_servers, cfg.dlq_topic, 2, linger=3.0)
            tg.cancel_scope.cancel()

    assert [(r.value, dict(r.headers)["dlq.reason"]) for r in dead] == [
        (unsigned_defaults[1], b"unsigned"), (forged_load[1], b"forged")]
    assert dict(dead[0].headers)["dlq.source.offset"] == b"0"
    applied = [(e["action"], e["name"]) for e in named(logs, "control.applied")]
    assert applied == [("load_adapter", "good")] * 2
    failed = {e["name"]: e["error"] for e in named(logs, "control.failed")}
    assert set(failed) == {"abs", "dots", "link"}
    assert all("outside adapters.root" in error for error in failed.values())
    assert {e["reason"] for e in named(logs, "control.skipped")} == {"unsigned", "forged"}


def test_no_secret_shows_in_a_signer_or_verifier_repr():
    from schemas.signing import Verifier

    secret = TRUST.keys["gw"]
    shown = f"{SIGNER!r} {SIGNER} {Verifier.from_config(TRUST)!r} {[SIGNER]}"  # as a log line or traceback shows it
    assert secret not in shown
    assert "gw" in shown  # the key id still says which key


# -- scheme v2: what a signature binds, what a key may sign, keys that only verify --------------------------

GATEWAY_SECRET, OPS_SECRET = "the-gateway-secret-1", "the-operators-secret"
SCOPED = TrustConfig(keys={"gw": TrustKey(secret=GATEWAY_SECRET, scopes=("questions", "cancel")),
                           "ops": TrustKey(secret=OPS_SECRET, scopes=("control",))}, unsigned_questions="refuse")


async def test_a_signature_binds_the_record_key_the_topic_and_the_time(kafka_broker, logs):
    """A signed question published again under another record key (so on another partition, past the worker
    that remembers its id) or onto another topic is not trusted; one signed longer ago than max_age_ms, or
    that far ahead of the worker's clock, gets error stale_signature; a key without `questions` vouches for
    nothing."""
    cfg = kafka_config(kafka_broker, partitions=2, trust=SCOPED)
    bootstrap, topic = kafka_broker.bootstrap_servers, cfg.questions_topic
    gateway, ops = Signer.hmac("gw", GATEWAY_SECRET, ("questions",)), Signer.hmac("ops", OPS_SECRET)
    now, max_age = int(time.time() * 1000), SCOPED.max_age_ms
    _, value, headers = signed(question("rekeyed", tenant="acme"), topic, gateway, key=b"rekeyed")
    engine = StandInEngine()
    async with running_worker(cfg, engine):
        await produce_records(bootstrap, topic, [
            (b"another-partition", value, headers),  # byte for byte, under another record key
            signed(question("other-topic", tenant="acme"), "kev.questions.staging", gateway, key=b"other-topic"),
            signed(question("operator", tenant="acme"), topic, ops, key=b"operator"),  # ops: control only
            signed(question("old", tenant="acme"), topic, gateway, key=b"old", stamp=now - max_age - 60_000),
            signed(question("ahead", tenant="acme"), topic, gateway, key=b"ahead", stamp=now + max_age + 60_000),
            signed(question("recent", tenant="acme"), topic, gateway, key=b"recent", stamp=now - 60_000),
        ])
        answers = await answers_on(bootstrap, cfg.answers_topic, 6)

    assert [i.question.question_id for i in engine.received] == ["recent"]
    assert engine.received[0].question.tenant == "acme"
    for qid in ("rekeyed", "other-topic"):
        assert answers[qid].error.code == "unsigned" and "the question was forged" in answers[qid].error.message, qid
    assert "the question was out_of_scope (key 'ops' may not sign questions" in answers["operator"].error.message
    for qid in ("old", "ahead"):
        assert answers[qid].finish_reason == "error" and answers[qid].error.code == "stale_signature", qid
    assert "s ago, beyond kafka.trust.max_age_ms" in answers["old"].error.message
    assert "ahead of this worker's clock" in answers["ahead"].error.message
    assert {e["question_id"] for e in named(logs, "question.forged_signature")} == {"rekeyed", "other-topic"}
    assert {e["question_id"] for e in named(logs, "question.stale_signature")} == {"old", "ahead"}


async def test_the_gateways_key_cannot_command_the_fleet(kafka_broker, logs, monkeypatch):
    """Whoever holds the gateway's secret (scopes questions, cancel) still cannot load an adapter or change the
    defaults; the operator's key (control) cannot cancel. Each is refused by every worker and dead-lettered
    once as out_of_scope; and the gateway's own Signer refuses to sign a command at all."""
    from kafka_fixtures import FAST_GROUP

    from consumers import control_record, create_topics, run_control_audit, run_control_reader

    cfg = kafka_config(kafka_broker, trust=SCOPED)
    topic = cfg.control_topic
    with pytest.raises(TrustKeyError, match="may not sign control"):
        Signer.from_config(msgspec.structs.replace(SCOPED, sign_key="gw")).headers(CONTROL, topic, b"adapter:x", b"{}")
    stolen, ops = Signer.hmac("gw", GATEWAY_SECRET), Signer.hmac("ops", OPS_SECRET)  # signing as if every scope
    gateway = Signer.hmac("gw", GATEWAY_SECRET, ("cancel",))
    await create_topics(cfg, {topic: 1, cfg.dlq_topic: 1})
    await produce_records(cfg.bootstrap_servers, topic, [
        control_record(ControlEvent(action="load_adapter", name="evil", path="evil"), stolen, topic),
        control_record(ControlEvent(action="update_defaults", defaults={"max_new_tokens": 1}), stolen, topic),
        control_record(ControlEvent(action="update_defaults", defaults={"temperature": 0.5}), ops, topic),
    ])
    send, receive = anyio.create_memory_object_stream[ControlEvent](16)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg, receive:
            assert await tg.start(run_control_reader, cfg, send) == 1
            assert receive.receive_nowait().defaults == {"temperature": 0.5}
            await produce_records(cfg.bootstrap_servers, topic, [
                control_record(ControlEvent(action="cancel", question_id="by-ops"), ops, topic),
                control_record(ControlEvent(action="cancel", question_id="by-gateway"), gateway, topic)])
            assert await receive.receive() == ControlEvent(action="cancel", question_id="by-gateway")
            await tg.start(partial(run_control_audit, consumer_options=FAST_GROUP), cfg)
            dead = await read_topic(cfg.bootstrap_servers, cfg.dlq_topic, 3, linger=1.0)
            tg.cancel_scope.cancel()

    assert [(r.key, dict(r.headers)["dlq.reason"]) for r in dead] == [
        (b"adapter:evil", b"out_of_scope"), (b"defaults:max_new_tokens", b"out_of_scope"),
        (b"cancel:by-ops", b"out_of_scope")]
    skipped = [(e["reason"], e["key_id"]) for e in named(logs, "control.skipped")]
    assert skipped == [("out_of_scope", "gw"), ("out_of_scope", "gw"), ("out_of_scope", "ops")]


def test_the_gateway_refuses_to_sign_with_a_key_that_may_command_the_fleet():
    from kev_async.gateway.exposure import GatewayRefused, check_exposure, with_session_trust_key
    from schemas import KafkaConfig, KevConfig

    every_scope = KevConfig(kafka=KafkaConfig(trust=TrustConfig(keys={"gw": "a-secret-of-16-chars"})))
    with pytest.raises(GatewayRefused, match=r"scopes are cancel, control, questions; give it scopes \[questions, "):
        check_exposure(every_scope, keys_configured=True)
    session = check_exposure(with_session_trust_key(KevConfig()), keys_configured=True)  # kev demo --http
    assert session.key.scopes == {"questions", "cancel"}


async def test_a_worker_with_public_keys_only_verifies_and_cannot_sign(kafka_broker):
    """Ed25519: the gateway and the operator hold private keys, the worker only their public keys. It trusts
    what they sign, nothing signed by another private key under their ids, and cannot sign anything itself."""
    from consumers import control_record, create_topics, run_control_reader
    from schemas.signing import new_ed25519_pair

    (gw_private, gw_public), (ops_private, ops_public) = new_ed25519_pair(), new_ed25519_pair()
    impostor_private, _ = new_ed25519_pair()
    worker = TrustConfig(keys={"gw": TrustKey(public_key=gw_public, scopes=("questions", "cancel")),
                               "ops": TrustKey(public_key=ops_public, scopes=("control",))})
    for trust in (worker, msgspec.structs.replace(worker, sign_key="ops")):
        with pytest.raises(TrustKeyError, match="cannot sign"):
            Signer.from_config(trust)

    def signer(key_id: str, private: str, scopes: tuple) -> Signer:
        return Signer.from_config(TrustConfig(keys={key_id: TrustKey(private_key=private, scopes=scopes)}))

    gateway, operator = signer("gw", gw_private, ("questions", "cancel")), signer("ops", ops_private, ("control",))
    impostor = signer("gw", impostor_private, ("questions", "cancel"))
    cfg = kafka_config(kafka_broker, partitions=1, trust=worker)
    bootstrap = kafka_broker.bootstrap_servers
    engine = StandInEngine()
    async with running_worker(cfg, engine):
        await produce_records(bootstrap, cfg.questions_topic, [
            signed(question("by-gateway", tenant="acme"), cfg.questions_topic, gateway),
            signed(question("by-impostor", tenant="acme"), cfg.questions_topic, impostor)])
        await answers_on(bootstrap, cfg.answers_topic, 2)
    assert {qid: q.tenant for qid, q in seen(engine).items()} == {"by-gateway": "acme", "by-impostor": None}

    await create_topics(cfg, {cfg.control_topic: 1})
    fake_ops = signer("ops", impostor_private, ("control",))
    await produce_records(bootstrap, cfg.control_topic, [
        control_record(ControlEvent(action="update_defaults", defaults={"top_k": 5}), fake_ops, cfg.control_topic),
        control_record(ControlEvent(action="update_defaults", defaults={"top_k": 7}), operator, cfg.control_topic)])
    send, receive = anyio.create_memory_object_stream[ControlEvent](16)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg, receive:
            assert await tg.start(run_control_reader, cfg, send) == 1
            assert receive.receive_nowait().defaults == {"top_k": 7}
            tg.cancel_scope.cancel()
