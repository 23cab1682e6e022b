"""`kev bench kafka`: the same questions, on the same arrival schedule, through the engine alone and
through Kafka (`kev serve` workers in this process, the embedded broker): the cost of the Kafka path in
throughput, in latency per question, and whether the answers and their token counts agree.

`--exactly-once` compares the two delivery modes instead: the same questions through Kafka with
at_least_once and with exactly_once, in pairs of alternating order, each on a fresh broker, read by a
read_committed reader that polls eagerly, as a downstream service would: goodput (tokens/s until the
reader has the last answer) and end-to-end latency (publish -> the reader has the answer)."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import partial

import anyio
import msgspec

from kev_async.bench.kafka_profile import STAGES, StageLog, caught_stages, draw_timeline, stage_table
from kev_async.bench.kafka_profile import timeline as timeline_of
from kev_async.bench.load.report import percentile
from kev_async.bench.machine import cpu_name
from kev_async.bench.model import bench_model
from kev_async.sample_questions import QUESTIONS
from schemas import (DEFAULT_MODEL, AnswerEvent, KevConfig, MetricsConfig, Params, QuestionEvent, decode_answer,
                     encode)

# The engine, the worker and aiokafka are imported inside the functions that use them: `kev --help` imports
# this module.


def register(kinds: argparse._SubParsersAction) -> None:
    kafka = kinds.add_parser(
        "kafka", help="the same questions through the engine alone and through Kafka",
        description="Answer N questions with the engine alone (kev's Engine, the worker's options), then publish "
                    "the same questions on the same schedule to an embedded broker and read the answers back "
                    "from `kev serve` workers in this process. Prints tokens/s of both and their ratio, the "
                    "latency each path gives a question (arrival -> answer sent), Kafka's own time per question (publish "
                    "-> the worker's engine, engine done -> answer sent), and "
                    "whether every answer and its token count agree.")
    kafka.add_argument("--model", default=DEFAULT_MODEL, help="a built-in name, an HF directory or a .gguf file")
    kafka.add_argument("--questions", type=int, default=64, help="questions per path (default: 64)")
    kafka.add_argument("--max-new-tokens", type=int, default=32, help="per question, greedy (default: 32)")
    kafka.add_argument("--rate", type=float, default=math.inf,
                       help="arrivals per second, evenly spaced (default: inf, all at once)")
    kafka.add_argument("--workers", type=int, default=1,
                       help="`kev serve` workers in one group: the first in this process, the others as processes "
                            "(one engine per device and process); the clock starts once each has answered")
    kafka.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    kafka.add_argument("--profile", action="store_true",
                       help="also print where each question's time went through Kafka, stage by stage (fetch, "
                            "intake, tokenize, admission, prefill, decode, hand-off, send, ack, commit), from the "
                            "in-process worker's stamps, and draw the run as a timeline")
    kafka.add_argument("--timeline", default=".cache/bench/kafka-timeline.png",
                       help="with --profile: where to draw the timeline (default: %(default)s)")
    kafka.add_argument("--exactly-once", action="store_true",
                       help="instead: kafka.delivery at_least_once against exactly_once, through Kafka, --repeats "
                            "pairs in alternating order, read by an eager read_committed reader: goodput and end-to-end "
                            "latency of each, their ratios, the medians")
    kafka.add_argument("--repeats", type=int, default=3, help="with --exactly-once: pairs of runs (default: 3)")
    kafka.add_argument("--transaction-ms", type=int, default=None,
                       help="with --exactly-once: kafka.transaction_ms (default: the config's)")
    kafka.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    if args.questions < 1 or args.workers < 1 or args.rate <= 0:
        raise SystemExit("kev bench kafka: --questions, --workers and --rate must be positive")
    if args.repeats < 1 or (args.transaction_ms is not None and not 1 <= args.transaction_ms <= 60_000):
        raise SystemExit("kev bench kafka: --repeats must be positive and --transaction-ms 1 to 60000")
    model = bench_model(args)
    cfg = msgspec.structs.replace(KevConfig(), metrics=MetricsConfig(port=0))
    if args.exactly_once:
        if args.transaction_ms is not None:
            cfg = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka,
                                                                              transaction_ms=args.transaction_ms))
        anyio.run(lambda: compare_delivery(cfg, model, num_questions=args.questions, max_new_tokens=args.max_new_tokens,
                                           rate=args.rate, repeats=args.repeats), backend="asyncio")
        return 0
    anyio.run(lambda: bench_kafka(cfg, model, num_questions=args.questions, max_new_tokens=args.max_new_tokens,
                                  rate=args.rate, workers=args.workers,
                                  timeline=args.timeline if args.profile else None), backend="asyncio")
    return 0


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


async def bench_kafka(cfg: KevConfig, model, *, num_questions: int, max_new_tokens: int, rate: float = math.inf,
                      workers: int = 1, timeline: str | None = None, out=print) -> dict:
    """Both paths over the same questions and schedule, in one process; prints a table, returns the figures.
    With `timeline` (a PNG path), also the Kafka path's stage profile, drawn there."""
    questions = bench_questions(num_questions, max_new_tokens)
    offsets = arrival_offsets(num_questions, rate)
    engine = await engine_alone(cfg, model, questions, offsets)
    with caught_stages() if timeline else contextlib.nullcontext() as stages:
        kafka = await through_kafka(cfg, model, questions, offsets, workers)
    result = report(cfg, model, engine, kafka, rate=rate, workers=workers, max_new_tokens=max_new_tokens, out=out)
    if stages is not None:
        result["profile"] = profile(stages, kafka, cfg.kafka.questions_topic, timeline,
                                    f"{model.name}, {len(questions)} questions "
                                    f"({'all at once' if math.isinf(rate) else f'{rate:g}/s'}) through Kafka", out)
    return result


