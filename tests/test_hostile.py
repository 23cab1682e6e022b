"""Hostile input against two `kev serve` workers on the embedded broker: nothing stops the fleet.

The records of issue 26, interleaved with good questions on both partitions: an id of 900,000
characters, a new reply topic, a 300,000-character prompt, unsigned and forged control commands,
forged tenant and priority, duplicate ids, a fresh question stamped two minutes in the past (a producer
whose clock runs behind: served, timed from its arrival), a signed question with a reply topic off the
pattern, bytes that are not JSON. Each good question is answered exactly once, each hostile record ends in its documented
outcome (docs/reliability.md), and both workers are still consuming afterwards.
"""

from __future__ import annotations

import signal
import time
import urllib.request
from collections import Counter

import anyio
import msgspec
import pytest
from aiokafka import AIOKafkaProducer

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures")
from kafka_fixtures import kafka_config, read_topic  # noqa: E402
from serve_fixtures import (  # noqa: E402
    AnswerReader,
    KevProcess,
    free_port,
    kev_processes,
    log_events,
    serve_env,
    wait_assigned,
)

from consumers import create_topics, topic_plan  # noqa: E402
from consumers.control.reader import control_record  # noqa: E402
from consumers.messages import HEADER_DLQ_REASON  # noqa: E402
from schemas import ControlEvent, TrustConfig  # noqa: E402
from schemas.signing import QUESTION, Signer  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures"]
pytestmark = [pytest.mark.anyio, pytest.mark.kafka]

TRUST = TrustConfig(keys={"ops-1": "a-secret-of-at-least-16-chars"})
FORGER = Signer.hmac("ops-1", "not-the-secret-but-long-enough")


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiokafka is asyncio-only


def event(question_id: str, prompt: str = "Tell me about the sea.", max_new_tokens: int = 6, **fields) -> bytes:
    return msgspec.json.encode({"question_id": question_id, "prompt": prompt,
                                "params": {"max_new_tokens": max_new_tokens}, **fields})


def health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


