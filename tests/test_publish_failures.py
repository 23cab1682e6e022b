"""Failure injection on the answer publish path, against real brokers (the embedded Tansu).

- an answer larger than the producer's max_request_size is cut to fit and marked `truncated`; the
  questions after it are answered as usual;
- a question whose ids alone would overflow a record still ends with one (cut) answer;
- an answers topic the broker refuses is retried, then the worker stops with PublishFailed, the
  question's offset is not committed, and /health turns 503;
- how each of aiokafka's own errors is sorted (retry, another record, avoid a reply topic, stop);
- a broker that goes away and comes back within the retry budget: the answer is published once it
  is back, and only then committed; on a caller's reply topic too (it is not given up after one
  failure, nor sent elsewhere); a broker that does not come back ends the worker publish_retry_s
  after the answer's first send, however long one request may take;
- a reply topic the broker refuses: its answer ends as a dead letter without its text at the
  question's deadline, the next ones at once while the topic is avoided, then it is tried again;
  nothing goes to the answers topic;
- `kev serve`: an oversized answer and a 900 KB request_id do not stop the worker; a broker gone for
  longer than kafka.publish_retry_ms makes it exit 1 with one kev.kafka_failed line.
"""

from __future__ import annotations

import time
from functools import partial

import anyio
import msgspec
import pytest
from aiokafka.errors import (
    InvalidMessageError,
    InvalidTimestampError,
    InvalidTopicError,
    KafkaConnectionError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NotLeaderForPartitionError,
    PolicyViolationError,
    TopicAuthorizationFailedError,
    UnknownTopicOrPartitionError,
    UnsupportedForMessageFormatError,
)
from structlog.testing import capture_logs

from consumers import EmbeddedBroker, Inbound, KafkaWorker, Outbound, create_topics, topic_plan
from consumers.publish.delivery import Next, PublishFailed, decide, record_size
from kev_async.observe.metrics import Metrics
from schemas import AnswerEvent, TrustConfig, decode_answer
from schemas.signing import QUESTION, Signer

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures")
from kafka_fixtures import (  # noqa: E402
    FAST_GROUP,
    HoldingEngine,
    StandInEngine,
    answer_for,
    committed,
    kafka_config,
    produce,
    produce_records,
    question,
    read_to_end,
    read_topic,
    running_worker,
    wait_committed,
)
from polling import eventually  # noqa: E402
from serve_fixtures import (  # noqa: E402
    KevProcess,
    free_port,
    http_get,
    kev_processes,
    log_events,
    serve_env,
    wait_log,
)

pytest_plugins = ["kafka_fixtures", "serve_fixtures"]
pytestmark = [pytest.mark.kafka, pytest.mark.anyio]

BIG_TEXT = "long answer " * 2000  # 24,000 characters


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiokafka is asyncio-only


async def health(port: int) -> tuple[int, bytes]:
    status, _, body = await http_get(port, "/health")
    return status, body.encode()


async def healthy(port: int) -> bool:
    return (await health(port))[0] == 200


class BigAnswerEngine(StandInEngine):
    """Echoes, except that a question whose prompt is "big" gets a 24,000-character answer."""

    async def __call__(self, inbox, outbox) -> None:
        async with inbox, outbox:
            async for inbound in inbox:
                self.received.append(inbound)
                answer = answer_for(inbound)
                if inbound.question.prompt == "big":
                    answer = msgspec.structs.replace(answer, text=BIG_TEXT, token_ids=tuple(range(6000)))
                await outbox.send(Outbound(answer, inbound))


def answers_by_id(records) -> dict[str, list[tuple[AnswerEvent, object]]]:
    out: dict[str, list] = {}
    for record in records:
        answer = decode_answer(record.value)
        out.setdefault(answer.question_id, []).append((answer, record))
    return out


# -- the record's own failures: the question ends with an answer, the loop goes on ------------------

