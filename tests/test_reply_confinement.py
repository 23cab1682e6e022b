"""A signed question's replies stay on its reply topic (issue 39, findings 3 and 7), on the embedded broker.

- a reply topic that cannot be written: the answer is retried until the question's deadline, then ends
  as a dead letter without its text; nothing goes to the shared answers or deltas topics;
- a signed question that is invalid gets its error answer on its reply topic, at once;
- every delta and the answer of one attempt carry its attempt id; a question redelivered after a worker
  stopped streams again under another, so a reader can tell two attempts apart.
"""

from __future__ import annotations

import time

import anyio
import pytest

pytest.register_assert_rewrite("kafka_fixtures")
from kafka_fixtures import (  # noqa: E402
    FAST_GROUP,
    answer_for,
    kafka_config,
    produce_records,
    question,
    read_topic,
    running_worker,
    wait_committed,
)
from polling import eventually  # noqa: E402

from consumers import Inbound, KafkaWorker, Outbound  # noqa: E402
from schemas import AnswerDelta, LimitsConfig, TrustConfig, decode_answer, decode_delta  # noqa: E402
from schemas.signing import QUESTION, Signer  # noqa: E402

pytest_plugins = ["kafka_fixtures"]
pytestmark = [pytest.mark.kafka, pytest.mark.anyio]

KEYS = {"gw": "the-gateway-secret-1"}


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiokafka is asyncio-only


def signed(value: bytes, trust: TrustConfig, topic: str) -> tuple[None, bytes, list]:
    """A record for `topic`, signed (a signature binds the topic and the record key, here none)."""
    return None, value, Signer.from_config(trust).headers(QUESTION, topic, None, value)


async def test_an_unwritable_reply_topic_ends_in_a_dead_letter_without_text_never_on_the_shared_topics(
        kafka_broker):
    # ".." passes the (test's) reply-topic pattern, but the broker never creates it: its metadata stays
    # unknown. The question streams and has a 3 s deadline: retried until then, then a dead letter.
    trust = TrustConfig(keys=KEYS, reply_topic_pattern=r"\.\.")
    cfg = kafka_config(kafka_broker, partitions=1, trust=trust)
    bootstrap = kafka_broker.bootstrap_servers
    secret = question("plan", "the secret plan", tenant="acme", reply_topic="..", stream=True, timeout_ms=3000)
    async with running_worker(cfg, producer_options={"request_timeout_ms": 500}):
        began = time.monotonic()
        await produce_records(bootstrap, cfg.questions_topic, [signed(secret, trust, cfg.questions_topic)])
        dead = await read_topic(bootstrap, cfg.dlq_topic, 1, timeout=30, linger=0)
        took = time.monotonic() - began
        await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, {0: 1})
        answers = await read_topic(bootstrap, cfg.answers_topic, 0, linger=0.5)
        deltas = await read_topic(bootstrap, cfg.deltas_topic, 0, linger=0.5)

    assert answers == [] and deltas == []
    (record,) = dead
    headers = dict(record.headers)
    assert headers["dlq.reason"] == b"reply_topic_unwritable"
    assert headers["dlq.reply_topic"] == b".."
    assert headers["principal"] == b"gw/acme" and headers["question_id"] == b"plan"
    assert record.key == b"plan"
    assert b"secret" not in record.value  # the answer's text ("echo: the secret plan") stays unsent
    metadata = decode_answer(record.value)
    assert (metadata.question_id, metadata.text, metadata.token_ids) == ("plan", "", ())
    assert metadata.usage.cached_prompt_tokens == 0 == metadata.audit.cached_prompt_tokens
    assert metadata.audit.principal == "gw/acme" and metadata.audit.attempt
    assert 2.0 <= took < 15.0, took  # retried until the deadline, not given up at once nor held on


