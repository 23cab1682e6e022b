"""(d) Kev through Kafka (`--via-kafka`): the embedded broker and an in-process `kev serve` worker with the
same engine options as the in-process Engine, replaying a trace open-loop. A client publishes each
question at its arrival time and reads the deltas and answers topics; TTFT is the first delta with text."""

from __future__ import annotations

import time
from functools import partial

import anyio
import msgspec

from consumers.kafka_client.clients import open_consumer, open_producer
from kev_async.app import serve
from kev_async.bench.load.report import Outcome, SystemRun
from kev_async.bench.load.trace import TraceQuestion, question_event
from kev_async.logs import quieted
from kev_async.runtime.lifecycle import Shutdown
from schemas import AnswerDelta, KevConfig, decode_answer, encode


def run_kafka(model, options, trace: list[TraceQuestion]) -> SystemRun:
    with quieted("warning"):  # the worker logs every answer at info: the table would drown
        outcomes = anyio.run(_kafka_trace, model, kafka_config(options), trace, backend="asyncio")  # aiokafka only
    return SystemRun("kev via kafka", outcomes, {"max_parallel_queries": options.max_parallel_queries})


def kafka_config(options) -> KevConfig:
    """The worker's config carrying the same engine options as the in-process Engine gets."""
    cfg, replace = KevConfig(), msgspec.structs.replace
    kv = replace(cfg.kv_cache, memory_budget_bytes=options.kv_budget_bytes,
                 **({"dtype": options.kv_dtype} if hasattr(options, "kv_dtype") else {}))
    isolation = replace(cfg.isolation, level="shared" if getattr(options, "prefix_caching", False) else "strict")
    return replace(cfg, metrics=replace(cfg.metrics, port=0), kv_cache=kv, isolation=isolation,
                   router=replace(cfg.router, max_parallel_queries=options.max_parallel_queries))


READER_FETCH_WAIT_MS = 250


async def _kafka_trace(model, cfg, trace: list[TraceQuestion]) -> list[Outcome]:
    shutdown = Shutdown(drain_deadline=30)
    async with anyio.create_task_group() as tg:
        running = await tg.start(partial(serve, cfg, shutdown, model=model))
        kafka = msgspec.structs.replace(cfg.kafka, bootstrap_servers=running.bootstrap_servers)
        try:
            # The client stands in for services on other machines: it fetches lazily, so its CPU takes little
            # from the worker's on a small host, and times each delta and answer by its record's timestamp
            # (when the worker sent it), not by when this reader got to it.
            async with open_producer(kafka) as producer, \
                    open_consumer(kafka, kafka.answers_topic, kafka.deltas_topic,
                                  fetch_max_wait_ms=READER_FETCH_WAIT_MS) as consumer:
                outcomes = await _run_trace(producer, consumer, cfg, trace, tg)
        finally:
            shutdown.request("bench finished")
            tg.cancel_scope.cancel()  # the reader loops forever
    return outcomes


async def _run_trace(producer, consumer, cfg, trace: list[TraceQuestion], tg) -> list[Outcome]:
    reader = _KafkaReader(consumer, cfg.kafka.answers_topic)
    tg.start_soon(reader.run)
    # Warm-up: the consumer group's first assignment takes seconds; the trace starts after it.
    warm = TraceQuestion("load-warm-up", 0.0, "Hi", None, 2, "short")
    await _publish(producer, cfg, warm)
    await reader.answered("load-warm-up").wait()
    t0 = time.monotonic()
    for q in trace:
        await anyio.sleep_until(t0 + q.arrival_s)
        await _publish(producer, cfg, q)
    for q in trace:
        await reader.answered(q.qid).wait()
    return [Outcome.of_answer(q.qid, q.arrival_s, t0, reader.answers[q.qid], reader.first.get(q.qid),
                              reader.done[q.qid]) for q in trace]


async def _publish(producer, cfg, q: TraceQuestion) -> None:
    await producer.send(cfg.kafka.questions_topic, encode(question_event(q, stream=True)), key=q.qid.encode())


class _KafkaReader:
    """Records when each question's first delta and its answer reached the client."""

    def __init__(self, consumer, answers_topic: str):
        self.consumer, self.answers_topic = consumer, answers_topic
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.answers: dict = {}
        self._events: dict[str, anyio.Event] = {}

    def answered(self, qid: str) -> anyio.Event:
        return self._events.setdefault(qid, anyio.Event())

    async def run(self) -> None:
        wall_to_monotonic = time.monotonic() - time.time()
        async for record in self.consumer:
            now = record.timestamp / 1000 + wall_to_monotonic  # sent by the worker (CreateTime)
            if record.topic == self.answers_topic:
                answer = decode_answer(record.value)
                self.answers[answer.question_id], self.done[answer.question_id] = answer, now
                self.answered(answer.question_id).set()
            else:
                delta = msgspec.json.decode(record.value, type=AnswerDelta)
                if delta.text:
                    self.first.setdefault(delta.question_id, now)
