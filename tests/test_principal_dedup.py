"""Deduplication by who asked (issue 39, finding 2), on the embedded broker with a stand-in engine.

A question is the same question only when the same principal (the verified signing key and the tenant,
schemas/principal.py) sends the same question_id with the same bytes: then it is answered once. The same
id from another principal is another question; the same id and principal with other bytes is a conflict,
told to that principal with a `duplicate_question_id` error answer, the first question untouched. Every
answer says whose it is (the `principal` header and audit.principal).
"""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite("kafka_fixtures")
from kafka_fixtures import (  # noqa: E402
    HoldingEngine,
    StandInEngine,
    kafka_config,
    produce_records,
    question,
    read_topic,
    running_worker,
    wait_committed,
)
from polling import eventually  # noqa: E402

from schemas import TrustConfig, decode_answer  # noqa: E402
from schemas.signing import QUESTION, Signer  # noqa: E402

pytest_plugins = ["kafka_fixtures"]
pytestmark = [pytest.mark.kafka, pytest.mark.anyio]

TRUST = TrustConfig(keys={"gw": "the-gateway-secret-1"})
SIGNER = Signer.from_config(TRUST)


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiokafka is asyncio-only


def unsigned(value: bytes) -> tuple[None, bytes, list]:
    return None, value, []


def signer_for(topic: str):
    """Records for `topic`, signed by the gateway's key (a signature binds the topic and the record key)."""
    def signed(value: bytes) -> tuple[None, bytes, list]:
        return None, value, SIGNER.headers(QUESTION, topic, None, value)
    return signed


def principal_header(record) -> bytes | None:
    return dict(record.headers).get("principal")


async def test_an_unsigned_question_cannot_take_a_tenants_question_id(kafka_broker):
    # The attacker writes "order-42" first, unsigned; the tenant's signed "order-42" comes after. Each is
    # answered, each where its asker reads, each saying whose it is.
    cfg = kafka_config(kafka_broker, partitions=1, trust=TRUST)
    bootstrap, replies = kafka_broker.bootstrap_servers, f"kev.replies.{cfg.group_id}"
    engine, signed = StandInEngine(), signer_for(cfg.questions_topic)
    async with running_worker(cfg, engine):
        await produce_records(bootstrap, cfg.questions_topic, [
            unsigned(question("order-42", "the attacker's", tenant="acme", reply_topic=replies)),
            signed(question("order-42", "the tenant's", tenant="acme", reply_topic=replies)),
        ])
        private = await read_topic(bootstrap, replies, 1)
        public = await read_topic(bootstrap, cfg.answers_topic, 1)
        await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, {0: 2})

    assert [decode_answer(r.value).text for r in private] == ["echo: the tenant's"]
    assert [decode_answer(r.value).text for r in public] == ["echo: the attacker's"]
    assert [principal_header(r) for r in private] == [b"gw/acme"]
    assert [principal_header(r) for r in public] == [b"unsigned/-"]
    assert decode_answer(private[0].value).audit.principal == "gw/acme"
    assert decode_answer(public[0].value).audit.principal == "unsigned/-"
    assert len(engine.received) == 2


async def test_the_same_id_with_other_bytes_is_a_conflict_and_a_redelivery_is_answered_once(kafka_broker):
    # The first "order-7" is held in the engine while its redelivery (same bytes) and a changed question
    # under the same id (same principal) arrive: the redelivery waits for the first answer, the changed
    # one is told at once; after the answer, both come again and end the same way.
    cfg = kafka_config(kafka_broker, partitions=1, trust=TRUST)
    bootstrap, replies = kafka_broker.bootstrap_servers, f"kev.replies.{cfg.group_id}"
    first = question("order-7", "the first", tenant="acme", reply_topic=replies)
    changed = question("order-7", "changed", tenant="acme", reply_topic=replies)
    engine, signed = HoldingEngine(), signer_for(cfg.questions_topic)
    async with running_worker(cfg, engine) as worker:
        await produce_records(bootstrap, cfg.questions_topic, [signed(first), signed(first), signed(changed)])
        told = await read_topic(bootstrap, replies, 1, linger=0)  # while the first is still being answered
        assert worker.statistics().answers == 0
        engine.release.set()
        await read_topic(bootstrap, replies, 2, linger=0)
        await produce_records(bootstrap, cfg.questions_topic, [signed(first), signed(changed)])
        await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, {0: 5})
        private = await read_topic(bootstrap, replies, 3)
        public = await read_topic(bootstrap, cfg.answers_topic, 0, linger=0.3)

    assert [i.question.prompt for i in engine.received] == ["the first"]  # computed once
    assert [decode_answer(r.value).error.code for r in told] == ["duplicate_question_id"]
    answers = [decode_answer(r.value) for r in private]
    assert [a.text for a in answers if a.error is None] == ["echo: the first"]  # untouched, answered once
    conflicts = [a for a in answers if a.error is not None]
    assert [a.error.code for a in conflicts] == ["duplicate_question_id"] * 2
    assert all("order-7" in a.error.message for a in conflicts)
    assert {principal_header(r) for r in private} == {b"gw/acme"}
    assert public == []  # nothing for this tenant on the shared topic


async def test_the_same_id_from_another_tenant_of_the_same_key_is_another_question(kafka_broker):
    cfg = kafka_config(kafka_broker, partitions=1, trust=TRUST)
    bootstrap = kafka_broker.bootstrap_servers
    engine, signed = StandInEngine(), signer_for(cfg.questions_topic)
    async with running_worker(cfg, engine):
        await produce_records(bootstrap, cfg.questions_topic, [
            signed(question("q-1", "for acme", tenant="acme")), signed(question("q-1", "for umbrella",
                                                                                tenant="umbrella"))])
        public = await read_topic(bootstrap, cfg.answers_topic, 2)
        await eventually(lambda: len(engine.received) == 2)

    assert sorted((principal_header(r), decode_answer(r.value).text) for r in public) == [
        (b"gw/acme", "echo: for acme"), (b"gw/umbrella", "echo: for umbrella")]