async def test_a_signed_invalid_question_gets_its_error_answer_on_its_reply_topic_at_once(kafka_broker):
    # One of each way a question can be invalid: a bad field (read from the loose JSON tree), an empty
    # prompt (from the decoded question), an event over the size limit (from its envelope). Unsigned, the
    # same reply_topic is not honoured: its error answer takes the answers topic.
    trust = TrustConfig(keys=KEYS)
    cfg = kafka_config(kafka_broker, partitions=1, trust=trust, limits=LimitsConfig(max_event_bytes=2000))
    bootstrap, replies = kafka_broker.bootstrap_servers, f"kev.replies.{cfg.group_id}"
    async with running_worker(cfg):
        began = time.monotonic()
        await produce_records(bootstrap, cfg.questions_topic, [
            signed(question("hot", params={"temperature": 99}, reply_topic=replies), trust, cfg.questions_topic),
            signed(question("blank", "   ", reply_topic=replies), trust, cfg.questions_topic),
            signed(question("huge", "x" * 3000, reply_topic=replies), trust, cfg.questions_topic),
            (None, question("unsigned-hot", params={"temperature": 99}, reply_topic=replies), []),
        ])
        private = await read_topic(bootstrap, replies, 3, timeout=20, linger=0)
        took = time.monotonic() - began
        public = await read_topic(bootstrap, cfg.answers_topic, 1, linger=0.5)
        await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, {0: 4})

    codes = {decode_answer(r.value).question_id: decode_answer(r.value).error.code for r in private}
    assert codes == {"hot": "invalid_field", "blank": "empty_prompt", "huge": "too_large"}
    assert {dict(r.headers)["principal"] for r in private} == {b"gw/-"}
    assert [(r.key, dict(r.headers)["principal"]) for r in public] == [(b"unsigned-hot", b"unsigned/-")]
    assert took < 15.0, took  # a caller waiting on its reply topic hears in seconds (it used to wait ~65 s)
    print(f"\nthree error answers on the reply topic {took:.2f}s after their questions were sent")


class StreamingEngine:
    """Streams three deltas for each question; answers only when `answers` is set."""

    def __init__(self, *, answers: bool) -> None:
        self.answers = answers
        self.received: list[Inbound] = []

    async def __call__(self, inbox, outbox) -> None:
        async with inbox, outbox:
            async for inbound in inbox:
                self.received.append(inbound)
                for seq, word in enumerate(("echo", ":", " done")):
                    await outbox.send(Outbound(AnswerDelta(inbound.question.question_id, seq, word), inbound))
                if self.answers:
                    await outbox.send(Outbound(answer_for(inbound), inbound))


async def test_each_attempt_streams_under_its_own_id_and_a_redelivery_is_a_new_attempt(kafka_broker):
    # The first worker streams and stops before it answers (cancelled: nothing committed); the second is
    # given the question again and streams it anew. Deltas of both reach the deltas topic, told apart by
    # their attempt; the answer carries the second attempt's.
    cfg = kafka_config(kafka_broker, partitions=1)
    bootstrap = kafka_broker.bootstrap_servers
    questions_out, questions_in = anyio.create_memory_object_stream[Inbound](8)
    answers_out, answers_in = anyio.create_memory_object_stream[Outbound](8)
    first = KafkaWorker(cfg, questions_out, answers_in, consumer_options=FAST_GROUP)
    async with anyio.create_task_group() as tg:
        tg.start_soon(StreamingEngine(answers=False), questions_in, answers_out)
        await tg.start(first.run)
        await produce_records(bootstrap, cfg.questions_topic, [(None, question("twice", stream=True), [])])
        await read_topic(bootstrap, cfg.deltas_topic, 3, linger=0)
        await eventually(lambda: first.statistics().deltas == 3)
        tg.cancel_scope.cancel()

    second = StreamingEngine(answers=True)
    async with running_worker(cfg, second):
        answers = await read_topic(bootstrap, cfg.answers_topic, 1, timeout=60, linger=0)
        await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, {0: 1})
        deltas = await read_topic(bootstrap, cfg.deltas_topic, 6)

    (answer,) = [decode_answer(r.value) for r in answers]
    streamed = [decode_delta(r.value) for r in deltas]
    attempts = list(dict.fromkeys(d.attempt for d in streamed))
    assert len(attempts) == 2 and all(attempts), attempts
    for attempt in attempts:
        assert [d.seq for d in streamed if d.attempt == attempt] == [0, 1, 2]
    assert answer.audit.attempt == attempts[1] and answer.audit.principal == "unsigned/-"
    assert {dict(r.headers)["principal"] for r in [*deltas, *answers]} == {b"unsigned/-"}