async def test_an_answer_larger_than_the_producer_allows_is_cut_to_fit_and_the_worker_goes_on(kafka_broker):
    cfg = kafka_config(kafka_broker, max_request_size=4096)
    bootstrap = kafka_broker.bootstrap_servers
    async with running_worker(cfg, BigAnswerEngine()):
        sent = await produce(bootstrap, cfg.questions_topic, [question("big", "big"), question("after", "after")],
                             key=b"same")  # one partition: "after" comes behind "big"
        records = await read_topic(bootstrap, cfg.answers_topic, 2)
        partition = sent[0][0]
        await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic,
                             {p: (2 if p == partition else None) for p in range(2)})
    answers = answers_by_id(records)
    assert sorted(answers) == ["after", "big"] and all(len(v) == 1 for v in answers.values())
    (big, big_record), = answers["big"]
    assert big.truncated and big.finish_reason == "stop" and big.error is None
    assert 0 < len(big.text) < len(BIG_TEXT) and BIG_TEXT.startswith(big.text)
    assert 0 < len(big.token_ids) < 6000 and big.token_ids == tuple(range(len(big.token_ids)))
    assert record_size(big_record.key, big_record.value, list(big_record.headers)) <= 4096
    (after, _), = answers["after"]
    assert after.text == "echo: after" and not after.truncated


async def test_a_question_whose_ids_alone_overflow_a_record_still_gets_one_answer(kafka_broker):
    cfg = kafka_config(kafka_broker, max_request_size=4096)
    bootstrap = kafka_broker.bootstrap_servers
    huge_id = "r" * 10_000
    async with running_worker(cfg):
        await produce(bootstrap, cfg.questions_topic, [question("huge-request-id", request_id=huge_id),
                                                       question("next", "next")], key=b"same")
        records = await read_topic(bootstrap, cfg.answers_topic, 2)
    answers = answers_by_id(records)
    assert sorted(answers) == ["huge-request-id", "next"] and all(len(v) == 1 for v in answers.values())
    (first, _), = answers["huge-request-id"]
    # An error answer (the id is over a bound) or the answer itself: either way cut, never the 10,000 characters.
    assert first.request_id is None or (len(first.request_id) <= 256 and huge_id.startswith(first.request_id))
    assert answers["next"][0][0].text == "echo: next"


# -- the broker refuses or is away: retried, then the worker stops; nothing committed before its ack ---

async def test_a_refused_answers_topic_is_retried_then_the_worker_stops_and_commits_nothing_unacked(kafka_broker):
    # Tansu answers an illegal topic name with UnknownTopicOrPartition, a retriable error, so this is the
    # path of an answers topic that stays unavailable: retried for publish_retry_s, then PublishFailed.
    cfg = kafka_config(kafka_broker, partitions=1, answers_topic="answers topic that cannot be")
    bootstrap = kafka_broker.bootstrap_servers
    await create_topics(cfg, {cfg.questions_topic: 1})
    questions_out, questions_in = anyio.create_memory_object_stream[Inbound](16)
    answers_out, answers_in = anyio.create_memory_object_stream[Outbound](16)
    worker = KafkaWorker(cfg, questions_out, answers_in, consumer_options=FAST_GROUP, create_topics=False,
                         producer_options={"request_timeout_ms": 500}, publish_retry_s=2.0)
    metrics, port = Metrics(), free_port()
    metrics.watch_kafka(worker)
    failures: list[BaseException] = []

    async def run_worker(*, task_status) -> None:
        try:
            await worker.run(task_status=task_status)
        except PublishFailed as error:
            failures.append(error)

    with capture_logs() as logs, anyio.fail_after(60):
        async with metrics.endpoint(port), anyio.create_task_group() as tg:
            tg.start_soon(StandInEngine(), questions_in, answers_out)
            await tg.start(run_worker)
            await worker.wait_assigned()
            await eventually(worker.healthy)
            assert await health(port) == (200, b'{"status":"ok"}')
            began = time.monotonic()
            await produce(bootstrap, cfg.questions_topic, [question("q0")])
            await eventually(lambda: bool(failures), timeout=30)
            took = time.monotonic() - began
            assert await health(port) == (503, b'{"status":"unhealthy"}')
    assert "cannot publish answers to topic 'answers topic that cannot be' (2." in str(failures[0])
    assert took >= 2.0, took  # the retry budget was spent first
    assert len([e for e in logs if e["event"] == "publish_retrying"]) >= 2
    assert await committed(bootstrap, cfg.group_id, cfg.questions_topic, 1) == {0: None}


