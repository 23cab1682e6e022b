"""`kev bench kafka`'s two paths over the same questions and arrival schedule: kev's Engine alone, and
`kev serve` workers behind the embedded broker (the first in this process, the others as processes), with
what each path gives a question (`PathRun`: its tokens, its latency, the Kafka path's stage stamps)."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import partial

import anyio
import msgspec

from kev_async.bench.load.report import percentile
from kev_async.sample_questions import QUESTIONS
from schemas import AnswerEvent, KevConfig, Params, QuestionEvent, decode_answer, encode

# The engine, the worker and aiokafka are imported inside the functions that use them: `kev --help` imports
# this module.


@dataclass
class PathRun:
    """One path's answers: per question id, its token ids and its latency from arrival to answer."""

    name: str
    tokens: dict[str, list[int]] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    # Through Kafka only, per question, in seconds: the worker's time outside the engine (fetch, decode,
    # tokenize, then answer encode and produce), the engine's own e2e, and until the bench's lazy reader had
    # it (ack and fetch wait: not counted in the latency).
    stages: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    # Through Kafka only: per question, (published, its answer, sent), for the profile.
    answers: dict[str, tuple[float, AnswerEvent, float]] = field(default_factory=dict)
    errors: int = 0  # answers not ended by stop or length (a deadline missed, an error): through Kafka only

    @property
    def completion_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds

    def percentile(self, q: float) -> float:
        return percentile(list(self.latency_s.values()), q)


# One question answered on each path before its clock starts: through Kafka it waits out the group's first
# assignment (seconds on the embedded broker), which is start-up, not the path's cost per question.
READER_FETCH_WAIT_MS = 250
# --exactly-once: the reader is the downstream service whose latency counts; it asks as often as the gateway does.
EAGER_FETCH_WAIT_MS = 20
WARM_UP = QuestionEvent(question_id="warm-up", prompt="Say hi.", params=Params(max_new_tokens=2, temperature=0.0))


