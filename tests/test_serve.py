"""`kev serve` and `kev demo` end to end: the real engine (a tiny random-weight Llama), the real Kafka
path, the embedded Tansu broker. No mocks.

- in process: `serve` answers every question exactly once (error answers included) and commits offsets
  that cover every question once it has drained;
- `kev serve` as a process: SIGTERM drains what it has taken and exits 0;
- two `kev serve` processes in one group: one is SIGKILLed mid-work, the other takes its partitions
  and every question is still answered (at least once);
- `kev demo` runs the whole path on its own broker.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterable
from functools import partial

import anyio
import msgspec
import pytest
from aiokafka import AIOKafkaProducer

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures")
from kafka_fixtures import committed, kafka_config, read_topic, wait_committed  # noqa: E402
from serve_fixtures import (  # noqa: E402
    FAST_SESSION,
    STARTUP_TIMEOUT,
    AnswerReader,
    KevProcess,
    kev_env,
    kev_processes,
    log_events,
    serve_env,
    wait_assigned,
)

from consumers import create_topics, topic_plan  # noqa: E402
from consumers.messages import HEADER_QUESTION_ID  # noqa: E402
from schemas import KevConfig, decode_answer  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures"]
pytestmark = pytest.mark.anyio

ANSWER_TIMEOUT = 60.0


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiokafka is asyncio-only


def question(question_id: str, prompt: str = "Say something about the sea.", max_new_tokens: int = 8,
             **fields) -> bytes:
    return msgspec.json.encode({"question_id": question_id, "prompt": prompt,
                                "params": {"max_new_tokens": max_new_tokens}, **fields})


async def publish(bootstrap: str, topic: str, items: list[tuple[str, bytes]]) -> dict[str, tuple[int, int]]:
    """Send every (question_id, value) keyed by its id in one flush; question_id -> (partition, offset)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        futures = {qid: await producer.send(topic, value, key=qid.encode()) for qid, value in items}
        await producer.flush()
        return {qid: ((meta := await future).partition, meta.offset) for qid, future in futures.items()}
    finally:
        await producer.stop()


async def publish_one_batch(bootstrap: str, topic: str, items: list[tuple[str, bytes]]) -> None:
    """Append every (question_id, value) to partition 0 as ONE record batch: a fetch sees all or none."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        batch = producer.create_batch()
        for qid, value in items:
            assert batch.append(timestamp=None, key=qid.encode(), value=value) is not None, "batch full"
        await (await producer.send_batch(batch, topic, partition=0))
    finally:
        await producer.stop()


def commit_positions(sent: Iterable[tuple[int, int]], partitions: int) -> dict[int, int | None]:
    """The committed positions that cover every record sent as (partition, offset): the last one's + 1."""
    expected: dict[int, int | None] = dict.fromkeys(range(partitions))
    for partition, offset in sent:
        expected[partition] = max(expected[partition] or 0, offset + 1)
    return expected


# -- 1. in process ------------------------------------------------------------------------------------

@pytest.mark.kafka
async def test_serve_answers_each_question_once_and_commits_after_drain(kafka_broker, tiny_model, monkeypatch):
    from kev_async.app import serve
    from kev_async.runtime.lifecycle import Shutdown

    for name, value in FAST_SESSION.items():
        monkeypatch.setenv(name, value)

    kafka = kafka_config(kafka_broker, partitions=2)
    cfg = KevConfig(kafka=kafka)
    cfg = msgspec.structs.replace(
        cfg, core=msgspec.structs.replace(cfg.core, max_context=64, device="cpu"),
        router=msgspec.structs.replace(cfg.router, max_parallel_queries=8),
        kv_cache=msgspec.structs.replace(cfg.kv_cache, num_blocks=256),
        metrics=msgspec.structs.replace(cfg.metrics, port=0))  # no metrics endpoint: no fixed port to collide on
    items = [(f"q{i:02d}", question(f"q{i:02d}", f"Question number {i}: what is {i} plus {i}?"))
             for i in range(20)]
    items.append(("too-long", question("too-long", "tell me a story " * 60)))  # > 64 prompt tokens
    items.append(("no-adapter", question("no-adapter", "hello", adapter="nope")))
    shutdown = Shutdown(drain_deadline=30.0)

    with anyio.fail_after(ANSWER_TIMEOUT + 60):
        async with anyio.create_task_group() as tg:
            running = await tg.start(partial(serve, cfg, shutdown, model=tiny_model))
            assert running.bootstrap_servers == kafka_broker.bootstrap_servers
            assert running.model == tiny_model.name
            positions = await publish(kafka.bootstrap_servers, kafka.questions_topic, items)
            records = await read_topic(kafka.bootstrap_servers, kafka.answers_topic, len(items),
                                       timeout=ANSWER_TIMEOUT, linger=1.0)
            shutdown.request("test over")  # serve returns once drained and committed

    answers = {}
    for record in records:
        answer = decode_answer(record.value)
        assert answer.question_id not in answers, f"two answers for {answer.question_id}"
        answers[answer.question_id] = answer
        assert record.key == answer.question_id.encode()
        assert (HEADER_QUESTION_ID, answer.question_id.encode()) in record.headers
    assert set(answers) == {qid for qid, _ in items}

    assert answers["too-long"].finish_reason == "error"
    assert answers["too-long"].error.code == "prompt_too_long"
    assert answers["no-adapter"].finish_reason == "error"
    assert answers["no-adapter"].error.code == "unknown_adapter"
    for qid, _ in items[:20]:
        answer = answers[qid]
        assert answer.error is None, (qid, answer.error)
        assert answer.finish_reason in ("length", "stop")
        assert 1 <= answer.usage.completion_tokens <= 8
        assert answer.token_ids and len(answer.token_ids) == answer.usage.completion_tokens
        assert answer.audit.worker == running.worker

    # The group's committed offsets cover every question: the next offset past the last one per partition.
    expected = commit_positions(positions.values(), kafka.partitions)
    got = await committed(kafka.bootstrap_servers, kafka.group_id, kafka.questions_topic, kafka.partitions)
    got = {p: (c if c is not None and c >= 0 else None) for p, c in got.items()}
    assert got == expected