async def test_a_broker_away_for_a_while_gets_the_answer_once_back_and_only_then_commits(kafka_broker):
    answers_broker = EmbeddedBroker(port=free_port())  # a fixed port: restarted, it is at the same address
    await answers_broker.astart()
    cfg = kafka_config(kafka_broker, partitions=1)
    bootstrap = kafka_broker.bootstrap_servers
    engine = HoldingEngine()
    producer = {"bootstrap_servers": answers_broker.bootstrap_servers, "request_timeout_ms": 1000}
    try:
        with capture_logs() as logs:
            async with running_worker(cfg, engine, producer_options=producer, publish_retry_s=60.0) as worker:
                await produce(bootstrap, cfg.questions_topic, [question("q0")])
                await eventually(lambda: len(engine.received) == 1)
                await answers_broker.astop()
                engine.release.set()
                # Two sends of the answer failed (a request timeout each): the worker has it and holds it,
                # unacked, so nothing may be committed.
                await eventually(lambda: len(retried(logs, "q0")) >= 2, timeout=30)
                assert worker.statistics().answers == 0 and worker.tracker.in_flight() == 1
                assert await committed(bootstrap, cfg.group_id, cfg.questions_topic, 1) == {0: None}
                await answers_broker.astart()
                records = await read_topic(answers_broker.bootstrap_servers, cfg.answers_topic, 1, timeout=30)
                await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, {0: 1})
                assert worker.healthy()
    finally:
        answers_broker.stop()
    assert [decode_answer(r.value).question_id for r in records] == ["q0"]


def retried(logs: list[dict], question_id: str, topic: str | None = None) -> list[dict]:
    """The `publish_retrying` events of `question_id`'s records (on `topic`, if given)."""
    return [e for e in logs if e["event"] == "publish_retrying" and e["question_id"] == question_id
            and topic in (None, e["topic"])]


def test_each_of_aiokafkas_errors_is_sorted_into_retry_another_record_avoid_the_topic_or_stop():
    # The embedded Tansu refuses no record for good (an illegal topic name is a retriable
    # UnknownTopicOrPartition, it has no ACLs, no topic policies, no timestamp limits), so the
    # non-retriable refusals are checked here on the sorting itself, with aiokafka's own error classes.
    def on_fleet_topic(error, exhausted=False, **kw):
        return decide(error, reply=False, exhausted=exhausted, **kw)

    def on_reply_topic(error, exhausted=False):
        return decide(error, reply=True, exhausted=exhausted)

    # The answers or dead-letter topic itself refused: every record after would be too. Stop, do not
    # turn each question into a dead letter behind a green /health.
    for refusal in (TopicAuthorizationFailedError(), InvalidTopicError(), PolicyViolationError(),
                    UnsupportedForMessageFormatError(), InvalidMessageError(), InvalidTimestampError()):
        assert on_fleet_topic(refusal) is Next.FAIL, refusal
    # ... except what is this record's own: too large, or a forwarded question's own timestamp.
    assert on_fleet_topic(MessageSizeTooLargeError()) is Next.FALLBACK
    assert on_fleet_topic(InvalidTimestampError(), own_timestamp=True) is Next.FALLBACK
    assert on_fleet_topic(msgspec.EncodeError("bad")) is Next.FALLBACK
    # Transient: retried within the window, then the worker stops.
    for transient in (KafkaTimeoutError(), KafkaConnectionError(), NotLeaderForPartitionError(),
                      UnknownTopicOrPartitionError()):
        assert on_fleet_topic(transient) is Next.RETRY, transient
        assert on_fleet_topic(transient, exhausted=True) is Next.FAIL, transient
    # A caller's reply topic: a leader move is retried like anywhere else (not given up at once), ...
    assert on_reply_topic(KafkaTimeoutError()) is Next.RETRY
    assert on_reply_topic(NotLeaderForPartitionError()) is Next.RETRY
    # ... still away at the question's deadline: this answer ends in its fallback (a dead letter without its
    # text, never another topic), the topic stays;
    assert on_reply_topic(KafkaTimeoutError(), exhausted=True) is Next.FALLBACK
    assert on_reply_topic(MessageSizeTooLargeError()) is Next.FALLBACK
    # refused, or unknown after its retries: its fallback, and its next records fall back at once for a while.
    for refusal in (TopicAuthorizationFailedError(), InvalidTopicError(), PolicyViolationError()):
        assert on_reply_topic(refusal) is Next.AVOID_TOPIC, refusal
    assert on_reply_topic(UnknownTopicOrPartitionError(), exhausted=True) is Next.AVOID_TOPIC