def bench_questions(num_questions: int, max_new_tokens: int) -> list[QuestionEvent]:
    texts = (QUESTIONS * (num_questions // len(QUESTIONS) + 1))[:num_questions]
    return [QuestionEvent(question_id=f"bench-{i}", prompt=text, params=Params(max_new_tokens=max_new_tokens,
                                                                                temperature=0.0))
            for i, text in enumerate(texts)]


def arrival_offsets(count: int, rate: float) -> list[float]:
    """Seconds after the start at which each question arrives: evenly spaced, or all at 0."""
    return [0.0 if math.isinf(rate) else i / rate for i in range(count)]


async def engine_alone(cfg: KevConfig, model, questions: list[QuestionEvent], offsets: list[float]) -> PathRun:
    """kev's Engine with the options a worker builds from `cfg`: each question submitted at its arrival."""
    from engine import Engine, EngineOptions  # torch: not for `kev --help`

    run = PathRun("engine alone (Engine, the worker's options)")
    async with Engine(model, EngineOptions.from_config(cfg, worker="bench")) as engine:
        await engine.wait(await engine.submit(WARM_UP))  # as the Kafka path's, before the clock starts
        start = time.monotonic()

        async def ask(question: QuestionEvent, offset: float) -> None:
            await anyio.sleep_until(start + offset)
            arrived = time.monotonic()
            answer = await engine.wait(await engine.submit(question, arrival=arrived))
            run.latency_s[question.question_id] = time.monotonic() - arrived
            run.tokens[question.question_id] = list(answer.token_ids)

        async with anyio.create_task_group() as tg:
            for question, offset in zip(questions, offsets):
                tg.start_soon(ask, question, offset)
        run.seconds = time.monotonic() - start
    return run


async def through_kafka(cfg: KevConfig, model, questions: list[QuestionEvent], offsets: list[float],
                        workers: int, *, at_reader: bool = False) -> PathRun:
    """`workers` in-process `kev serve`s on a fresh embedded broker (its answers topic starts empty): each question published at its arrival,
    its latency counted until its answer is read back (the broker has acked it by then). `at_reader`: until
    an eager read_committed reader has it (what a downstream service sees), not its record's timestamp."""
    from consumers import embedded_kafka  # aiokafka and the broker: not for `kev --help`
    from kev_async.app import serve
    from kev_async.runtime.lifecycle import Shutdown

    run = PathRun(f"through Kafka ({cfg.kafka.delivery if at_reader else 'kev serve, embedded broker'})")
    async with embedded_kafka(cfg.kafka, cfg.broker) as kafka_cfg:
        served = msgspec.structs.replace(cfg, kafka=kafka_cfg)
        shutdown = Shutdown(drain_deadline=30)
        with _worker_processes(workers - 1, model, kafka_cfg):
            async with anyio.create_task_group() as tg:
                await tg.start(partial(serve, served, shutdown, model=model))
                await _publish_and_read(kafka_cfg, questions, offsets, run, workers, at_reader=at_reader)
                shutdown.request("bench finished")
    return run


@contextlib.contextmanager
def _worker_processes(count: int, model, kafka_cfg):
    """`count` more `kev serve` processes in the bench's group, with this process's torch threads."""
    import torch  # already loaded with the model

    env = {**os.environ, "KEV_METRICS__PORT": "0", "KEV_LOG_LEVEL": "warning",
           "KEV_CORE__THREADS": str(torch.get_num_threads())}
    command = [sys.executable, "-m", "kev_async.cli", "serve", "--model", str(model.path),
               "--bootstrap-servers", kafka_cfg.bootstrap_servers]
    processes = [subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
                 for _ in range(count)]
    try:
        yield processes
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


async def _publish_and_read(kafka_cfg, questions: list[QuestionEvent], offsets: list[float], run: PathRun,
                            workers: int, *, at_reader: bool = False) -> None:
    from consumers.kafka_client.clients import open_consumer, open_producer  # not for `kev --help`

    published: dict[str, float] = {}  # time.time(): the answer record's timestamp is on the same clock
    # The reader stands in for a downstream service on another machine: it fetches lazily, so its own CPU
    # takes little from the worker's, and a question's latency ends at its answer's record timestamp (the
    # worker's producer stamps it when it sends; acked a few ms later), not when this reader gets to it.
    # `at_reader`: an exactly_once answer is there only once its transaction commits, so the latency ends
    # when this reader, read_committed and eager, has it.
    reader = {"fetch_max_wait_ms": EAGER_FETCH_WAIT_MS, "isolation_level": "read_committed"} if at_reader else \
        {"fetch_max_wait_ms": READER_FETCH_WAIT_MS}
    async with open_producer(kafka_cfg, linger_ms=0) as producer, \
            open_consumer(kafka_cfg, kafka_cfg.answers_topic, **reader) as consumer:
        await _read_trace(producer, consumer, kafka_cfg, questions, offsets, run, workers, published, at_reader)


async def _read_trace(producer, consumer, kafka_cfg, questions, offsets, run: PathRun, workers: int,
                      published: dict[str, float], at_reader: bool = False) -> None:
    await _warm_up(producer, consumer, kafka_cfg, workers)
    start, start_wall = time.monotonic(), time.time()
    last_produced = start_wall

    async def publish() -> None:
        for question, offset in zip(questions, offsets):
            await anyio.sleep_until(start + offset)
            published[question.question_id] = time.time()
            await producer.send(kafka_cfg.questions_topic, encode(question), key=question.question_id.encode())

    async with anyio.create_task_group() as tg:
        tg.start_soon(publish)
        while len(run.tokens) < len(questions):
            batch = await consumer.getmany(timeout_ms=100)
            read_at = time.time()
            for record in (r for records in batch.values() for r in records):
                answer = decode_answer(record.value)
                qid = answer.question_id
                if qid in published and qid not in run.tokens:
                    run.tokens[qid] = list(answer.token_ids)
                    run.errors += answer.finish_reason not in ("stop", "length")
                    engine_s, produced = answer.timings.e2e_ms / 1000, record.timestamp / 1000
                    run.latency_s[qid] = (read_at if at_reader else produced) - published[qid]
                    last_produced = max(last_produced, read_at if at_reader else produced)
                    run.stages[qid] = (produced - published[qid] - engine_s, engine_s, read_at - produced)
                    run.answers[qid] = (published[qid], answer, produced)
    run.seconds = last_produced - start_wall  # until the last answer was sent (at_reader: read), as the engine's clock


async def _warm_up(producer, consumer, kafka_cfg, workers: int, timeout_s: float = 300.0) -> None:
    """A warm-up question on every partition, again and again, until `workers` distinct workers have
    answered one: the group has settled (each worker holds partitions) and every model is loaded."""
    answered_by: set[str] = set()
    with anyio.fail_after(timeout_s):
        while len(answered_by) < workers:
            for partition in range(kafka_cfg.partitions):
                await producer.send(kafka_cfg.questions_topic, encode(WARM_UP), partition=partition)
            with anyio.move_on_after(2.0):
                while len(answered_by) < workers:
                    batch = await consumer.getmany(timeout_ms=100)
                    answered_by |= {answer.audit.worker for answer in
                                    (decode_answer(r.value) for records in batch.values() for r in records)
                                    if answer.question_id == WARM_UP.question_id and answer.audit.worker}