# -- 2. `kev serve` and SIGTERM ---------------------------------------------------------------------

@pytest.mark.kafka
async def test_kev_serve_drains_and_exits_0_on_sigterm(kafka_broker, tiny_model_dir, tmp_path):
    # One partition and one record batch: the fetch that brings any of the second batch brings all of it,
    # so once one of them is answered the worker has taken every one, and SIGTERM must not lose any.
    kafka = kafka_config(kafka_broker, partitions=1)
    await create_topics(kafka, topic_plan(kafka))
    reader = AnswerReader(kafka.bootstrap_servers, kafka.answers_topic)
    drain_deadline = 30.0
    with kev_processes() as children:
        async with anyio.create_task_group() as tg:
            await tg.start(reader.run)
            kev = KevProcess(["serve", "--model", str(tiny_model_dir), "--bootstrap-servers",
                              kafka.bootstrap_servers, "--drain-deadline", str(drain_deadline)],
                             serve_env(kafka), tmp_path / "serve.log")
            children.append(kev)
            await publish(kafka.bootstrap_servers, kafka.questions_topic, [("first", question("first"))])
            await reader.wait_for({"first"}, STARTUP_TIMEOUT, f"answer: {kev.describe()}")

            # Lengths 4..124: when the first of them is answered the longer ones are still being decoded.
            second = [(f"s{i}", question(f"s{i}", f"Tell me about the number {i}.", max_new_tokens=4 + 20 * i))
                      for i in range(7)]
            await publish_one_batch(kafka.bootstrap_servers, kafka.questions_topic, second)
            await reader.wait_count(2, ANSWER_TIMEOUT)
            answered_before = reader.question_ids()
            kev.signal(signal.SIGTERM)
            signalled = time.monotonic()
            rc = await anyio.to_thread.run_sync(kev.wait, drain_deadline + 30)
            took = time.monotonic() - signalled
            assert rc == 0, kev.describe()
            assert took < drain_deadline, f"took {took:.1f}s to stop"

            await reader.wait_for({qid for qid, _ in second} | {"first"}, 10, "answer after SIGTERM")
            await reader.caught_up()  # kev is gone: every answer it sent, a second one included, is read
            tg.cancel_scope.cancel()

    counts = Counter(answer.question_id for answer in reader.answers)
    assert all(n == 1 for n in counts.values()), counts
    assert all(answer.error is None for answer in reader.answers)
    long_one = next(a for a in reader.answers if a.question_id == "s6")
    assert long_one.usage.completion_tokens == 124  # drained in full, not cut short
    # Some of the second batch were still in flight at the signal (else this test proved nothing).
    assert "s6" not in answered_before, answered_before
    assert log_events(kev, "shutdown.requested") and log_events(kev, "shutdown.drained"), kev.describe()
    got = await committed(kafka.bootstrap_servers, kafka.group_id, kafka.questions_topic, 1)
    assert got == {0: 1 + len(second)}


# -- 3. scale-out: two workers, one killed -----------------------------------------------------------