class HoldOneEngine(StandInEngine):
    """Echoes at once, except the question "held": answered once `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = anyio.Event()

    async def __call__(self, inbox, outbox) -> None:
        async with inbox, outbox, anyio.create_task_group() as tg:
            async for inbound in inbox:
                self.received.append(inbound)
                if inbound.question.question_id == "held":
                    tg.start_soon(self._later, inbound, outbox.clone())
                else:
                    await outbox.send(Outbound(answer_for(inbound), inbound))

    async def _later(self, inbound, outbox) -> None:
        async with outbox:
            await self.release.wait()
            await outbox.send(Outbound(answer_for(inbound), inbound))


def signed(question_id: str, cfg, **fields) -> tuple[None, bytes, list]:
    value = question(question_id, **fields)
    return None, value, Signer.from_config(cfg.trust).headers(QUESTION, cfg.questions_topic, None, value)


async def test_a_reply_topic_whose_broker_is_away_for_a_while_still_gets_its_answers(kafka_broker, tmp_path):
    # The gateway's reply topic lives on a broker that goes away for 2.5 s (two request timeouts): its
    # answer is retried there, not sent to the answers topic (which the gateway never reads), and the
    # next answer for that gateway goes to its reply topic too. The broker keeps its topics across the
    # restart, as a real one does (durable storage): with memory storage the topic is re-created on first
    # use, and a producer's and a reader's creations can race and drop a record (seen on a loaded CI run).
    answers_broker = EmbeddedBroker(port=free_port(), storage="durable", data_dir=tmp_path)
    await answers_broker.astart()
    trust = TrustConfig(keys={"t": "a-secret-for-the-tests"})
    cfg = kafka_config(kafka_broker, partitions=1, trust=trust)
    reply_topic = f"kev.replies.{cfg.answers_topic}"
    bootstrap, elsewhere = kafka_broker.bootstrap_servers, answers_broker.bootstrap_servers
    engine = HoldOneEngine()
    producer = {"bootstrap_servers": elsewhere, "request_timeout_ms": 1000}
    try:
        with capture_logs() as logs:
            # Windows far above the ~3 s this takes alone: on a loaded CI machine the restarted broker's
            # topics (memory storage: re-created on first use) can take a while to come back.
            async with running_worker(cfg, engine, producer_options=producer, publish_retry_s=90.0):
                await produce_records(bootstrap, cfg.questions_topic, [signed("warm", cfg, reply_topic=reply_topic),
                                                                       signed("held", cfg, reply_topic=reply_topic)])
                await read_topic(elsewhere, reply_topic, 1, linger=0)  # the reply topic is known and written
                await eventually(lambda: len(engine.received) == 2)
                await answers_broker.astop()
                engine.release.set()
                # Away for two request timeouts: "held"'s answer was tried on its reply topic and failed twice.
                await eventually(lambda: len(retried(logs, "held", reply_topic)) >= 2, timeout=30)
                await answers_broker.astart()
                held = await read_topic(elsewhere, reply_topic, 2, timeout=75, linger=0)  # the topic kept "warm"
                await produce_records(bootstrap, cfg.questions_topic, [signed("after", cfg, reply_topic=reply_topic)])
                on_reply = await read_topic(elsewhere, reply_topic, 3, timeout=75, linger=0)
                # All three settled: whatever the worker sent for them is acked, so on the topic by now.
                await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, {0: 3})
                on_answers = await read_to_end(elsewhere, cfg.answers_topic)
    finally:
        answers_broker.stop()
    # The reply topic was auto-created with the broker's default partitions: no order across them.
    assert sorted(r.key for r in held) == [b"held", b"warm"]
    assert sorted(r.key for r in on_reply) == [b"after", b"held", b"warm"]
    assert on_answers == []
    assert [e for e in logs if e["event"] == "publish_retrying" and e["topic"] == reply_topic]
    assert not [e for e in logs if e["event"] == "publish_refused"]


async def test_a_reply_topic_the_broker_refuses_ends_answers_as_dead_letters_and_is_avoided_for_a_while(
        kafka_broker):
    # ".." passes the name check and (here) the reply-topic pattern, but the broker never creates it: its
    # metadata stays unknown (UnknownTopicOrPartition) until the question's deadline (1.5 s). The answer
    # ends as a dead letter without its text, never on the answers topic; the next one for that topic
    # goes there at once, untried; after avoid_s the topic is tried again.
    trust = TrustConfig(keys={"t": "a-secret-for-the-tests"}, reply_topic_pattern=r"\.\.")
    cfg = kafka_config(kafka_broker, partitions=1, trust=trust)
    bootstrap = kafka_broker.bootstrap_servers
    with capture_logs() as logs:
        async with running_worker(cfg, producer_options={"request_timeout_ms": 500}, reply_avoid_s=3.0):
            await produce_records(bootstrap, cfg.questions_topic, [signed("first", cfg, reply_topic="..",
                                                                          timeout_ms=1500)])
            await read_topic(bootstrap, cfg.dlq_topic, 1, linger=0)
            avoided_at = time.monotonic()
            await produce_records(bootstrap, cfg.questions_topic, [signed("while-avoided", cfg, reply_topic="..",
                                                                          timeout_ms=1500)])
            await read_topic(bootstrap, cfg.dlq_topic, 2, linger=0)
            await anyio.sleep(max(0.0, avoided_at + 3.2 - time.monotonic()))
            await produce_records(bootstrap, cfg.questions_topic, [signed("after-expiry", cfg, reply_topic="..",
                                                                          timeout_ms=1500)])
            dead = await read_topic(bootstrap, cfg.dlq_topic, 3, timeout=20, linger=0.3)
            await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, {0: 3})
            answers = await read_to_end(bootstrap, cfg.answers_topic)
    assert answers == []
    assert [r.key for r in dead] == [b"first", b"while-avoided", b"after-expiry"]
    assert all(dict(r.headers)["dlq.reason"] == b"reply_topic_unwritable" for r in dead)
    assert all(decode_answer(r.value).text == "" for r in dead)
    tried = [e["question_id"] for e in logs if e["event"] == "publish_retrying" and e["topic"] == ".."]
    assert "first" in tried and "after-expiry" in tried and "while-avoided" not in tried, tried
    refused = [e for e in logs if e["event"] == "publish_refused"]
    assert [e["question_id"] for e in refused] == ["first", "after-expiry"] and refused[0]["topic_avoided_s"] == 3.0
    untried, = [e for e in logs if e["event"] == "reply_topic_unusable"]
    assert untried["question_id"] == "while-avoided" and "refused by the broker" in untried["reason"]


async def test_a_broker_that_stays_away_ends_the_worker_publish_retry_s_after_the_answers_first_send(
        kafka_broker):
    # One request may take 5 s (request_timeout_ms) but the window is 2 s from the answer's first send:
    # the worker gives up (unhealthy, PublishFailed) at 2 s, not after a first failed request plus 2 s.
    # Stopping then lets the producer flush what it holds (up to request_timeout_ms, at most the
    # worker's shutdown_timeout), so run() returns a little later.
    answers_broker = EmbeddedBroker(port=free_port())
    await answers_broker.astart()
    cfg = kafka_config(kafka_broker, partitions=1)
    bootstrap = kafka_broker.bootstrap_servers
    engine = HoldOneEngine()
    questions_out, questions_in = anyio.create_memory_object_stream[Inbound](16)
    answers_out, answers_in = anyio.create_memory_object_stream[Outbound](16)
    worker = KafkaWorker(cfg, questions_out, answers_in, consumer_options=FAST_GROUP, publish_retry_s=2.0,
                         producer_options={"bootstrap_servers": answers_broker.bootstrap_servers,
                                           "request_timeout_ms": 5000})
    failures: list[tuple[float, BaseException]] = []

    async def run_worker(*, task_status) -> None:
        try:
            await worker.run(task_status=task_status)
        except PublishFailed as error:
            failures.append((time.monotonic(), error))

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine, questions_in, answers_out)
                await tg.start(run_worker)
                await worker.wait_assigned()
                await produce(bootstrap, cfg.questions_topic, [question("warm"), question("held")])
                await read_topic(answers_broker.bootstrap_servers, cfg.answers_topic, 1, linger=0)
                await eventually(lambda: len(engine.received) == 2)
                await answers_broker.astop()
                assert worker.healthy()
                engine.release.set()
                sent = time.monotonic()
                await eventually(lambda: not worker.healthy(), timeout=30)
                gave_up = time.monotonic() - sent
                await eventually(lambda: bool(failures), timeout=30)
    finally:
        answers_broker.stop()
    assert "cannot publish answers" in str(failures[0][1]) and "no ack within 2s of the first send" in str(failures[0][1])
    assert 2.0 <= gave_up < 3.5, gave_up  # before: 5 s for the first request to fail, then 2 s more
    print(f"\ngave up {gave_up:.1f}s after the first send, run() returned after {failures[0][0] - sent:.1f}s")
    assert await committed(bootstrap, cfg.group_id, cfg.questions_topic, 1) == {0: 1}  # "warm" only


# -- `kev serve` ----------------------------------------------------------------------------------------

async def test_kev_serve_goes_on_after_an_oversized_answer_and_a_900_kb_request_id(kafka_broker, tiny_model_dir,
                                                                                 tmp_path):
    kafka = kafka_config(kafka_broker, partitions=1)
    bootstrap = kafka.bootstrap_servers
    await create_topics(kafka, topic_plan(kafka))
    env = serve_env(kafka, KEV_KAFKA__MAX_REQUEST_SIZE="4096")
    with kev_processes() as children:
        kev = KevProcess(["serve", "--model", str(tiny_model_dir), "--bootstrap-servers", bootstrap], env,
                         tmp_path / "serve.log")
        children.append(kev)
        events = [question("long", "Write a long story.", params={"max_new_tokens": 600}),
                  question("huge-id", request_id="x" * 900_000),
                  question("good", "Say hi.", params={"max_new_tokens": 4})]
        await produce(bootstrap, kafka.questions_topic, events)
        records = await read_topic(bootstrap, kafka.answers_topic, 3, timeout=120)
        assert kev.running(), kev.describe()
    answers = answers_by_id(records)
    assert sorted(answers) == ["good", "huge-id", "long"], kev.describe()
    long_answer = answers["long"][0][0]
    assert long_answer.truncated and long_answer.usage.completion_tokens == 600, kev.describe()
    assert len(long_answer.token_ids) < 600
    huge = answers["huge-id"][0][0]
    assert huge.request_id is None or len(huge.request_id) <= 256
    good = answers["good"][0][0]
    assert good.error is None and not good.truncated and good.usage.completion_tokens == 4
    assert log_events(kev, "answer_truncated"), kev.describe()


async def test_kev_serve_exits_1_when_answers_cannot_be_published(tiny_model_dir, tmp_path):
    # A broker of its own, stopped while the worker computes an answer, and never back.
    broker = EmbeddedBroker()
    await broker.astart()
    kafka = kafka_config(broker, partitions=1)
    await create_topics(kafka, topic_plan(kafka))
    port = free_port()
    env = serve_env(kafka, KEV_KAFKA__PUBLISH_RETRY_MS="2000", KEV_METRICS__PORT=str(port))
    try:
        with kev_processes() as children:
            kev = KevProcess(["serve", "--model", str(tiny_model_dir), "--bootstrap-servers",
                              broker.bootstrap_servers], env, tmp_path / "serve.log")
            children.append(kev)
            await wait_log(kev, "partitions_assigned", 90)
            await eventually(partial(healthy, port), timeout=90, every=0.1)
            await produce(broker.bootstrap_servers, kafka.questions_topic,
                          [question("slow", "Write a long story.", params={"max_new_tokens": 900})])
            # Taken: stop the broker before its answer is ready.
            await eventually(partial(in_flight, port), timeout=30, every=0.02)
            # Killed: Tansu's SIGTERM waits for its clients (5 s with transactional producers connected),
            # long enough for the answer to go out first.
            await broker.astop(kill=True)
            stopped = time.monotonic()
            rc = await anyio.to_thread.run_sync(kev.wait, 90)
            took = time.monotonic() - stopped
    finally:
        broker.stop()
    assert rc == 1, kev.describe()
    failed = log_events(kev, "kev.kafka_failed")
    assert len(failed) == 1 and "cannot publish answers" in failed[0]["error"], kev.describe()
    assert not log_events(kev, "published"), kev.describe()
    print(f"\nexited {rc} {took:.1f}s after the broker stopped")


async def in_flight(port: int) -> bool:
    """The worker's metrics say it holds a question."""
    for line in (await http_get(port, "/metrics"))[2].splitlines():
        if line.startswith("kev_kafka_in_flight "):
            return float(line.split()[1]) >= 1
    return False