def profile(stages: StageLog, kafka: PathRun, questions_topic: str, drawing: str, title: str, out=print) -> dict:
    """Print the stage table of the questions the in-process worker answered, and draw their timeline."""
    lines = [line for qid, (published, answer, sent) in kafka.answers.items()
             if (line := timeline_of(stages, qid, published, answer, sent, questions_topic)) is not None]
    if not lines:
        out("profile: no question was answered by the in-process worker")
        return {"questions": 0}
    out(f"where the time went, {len(lines)} questions answered by the in-process worker (wall clock):")
    for row in stage_table(lines):
        out(row)
    path = draw_timeline(lines, drawing, title)
    out(f"timeline: {path}")
    return {"questions": len(lines), "timeline": str(path),
            "stages": {name: [t.durations()[i] for t in lines] for i, (name, _, _) in enumerate(STAGES)}}


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


async def compare_delivery(cfg: KevConfig, model, *, num_questions: int, max_new_tokens: int,
                           rate: float = math.inf, repeats: int = 3, out=print) -> dict:
    """at_least_once against exactly_once through Kafka, `repeats` pairs in alternating order, each on a fresh
    broker and read by an eager read_committed reader; prints each run, the pairs' ratios and their medians."""
    questions = bench_questions(num_questions, max_new_tokens)
    offsets = arrival_offsets(num_questions, rate)
    runs: dict[str, list[PathRun]] = {"at_least_once": [], "exactly_once": []}
    for pair in range(repeats):
        for delivery in (("at_least_once", "exactly_once") if pair % 2 == 0 else ("exactly_once", "at_least_once")):
            served = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, delivery=delivery))
            runs[delivery].append(await through_kafka(served, model, questions, offsets, 1, at_reader=True))
    arrivals = "all at once" if math.isinf(rate) else f"{rate:g}/s"
    out(f"{cpu_name()}, {os.cpu_count()} cores; model {model.name}, {num_questions} questions ({arrivals}), <= {max_new_tokens} new tokens, "
        f"greedy; kafka.transaction_ms {cfg.kafka.transaction_ms}, commit_every {cfg.kafka.commit_every}; "
        f"{repeats} pairs, alternating order")
    return {**delivery_report(runs["at_least_once"], runs["exactly_once"], out=out), "runs": runs}


