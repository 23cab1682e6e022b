"""Deadlines count from the publish time (issue 26, item 6).

After a backlog, a question whose caller gave up long ago must end "timeout" without being computed,
and a producer's future timestamp must not buy it more time.
"""

import time
from functools import partial

import anyio
import msgspec
import pytest
from aiokafka import AIOKafkaProducer

from engine import Engine, EngineCore
from engine.schedule.deadlines import published_at
from schemas import Params, QuestionEvent, decode_answer

pytest.register_assert_rewrite("kafka_fixtures")
from kafka_fixtures import kafka_config, read_topic, running_worker  # noqa: E402

pytest_plugins = ["kafka_fixtures"]
SHORT = Params(max_new_tokens=4, temperature=0.0)


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the Kafka test needs asyncio; the engine tests run the same on it


@pytest.fixture(scope="module")
def model(harness, smollm2_tokenizer):
    """A tiny random Llama over SmolLM2's tokenizer, so real prompts are rendered and tokenized."""
    wide = harness.build_hf_tiny("llama", seed=100, vocab_size=49152)
    return harness.kev_model_from_hf(wide, smollm2_tokenizer, name="tiny-llama-wide")


@pytest.fixture
def options(harness):
    return harness.tiny_options(max_parallel_queries=4)


def now_ms(offset_s: float = 0.0) -> int:
    return int((time.time() + offset_s) * 1000)


class Spied:
    """An Engine whose prompt preparation (template + tokenizer) is counted."""

    def __init__(self, engine: Engine):
        self.engine, self.prepared = engine, []
        prepare = engine.core.prepare

        def counted(question):
            self.prepared.append(question.question_id)
            return prepare(question)

        engine.core.prepare = counted


def test_a_publish_time_in_the_future_counts_as_now():
    wall, clock = lambda: 1_000.0, lambda: 50.0
    assert published_at(990_000, wall=wall, clock=clock) == pytest.approx(40.0)  # ten seconds old
    assert published_at(2_000_000, wall=wall, clock=clock) == 50.0  # the future: now, not later
    assert published_at(None, wall=wall, clock=clock) is None
    assert published_at(-1, wall=wall, clock=clock) is None  # Kafka's "no timestamp"


@pytest.mark.anyio
async def test_a_question_published_longer_ago_than_its_timeout_ends_timeout_without_a_prefill(model, options):
    async with Engine(model, options) as engine:
        spy = Spied(engine)
        late = QuestionEvent(question_id="late", prompt="Name a colour.", params=SHORT, timeout_ms=5_000)
        answer = await engine.wait(await engine.submit(late, published_ms=now_ms(-60)), timeout=10)
        assert engine.core.num_forwards == 0 and spy.prepared == []  # not tokenized, not computed
        fresh = QuestionEvent(question_id="fresh", prompt="Name a colour.", params=SHORT, timeout_ms=5_000)
        served = await engine.wait(await engine.submit(fresh, published_ms=now_ms()), timeout=30)
    assert answer.finish_reason == "timeout" and answer.text == "" and answer.token_ids == ()
    assert answer.error.code == "deadline_expired" and "timeout_ms=5000" in answer.error.message
    assert "published 6" in answer.error.message  # ~60,000 ms ago: the caller sees how late it was
    assert answer.usage.prompt_tokens == 0 and answer.audit.steps == 0
    assert served.finish_reason == "length" and served.error is None and len(served.token_ids) == 4
    assert spy.prepared == ["fresh"]


@pytest.mark.anyio
async def test_a_future_timestamp_does_not_extend_the_deadline(model, options):
    async with Engine(model, options) as engine:
        # Arrived a second ago with a 500 ms timeout and stamped an hour ahead: expired all the same.
        q = QuestionEvent(question_id="future", prompt="Name a colour.", params=SHORT, timeout_ms=500)
        answer = await engine.wait(await engine.submit(q, arrival=time.monotonic() - 1.0,
                                                       published_ms=now_ms(3600)), timeout=10)
        # A future stamp with time to spare is served as usual.
        ok = QuestionEvent(question_id="future-ok", prompt="Name a colour.", params=SHORT, timeout_ms=30_000)
        served = await engine.wait(await engine.submit(ok, published_ms=now_ms(3600)), timeout=30)
    assert answer.finish_reason == "timeout" and answer.error.code == "deadline_expired"
    assert served.finish_reason == "length" and served.error is None


def test_a_question_that_expires_in_the_waiting_queue_is_never_prefilled(model, harness):
    core = EngineCore(model, harness.tiny_options(max_parallel_queries=1))
    core.add(QuestionEvent(question_id="running", prompt="Tell me a story.", params=Params(max_new_tokens=50)))
    core.step()  # "running" holds the only channel
    core.add(QuestionEvent(question_id="waiting", prompt="Name a colour.", params=SHORT, timeout_ms=30))
    time.sleep(0.05)
    answers = {}
    while core.has_work:
        answers.update((a.question_id, a) for a in core.step().answers)
    waited = answers["waiting"]
    assert waited.finish_reason == "timeout" and waited.token_ids == () and waited.audit.steps == 0
    assert waited.error.code == "deadline_expired" and "waited for a place" in waited.error.message
    assert core.scheduler.prompt_tokens_admitted == answers["running"].usage.prompt_tokens  # never admitted
    assert answers["running"].finish_reason == "length"


