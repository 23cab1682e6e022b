"""Kev as a system under load: the async `Engine` in process, and the same engine behind Kafka.

Both replay a trace open-loop: each question is submitted at its arrival time whatever the system is
doing, and its latency counts from that scheduled time, so a late submitter cannot hide queueing.
Also here: the solo greedy reference (one question at a time), cached on disk per question.
"""

from __future__ import annotations

import hashlib
import json
import time
from functools import partial
from pathlib import Path

import anyio

from kev_async.bench.load_report import Outcome, Reference, SystemRun
from kev_async.bench.load_trace import TraceQuestion


def question_event(q: TraceQuestion, *, stream: bool = False):
    from schemas import Params, QuestionEvent

    return QuestionEvent(question_id=q.qid, prompt=q.prompt, system=q.system, stream=stream,
                         params=Params(max_new_tokens=q.max_new_tokens, temperature=0.0))


def _outcome(q: TraceQuestion, t0: float, answer, first: float | None, done: float) -> Outcome:
    return Outcome(q.qid, q.arrival_s, (first or done) - t0, done - t0, answer.usage.completion_tokens,
                   list(answer.token_ids), answer.text, answer.finish_reason,
                   answer.error.code if answer.error else None)


# -- (a) Kev's Engine ----------------------------------------------------------------------------------

def run_engine(model, options, trace: list[TraceQuestion]) -> SystemRun:
    outcomes = anyio.run(_engine_trace, model, options, trace)
    return SystemRun("kev engine", outcomes, {"max_batch_size": options.max_batch_size})


async def _engine_trace(model, options, trace: list[TraceQuestion]) -> list[Outcome]:
    from engine import Engine

    done: dict[str, Outcome] = {}
    async with Engine(model, options) as engine:
        await engine.wait(await engine.submit({"prompt": "Hi", "params": {"max_new_tokens": 2}}))  # warm-up
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            for q in trace:
                tg.start_soon(_engine_question, engine, q, t0, done)
    return [done[q.qid] for q in trace]


async def _engine_question(engine, q: TraceQuestion, t0: float, done: dict) -> None:
    arrival = t0 + q.arrival_s
    await anyio.sleep_until(arrival)  # anyio's clock is time.monotonic() on asyncio and trio
    handle = await engine.submit(question_event(q), arrival=arrival)
    first = None
    async for delta in engine.stream(handle):
        if first is None and delta.text:  # what a streaming client sees first
            first = time.monotonic()
    done[q.qid] = _outcome(q, t0, handle.answer, first, time.monotonic())


# -- (d) Kev through Kafka -----------------------------------------------------------------------------

def run_kafka(model, options, trace: list[TraceQuestion]) -> SystemRun:
    from kev_async.logs import quieted

    with quieted("warning"):  # the worker logs every answer at info: the table would drown
        outcomes = anyio.run(_kafka_trace, model, kafka_config(options), trace, backend="asyncio")  # aiokafka only
    return SystemRun("kev via kafka", outcomes, {"max_batch_size": options.max_batch_size})


def kafka_config(options):
    """The worker's config carrying the same engine options as the in-process Engine gets."""
    import msgspec

    from schemas import KevConfig

    cfg, replace = KevConfig(), msgspec.structs.replace
    kv = replace(cfg.kv_cache, memory_budget_bytes=options.kv_budget_bytes,
                 **({"dtype": options.kv_dtype} if hasattr(options, "kv_dtype") else {}))
    isolation = replace(cfg.isolation, level="shared" if getattr(options, "prefix_caching", False) else "strict")
    return replace(cfg, metrics=replace(cfg.metrics, port=0), kv_cache=kv, isolation=isolation,
                   router=replace(cfg.router, max_parallel_queries=options.max_batch_size))


async def _kafka_trace(model, cfg, trace: list[TraceQuestion]) -> list[Outcome]:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from kev_async.app import serve
    from kev_async.runtime.lifecycle import Shutdown

    shutdown = Shutdown(drain_deadline=30)
    async with anyio.create_task_group() as tg:
        running = await tg.start(partial(serve, cfg, shutdown, model=model))
        servers = running.bootstrap_servers
        producer = AIOKafkaProducer(bootstrap_servers=servers, acks="all")
        consumer = AIOKafkaConsumer(cfg.kafka.answers_topic, cfg.kafka.deltas_topic, bootstrap_servers=servers,
                                    group_id=None, auto_offset_reset="earliest", enable_auto_commit=False,
                                    fetch_max_wait_ms=10)  # a client that reads as soon as an answer lands
        await producer.start()
        await consumer.start()
        try:
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
            outcomes = [_outcome(q, t0, reader.answers[q.qid], reader.first.get(q.qid), reader.done[q.qid])
                        for q in trace]
        finally:
            await producer.stop()
            await consumer.stop()
            shutdown.request("bench finished")
            tg.cancel_scope.cancel()  # the reader loops forever
    return outcomes


async def _publish(producer, cfg, q: TraceQuestion) -> None:
    from schemas import encode

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
        import msgspec

        from schemas import AnswerDelta, decode_answer

        async for record in self.consumer:
            now = time.monotonic()
            if record.topic == self.answers_topic:
                answer = decode_answer(record.value)
                self.answers[answer.question_id], self.done[answer.question_id] = answer, now
                self.answered(answer.question_id).set()
            else:
                delta = msgspec.json.decode(record.value, type=AnswerDelta)
                if delta.text:
                    self.first.setdefault(delta.question_id, now)


# -- the solo greedy reference -------------------------------------------------------------------------

def solo_reference(model, options, trace: list[TraceQuestion], cache_path: Path | None, out=print) -> Reference:
    """Each question answered alone by Kev (batch size 1), greedy; answers already in the cache are reused."""
    import dataclasses

    from engine import IsolatedBatchPipeline

    cache = json.loads(cache_path.read_text()) if cache_path and cache_path.exists() else {}
    keys = {q.qid: _reference_key(model, options, q) for q in trace}
    missing = [q for q in trace if keys[q.qid] not in cache]
    if missing:
        out(f"solo reference: answering {len(missing)} questions one at a time "
            f"({len(trace) - len(missing)} cached)")
        solo = dataclasses.replace(options, batch_window_ms=0.0)
        pipe = IsolatedBatchPipeline(model, max_batch_size=1, options=solo)
        for i, q in enumerate(missing):
            answer = pipe.run([question_event(q)])[0]
            cache[keys[q.qid]] = {"token_ids": list(answer.token_ids), "text": answer.text}
            if cache_path and (i % 8 == 7 or i == len(missing) - 1):  # an interrupted run keeps what it did
                cache_path.parent.mkdir(parents=True, exist_ok=True)
                cache_path.write_text(json.dumps(cache))
    return Reference({q.qid: cache[keys[q.qid]]["token_ids"] for q in trace},
                     {q.qid: cache[keys[q.qid]]["text"] for q in trace})


def _reference_key(model, options, q: TraceQuestion) -> str:
    """Everything that decides a solo greedy answer: weights, precision, prompt, budget."""
    knobs = {k: str(getattr(options, k)) for k in ("deterministic", "kv_dtype") if hasattr(options, k)}
    text = json.dumps([str(model.path.resolve()), str(model.dtype), getattr(model, "weight_format", "full"), knobs,
                       q.system, q.prompt, q.max_new_tokens])
    return hashlib.sha256(text.encode()).hexdigest()[:32]
