"""`kev bench kafka`: the same questions, on the same arrival schedule, through the engine alone and
through Kafka (`kev serve` workers in this process, the embedded broker): the cost of the Kafka path in
throughput, in latency per question, and whether the answers and their token counts agree.

`--exactly-once` compares the two delivery modes instead: the same questions through Kafka with
at_least_once and with exactly_once, in pairs of alternating order, each on a fresh broker, read by a
read_committed reader that polls eagerly, as a downstream service would: goodput (tokens/s until the
reader has the last answer) and end-to-end latency (publish -> the reader has the answer).

The paths are kafka_paths.py, the delivery comparison kafka_delivery.py, the stage profile kafka_profile.py."""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics

import anyio
import msgspec

from kev_async.drawing import matplotlib_missing
from kev_async.bench.kafka_delivery import compare_delivery
from kev_async.bench.kafka_paths import PathRun, arrival_offsets, bench_questions, engine_alone, through_kafka
from kev_async.bench.kafka_profile import STAGES, StageLog, caught_stages, draw_timeline, stage_table
from kev_async.bench.kafka_profile import timeline as timeline_of
from kev_async.bench.load.report import percentile
from kev_async.bench.model import bench_model
from schemas import DEFAULT_MODEL, KevConfig, MetricsConfig

# The paths (kafka_paths.py) and the delivery comparison (kafka_delivery.py) import the engine, the worker and
# aiokafka inside their functions: `kev --help` imports this module.


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
    if args.profile and not args.exactly_once and matplotlib_missing("kev bench kafka", "leave out --profile"):
        return 2
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