@pytest.mark.kafka
@pytest.mark.anyio
async def test_a_record_older_than_its_timeout_is_answered_timeout_through_kafka(kafka_broker, model, options):
    """The record's own timestamp (CreateTime) reaches the engine as the publish time."""
    from consumers import Outbound, create_topics, topic_plan
    from kev_async.engine_actor import engine_actor

    cfg = kafka_config(kafka_broker, partitions=1)
    made: list[Engine] = []

    def make_engine() -> Engine:
        made.append(Engine(model, options))
        return made[-1]

    # A backlog: the stale record waits behind more records than one fetch takes (max_records) when the
    # worker starts, so its stamp is believed (publish_clock.py).
    await create_topics(cfg, topic_plan(cfg))
    await send_questions(kafka_broker.bootstrap_servers, cfg.questions_topic,
                         [("stale", now_ms(-120)), *((f"fresh-{i}", None) for i in range(5))])
    actor = partial(engine_actor, engine_factory=make_engine, wrap=Outbound)
    async with running_worker(cfg, actor, max_records=4):
        records = await read_topic(kafka_broker.bootstrap_servers, cfg.answers_topic, 6)
    answers = {a.question_id: a for a in map(decode_answer, (r.value for r in records))}
    stale, fresh = answers.pop("stale"), list(answers.values())
    assert stale.finish_reason == "timeout" and stale.error.code == "deadline_expired"
    assert stale.usage.prompt_tokens == 0 and stale.token_ids == ()
    assert all(a.finish_reason == "length" and a.error is None for a in fresh)
    # Only the fresh questions' prompts were ever admitted (prefilled) by the engine.
    assert made[0].core.scheduler.prompt_tokens_admitted == sum(a.usage.prompt_tokens for a in fresh)


@pytest.mark.kafka
@pytest.mark.anyio
async def test_a_producer_whose_clock_runs_70_s_behind_still_gets_its_60_s_questions_answered(
        kafka_broker, model, options):
    """Issue 39, finding 8: a fresh record at the head of its partition is not older than its timeout,
    whatever its stamp says; the skew is measured and exported."""
    from consumers import Outbound
    from kev_async.engine_actor import engine_actor

    cfg = kafka_config(kafka_broker, partitions=1)
    actor = partial(engine_actor, engine_factory=lambda: Engine(model, options), wrap=Outbound)
    async with running_worker(cfg, actor) as worker:
        await send_questions(kafka_broker.bootstrap_servers, cfg.questions_topic,
                             [(f"skewed-{i}", now_ms(-70)) for i in range(3)], timeout_ms=60_000)
        records = await read_topic(kafka_broker.bootstrap_servers, cfg.answers_topic, 3)
        stats = worker.statistics()
    answers = [decode_answer(r.value) for r in records]
    assert [a.finish_reason for a in answers] == ["length"] * 3, [a.error for a in answers]
    assert 69_000 < stats.clock_skew_ms < 90_000 and stats.untrusted_timestamps == 3


def test_only_a_stamp_at_the_partitions_head_older_than_its_timeout_is_disbelieved():
    from consumers.intake.publish_clock import PublishClock

    clock = PublishClock(60_000, head_records=64, now_ms=lambda: 1_000_000.0)
    assert clock.published_ms(930_000, None, lag=0) is None  # 70 s "old" at the head: the clock is wrong
    assert clock.skew_ms == 70_000 and clock.untrusted == 1
    assert clock.published_ms(930_000, None, lag=500) == 930_000  # deep in a backlog: late indeed
    assert clock.published_ms(930_000, 100_000, lag=0) == 930_000  # within its own (longer) timeout
    assert clock.published_ms(950_000, None, lag=None) == 950_000  # lag unknown: believed
    assert clock.published_ms(1_500_000, None, lag=0) == 1_500_000  # ahead: now, downstream (published_at)
    assert clock.skew_ms == -500_000
    assert clock.published_ms(None, None, lag=0) is None and clock.published_ms(-1, None, lag=0) == -1


async def send_questions(bootstrap: str, topic: str, stamped: list, *, timeout_ms: int = 10_000) -> None:
    """Questions (question_id, record timestamp or None for now) with `timeout_ms`, acked in order."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for qid, stamp in stamped:
            event = {"question_id": qid, "prompt": "Name a colour.", "timeout_ms": timeout_ms,
                     "params": {"max_new_tokens": 4, "temperature": 0.0}}
            await producer.send_and_wait(topic, msgspec.json.encode(event), key=qid.encode(), timestamp_ms=stamp)
    finally:
        await producer.stop()