def delivery_report(least: list[PathRun], exactly: list[PathRun], *, out=print) -> dict:
    """The runs of each mode pair by pair, exactly_once over at_least_once per pair (goodput, e2e p50 and
    p99 at the reader) and the medians of those ratios against the targets; a run with an error answer (a
    deadline missed on a starved host) is named, since its figures are not the delivery's cost."""
    out("| pair | delivery | tokens | errors | seconds | goodput tokens/s | e2e p50 ms | e2e p99 ms |\n"
        "|---:|---|---:|---:|---:|---:|---:|---:|")
    for pair, both in enumerate(zip(least, exactly)):
        for delivery, run in zip(("at_least_once", "exactly_once"), both):
            out(f"| {pair} | {delivery} | {run.completion_tokens} | {run.errors} | {run.seconds:.2f} | "
                f"{run.tokens_per_s:.1f} | {run.percentile(50) * 1000:.0f} | {run.percentile(99) * 1000:.0f} |")
    ratios = {"goodput": [e.tokens_per_s / a.tokens_per_s for a, e in zip(least, exactly)],
              "e2e_p50": [e.percentile(50) / a.percentile(50) for a, e in zip(least, exactly)],
              "e2e_p99": [e.percentile(99) / a.percentile(99) for a, e in zip(least, exactly)]}
    medians = {name: statistics.median(values) for name, values in ratios.items()}
    out("exactly_once / at_least_once per pair: "
        + "; ".join(f"{name.replace('_', ' ')} {', '.join(f'{v:.3f}' for v in values)}"
                    for name, values in ratios.items()))
    out(f"medians: goodput {medians['goodput']:.3f}x (target >= 0.95), e2e p50 {medians['e2e_p50']:.3f}x, "
        f"e2e p99 {medians['e2e_p99']:.3f}x (target <= 1.3)")
    every = least + exactly
    same = sum(all(run.tokens.get(q) == tokens for run in every) for q, tokens in every[0].tokens.items())
    out(f"answers identical in every run: {same}/{len(every[0].tokens)}")
    errored = [f"{delivery} pair {pair}" for delivery, runs in (("at_least_once", least), ("exactly_once", exactly))
               for pair, run in enumerate(runs) if run.errors]
    if errored:
        out(f"runs with error answers (not the delivery's cost; rerun on a quieter host): {', '.join(errored)}")
    return {**medians, "pairs": ratios, "identical": same, "errored": errored}


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
    from consumers.clients import open_consumer, open_producer  # not for `kev --help`

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


def report(cfg: KevConfig, model, engine: PathRun, kafka: PathRun, *, rate: float, workers: int,
           max_new_tokens: int, out=print) -> dict:
    same = sum(engine.tokens[q] == kafka.tokens.get(q) for q in engine.tokens)
    ratio = kafka.tokens_per_s / engine.tokens_per_s
    outside, inside, reader = (list(part) for part in zip(*kafka.stages.values()))
    own = {q: percentile(outside, q) for q in (50, 99)}
    arrivals = "all at once" if math.isinf(rate) else f"{rate:g}/s"
    out(f"model {model.name}, {len(engine.tokens)} questions ({arrivals}), <= {max_new_tokens} new tokens, greedy, "
        f"max_parallel_queries {cfg.router.max_parallel_queries}, {workers} worker(s)")
    out("| path | tokens | seconds | tokens/s | latency p50 ms | latency p99 ms |\n|---|---:|---:|---:|---:|---:|")
    for run in (engine, kafka):
        out(f"| {run.name} | {run.completion_tokens} | {run.seconds:.2f} | {run.tokens_per_s:.1f} | "
            f"{run.percentile(50) * 1000:.0f} | {run.percentile(99) * 1000:.0f} |")
    out(f"through Kafka / engine alone = {ratio:.2f}x")
    out(f"Kafka's own time per question (publish -> the worker's engine, engine done -> answer sent): "
        f"p50 {own[50] * 1000:.0f} ms, p99 {own[99] * 1000:.0f} ms; in the engine p50 "
        f"{statistics.median(inside) * 1000:.0f} ms; then read by the bench (not counted) p50 "
        f"{statistics.median(reader) * 1000:.0f} ms")
    out(f"answers identical: {same}/{len(engine.tokens)}; completion tokens "
        f"{'equal' if engine.completion_tokens == kafka.completion_tokens else 'DIFFER'} "
        f"({engine.completion_tokens} and {kafka.completion_tokens})")
    return {"ratio": ratio, "kafka_own_p50_s": own[50], "kafka_own_p99_s": own[99], "identical": same,
            "engine": engine, "kafka": kafka}
