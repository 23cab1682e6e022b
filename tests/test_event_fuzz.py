"""Fuzzed question events through a real worker: every record ends in its one outcome, the worker is
never stuck, and no KV block is left held.

Hypothesis builds batches of events (plausible questions with odd fields and values, broken JSON
trees, raw bytes); each batch goes onto the questions topic of a live worker (tiny random-weight
Llama, the embedded broker). What `decode_question` says of each record predicts its outcome: a dead
letter naming its offset, or exactly one answer for its question_id (an error answer when invalid).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator

import anyio
import msgspec
import pytest
from aiokafka import AIOKafkaProducer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.register_assert_rewrite("kafka_fixtures", "gateway_fixtures")
from gateway_fixtures import LiveStack, free_port, live_stack, replace, stack_config  # noqa: E402
from kafka_fixtures import kafka_config, read_topic  # noqa: E402
from polling import eventually_sync  # noqa: E402

from consumers import create_topics, topic_plan  # noqa: E402
from consumers.messages import HEADER_DLQ_OFFSET, HEADER_DLQ_PARTITION  # noqa: E402
from schemas import InvalidQuestion, UndecodableEvent, decode_answer, decode_question  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures", "gateway_fixtures"]
pytestmark = pytest.mark.kafka

_ids = itertools.count()
_leaf = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=10)
_json = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                         max_size=3), max_leaves=8)
_params = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.integers(1, 6) | st.integers(-2, 0) | _json, "temperature": st.floats(-1, 3) | _json,
    "top_p": st.floats(0, 1.5), "top_k": st.integers(-1, 50), "seed": st.integers(-1, 2**64),
    "stop": st.lists(st.text(max_size=4), max_size=3) | _json, "repetition_penalty": st.floats(0, 3)})
_fields = st.fixed_dictionaries({}, optional={
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                                "content": st.text(max_size=20)}), max_size=3) | _json,
    "system": st.text(max_size=20) | _json, "request_id": st.text(max_size=300) | _json,
    "tenant": st.text(max_size=20), "cache_salt": st.text(max_size=20), "priority": st.integers(-200, 200),
    "timeout_ms": st.integers(-5, 120_000), "stream": st.booleans() | _json, "adapter": st.text(max_size=8),
    "reply_topic": st.text(max_size=30), "schema": st.integers(0, 3) | _json, "extra": _json})


_good_params = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.integers(1, 6), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 50), "seed": st.integers(0, 2**32), "stop": st.lists(st.text(min_size=1, max_size=4),
                                                                                 max_size=2)})
_good_fields = st.fixed_dictionaries({}, optional={
    "system": st.text(max_size=20), "request_id": st.text(max_size=300), "tenant": st.text(max_size=20),
    "cache_salt": st.text(max_size=20), "priority": st.integers(-100, 100), "timeout_ms": st.integers(1, 120_000),
    "stream": st.booleans(), "reply_topic": st.text(max_size=30), "adapter": st.none()})


@st.composite
def _question(draw) -> bytes:
    """Mostly questions a worker runs (odd but legal values), else anything in a question's shape."""
    qid = f"fz-{next(_ids)}"
    if draw(st.integers(0, 2)):
        body = {"question_id": qid, "prompt": "Q: " + draw(st.text(max_size=40)), "params": draw(_good_params),
                **draw(_good_fields)}
    else:
        body = {"question_id": qid, "prompt": draw(st.text(max_size=40) | _json), "params": draw(_params | _json),
                **draw(_fields)}
        if draw(st.booleans()):
            body.pop("prompt")
    return msgspec.json.encode(body)


_event = st.one_of(_question(), _question(), _question(), st.binary(max_size=40),
                   _json.map(msgspec.json.encode))
_batch = st.lists(_event, min_size=4, max_size=12)


@pytest.fixture(scope="module")
def stack(kafka_broker, tiny_model) -> Iterator[LiveStack]:
    cfg = stack_config(kafka_config(kafka_broker, partitions=2), metrics_port=free_port())
    cfg = replace(cfg, sampling={"max_new_tokens": 4})
    anyio.run(create_topics, cfg.kafka, topic_plan(cfg.kafka), backend="asyncio")
    with live_stack(cfg, tiny_model) as running:
        yield running


async def _publish(bootstrap: str, topic: str, values: list[bytes]) -> list[tuple[int, int]]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        futures = [await producer.send(topic, value) for value in values]
        return [((meta := await future).partition, meta.offset) for future in futures]
    finally:
        await producer.stop()


def _expected(value: bytes) -> str | None:
    """The question_id that must get one answer, or None for a dead letter."""
    try:
        return decode_question(value).question_id
    except InvalidQuestion as invalid:
        return invalid.question_id
    except UndecodableEvent:
        return None


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(batch=_batch)
def test_fuzzed_events_each_end_in_one_outcome(stack, batch):
    kafka = stack.cfg.kafka
    positions = anyio.run(_publish, kafka.bootstrap_servers, kafka.questions_topic, batch, backend="asyncio")
    expected = [_expected(value) for value in batch]
    answers_wanted = {qid for qid in expected if qid is not None}
    dead_wanted = {pos for pos, qid in zip(positions, expected) if qid is None}

    # Both topics hold every earlier batch too: read until this batch's outcomes are all there.
    seen: dict = {"counts": Counter(), "dead": set()}

    def every_outcome_out() -> bool:
        answers = [decode_answer(r.value) for r in anyio.run(_read_all, kafka.bootstrap_servers,
                                                             kafka.answers_topic, backend="asyncio")]
        seen["dead"] = {(int(h[HEADER_DLQ_PARTITION]), int(h[HEADER_DLQ_OFFSET]))
                        for h in (dict(r.headers) for r in anyio.run(_read_all, kafka.bootstrap_servers,
                                                                      kafka.dlq_topic, backend="asyncio"))}
        seen["counts"] = Counter(a.question_id for a in answers)
        return answers_wanted <= set(seen["counts"]) and dead_wanted <= seen["dead"]

    eventually_sync(every_outcome_out, timeout=60, every=0.3,
                    what=lambda: (f"missing answers {answers_wanted - set(seen['counts'])}, "
                                  f"dead letters {dead_wanted - seen['dead']}"))
    counts = seen["counts"]
    assert all(counts[qid] == 1 for qid in answers_wanted), {q: counts[q] for q in answers_wanted}
    assert not dead_wanted & {pos for pos, qid in zip(positions, expected) if qid is not None}

    # Not stuck, nothing leaked: with every answer out, every KV block is free again.
    eventually_sync(lambda: stack.kv_blocks_used() == 0, timeout=20, every=0.2,
                    what=lambda: f"{stack.kv_blocks_used()} KV blocks held with no question in flight")


async def _read_all(bootstrap: str, topic: str) -> list:
    return await read_topic(bootstrap, topic, 10**9, timeout=1.0, linger=0.0)