async def send_all(bootstrap: str, topic: str, records: list[dict]) -> None:
    """Each record: value, and optionally key, headers, partition, timestamp_ms; all acked."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", max_request_size=4_000_000)
    await producer.start()
    try:
        futures = [await producer.send(topic, r["value"], key=r.get("key"), headers=r.get("headers", []),
                                       partition=r.get("partition"), timestamp_ms=r.get("timestamp_ms"))
                   for r in records]
        for future in futures:
            await future
    finally:
        await producer.stop()


def hostile_records(topic: str) -> tuple[list[dict], list[str]]:
    """(records to publish, ids of the good questions among them), good and hostile interleaved."""
    good = [f"good-{i}" for i in range(12)]
    bad: list[dict] = [
        {"value": event("huge-request-id", request_id="r" * 900_000)},
        {"value": event("new-reply-topic", reply_topic="someone.elses.topic")},
        {"value": event("signed-bad-reply-topic", reply_topic="not-a-reply-topic")},
        {"value": event("huge-prompt", prompt="x" * 300_000)},
        {"value": event("forged-tenant", tenant="victim", cache_salt="theirs", priority=100)},
        {"value": (value := event("forged-signature", tenant="victim")),
         "headers": FORGER.headers(QUESTION, topic, _qid(value), value)},
        {"value": event("dup-1")},
        {"value": event("dup-1")},
        {"value": event("skewed-clock", timeout_ms=5_000), "timestamp_ms": int(time.time() * 1000) - 120_000},
        {"value": b"\xff\xfe not json at all", "key": b"garbage"},
    ]
    signed = bad[2]
    signed["headers"] = Signer.from_config(TRUST).headers(QUESTION, topic, _qid(signed["value"]), signed["value"])
    records = []
    for i, qid in enumerate(good):
        records.append({"value": event(qid, f"Question {i}: name a colour.")})
        if i < len(bad):
            records.append(bad[i])
    for record in records:
        record.setdefault("key", _qid(record["value"]))
    return records, good


def _qid(value: bytes) -> bytes | None:
    try:
        return msgspec.json.decode(value)["question_id"].encode()
    except (msgspec.DecodeError, KeyError, TypeError):
        return None


async def test_hostile_records_end_in_their_outcome_and_both_workers_keep_consuming(
        kafka_broker, tiny_model_dir, tmp_path):
    kafka = kafka_config(kafka_broker, partitions=2)
    await create_topics(kafka, topic_plan(kafka))
    reader = AnswerReader(kafka.bootstrap_servers, kafka.answers_topic)
    ports = [free_port(), free_port()]
    trust_env = {"KEV_KAFKA__TRUST__KEYS": msgspec.json.encode(TRUST.keys).decode()}
    with kev_processes() as children:
        async with anyio.create_task_group() as tg:
            await tg.start(reader.run)
            for name, port in zip("ab", ports):
                env = serve_env(kafka, KEV_METRICS__PORT=str(port), **trust_env)
                children.append(KevProcess(["serve", "--model", str(tiny_model_dir), "--bootstrap-servers",
                                            kafka.bootstrap_servers], env, tmp_path / f"serve-{name}.log"))
            await wait_assigned(children)

            # Unsigned and forged commands that would cut every answer to one token, and cancel a good one.
            cut = ControlEvent(action="update_defaults", defaults={"max_new_tokens": 1})
            key, value, forged_headers = control_record(cut, FORGER, kafka.control_topic)
            await send_all(kafka.bootstrap_servers, kafka.control_topic, [
                {"key": key, "value": value},
                {"key": key, "value": value, "headers": forged_headers},
                {"key": b"cancel:late-good", "value": msgspec.json.encode(
                    {"action": "cancel", "question_id": "late-good"})},
            ])

            records, good = hostile_records(kafka.questions_topic)
            await send_all(kafka.bootstrap_servers, kafka.questions_topic, records)
            answerable = set(good) | {_qid(r["value"]).decode() for r in records if _qid(r["value"])}
            await reader.wait_for(answerable, 120, "answers")

            # Afterwards both workers still take questions: one more on each partition, no defaults param.
            late = [{"value": msgspec.json.encode({"question_id": f"late-{p}", "prompt": "Say hello."}),
                     "partition": p, "key": f"late-{p}".encode()} for p in range(2)]
            late.append({"value": event("late-good"), "key": b"late-good"})
            await send_all(kafka.bootstrap_servers, kafka.questions_topic, late)
            await reader.wait_for({"late-0", "late-1", "late-good"}, 60, "late answers")
            await anyio.sleep(1.0)  # catch a second answer, if any
            statuses = [await anyio.to_thread.run_sync(health, port) for port in ports]
            tg.cancel_scope.cancel()

        for child in children:
            assert child.running(), child.describe()
            child.signal(signal.SIGTERM)
        for child in children:
            assert await anyio.to_thread.run_sync(child.wait, 30) == 0, child.describe()

    assert statuses == [200, 200]
    counts = Counter(answer.question_id for answer in reader.answers)
    assert all(n == 1 for n in counts.values()), {q: n for q, n in counts.items() if n > 1}
    answers = {answer.question_id: answer for answer in reader.answers}
    for qid in [*good, "new-reply-topic", "forged-tenant", "forged-signature", "dup-1", "late-good",
                "skewed-clock"]:
        assert answers[qid].error is None, (qid, answers[qid].error)
    # Signed, its reply topic off the pattern: refused without its text, never answered in full on kev.answers.
    assert answers["signed-bad-reply-topic"].error.code == "reply_topic_refused"
    assert answers["signed-bad-reply-topic"].text == ""
    assert answers["huge-request-id"].error.code == "invalid_field"
    assert "request_id" in answers["huge-request-id"].error.message
    assert answers["huge-prompt"].error.code == "too_large"
    # At the head of its partition yet stamped older than its timeout: the producer's clock is behind, not the
    # question late (consumers/intake/publish_clock.py; a stamp deep in a backlog: tests/test_deadlines.py).
    assert answers["skewed-clock"].finish_reason in ("length", "stop") and answers["skewed-clock"].usage.prompt_tokens
    # The unsigned update_defaults was not applied: a question without max_new_tokens got more than one.
    assert answers["late-0"].usage.completion_tokens > 1 and answers["late-1"].usage.completion_tokens > 1

    dead = await read_topic(kafka.bootstrap_servers, kafka.dlq_topic, 4, timeout=30, linger=1.0)
    reasons = Counter(dict(record.headers)[HEADER_DLQ_REASON].decode() for record in dead)
    assert reasons["not_utf8"] == 1, reasons
    assert reasons["unsigned"] == 2 and reasons["forged"] == 1, reasons  # each control record once
    published_to = {line.get("topic") for child in children for line in log_events(child, "published")}
    assert "someone.elses.topic" not in published_to and "not-a-reply-topic" not in published_to
    assert any(log_events(child, "question.untrusted") for child in children)