@pytest.mark.kafka
async def test_two_workers_one_killed_survivor_answers_everything(kafka_broker, tiny_model_dir, tmp_path):
    kafka = kafka_config(kafka_broker, partitions=4)
    await create_topics(kafka, topic_plan(kafka))
    reader = AnswerReader(kafka.bootstrap_servers, kafka.answers_topic)
    # Two questions at a time, 96 tokens each: a worker's ~20 questions take ten rounds of ~100 steps,
    # so the kill lands mid-work.
    env = serve_env(kafka, KEV_ROUTER__MAX_PARALLEL_QUERIES="2")
    with kev_processes() as children:
        async with anyio.create_task_group() as tg:
            await tg.start(reader.run)
            for name in ("a", "b"):
                children.append(KevProcess(["serve", "--model", str(tiny_model_dir), "--bootstrap-servers",
                                            kafka.bootstrap_servers], env, tmp_path / f"serve-{name}.log"))
            # Both in the group before any question, so the partitions are shared from the start.
            await wait_assigned(children)

            items = [(f"q{i:02d}", question(f"q{i:02d}", f"Count to {i}, slowly.", max_new_tokens=96))
                     for i in range(40)]
            positions = await publish(kafka.bootstrap_servers, kafka.questions_topic, items)
            await reader.wait_count(1, ANSWER_TIMEOUT)
            first_worker = reader.answers[0].audit.worker
            victim = next(c for c in children if first_worker.endswith(f"-{c.pid}"))
            survivor = next(c for c in children if c is not victim)
            victim.kill()  # SIGKILL: no drain, no commit
            killed_at = len(reader.answers)
            by_victim = {a.question_id for a in reader.answers if a.audit.worker == first_worker}

            await reader.wait_for({qid for qid, _ in items}, 120, f"answer: {survivor.describe()}")
            # The survivor's commits cover every question: each answer it owes, a late duplicate included,
            # is acked, and once the reader is at the topic's end it has read them all.
            await wait_committed(kafka.bootstrap_servers, kafka.group_id, kafka.questions_topic,
                                 commit_positions(positions.values(), kafka.partitions), timeout=60)
            await reader.caught_up()
            tg.cancel_scope.cancel()
        assert survivor.running(), survivor.describe()
        survivor.signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(survivor.wait, 30) == 0, survivor.describe()

    counts = Counter(answer.question_id for answer in reader.answers)
    duplicates = sum(n - 1 for n in counts.values())
    print(f"\nscale-out: {len(reader.answers)} answers for {len(counts)} questions, {duplicates} duplicates; "
          f"{killed_at} answers before the kill, {len(by_victim)} from the killed worker")
    assert set(counts) == {qid for qid, _ in items}
    assert all(a.error is None for a in reader.answers)
    # The survivor answered questions on partitions the victim had held: it took them over.
    victim_partitions = {positions[qid][0] for qid in by_victim}
    survivor_partitions = {positions[a.question_id][0] for a in reader.answers[killed_at:]
                           if a.audit.worker != first_worker}
    assert victim_partitions & survivor_partitions, (victim_partitions, survivor_partitions)
    assert len(log_events(survivor, "partitions_assigned")) >= 2, survivor.describe()


# -- 4. `kev demo` -----------------------------------------------------------------------------------

@pytest.mark.kafka
def test_kev_demo_runs_the_whole_path(tiny_model_dir, tmp_path):
    demo = KevProcess(["demo", "--questions", "4", "--max-new-tokens", "8", "--model", str(tiny_model_dir)],
                      kev_env(KEV_KV_CACHE__NUM_BLOCKS="512"), tmp_path / "demo.log")
    try:
        rc = demo.wait(STARTUP_TIMEOUT + ANSWER_TIMEOUT)
    finally:
        demo.kill()
    output = demo.log()
    assert rc == 0, demo.describe()
    answer_lines = [line for line in output.splitlines() if line.startswith("[")]
    assert len(answer_lines) == 5, output[-4000:]
    assert sum("error" in line.split("]", 1)[1][:8] for line in answer_lines) == 1, answer_lines
    assert "5 answers (1 error answer), 1 dead letter," in output, output[-4000:]
    assert "1 dead letter" in output, output[-4000:]


# -- the session timeout escape hatch -------------------------------------------------------------------

def test_consumer_options_session_timeout_from_env():
    from kev_async.app import EMBEDDED_CONSUMER_OPTIONS, consumer_options

    assert consumer_options(False, env={}) is None  # aiokafka's defaults on a broker we did not start
    assert consumer_options(True, env={}) == EMBEDDED_CONSUMER_OPTIONS
    fast = {"session_timeout_ms": 3000, "heartbeat_interval_ms": 300, "rebalance_timeout_ms": 3000}
    env = {"KEV_KAFKA_SESSION_TIMEOUT_MS": "3000"}
    assert consumer_options(False, env=env) == fast
    assert consumer_options(True, env=env) == fast
    assert consumer_options(True, {"session_timeout_ms": 2000}, env=env) == {"session_timeout_ms": 2000}
    for bad in ("3s", "500"):
        with pytest.raises(ValueError, match="KEV_KAFKA_SESSION_TIMEOUT_MS"):
            consumer_options(False, env={"KEV_KAFKA_SESSION_TIMEOUT_MS": bad})
