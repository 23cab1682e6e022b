"""`kev bench kafka`: the same questions through the bare engine and through Kafka (`kev serve` in
process, embedded broker): the cost of the Kafka path."""

from __future__ import annotations

import argparse
import time
from functools import partial

import anyio
import msgspec

from kev_async.bench.model import bench_model
from kev_async.sample_questions import QUESTIONS
from schemas import DEFAULT_MODEL, KevConfig, MetricsConfig, Params, QuestionEvent

# The engine, the worker and aiokafka are imported inside the functions that use them: `kev --help` imports
# this module.


def register(kinds: argparse._SubParsersAction) -> None:
    kafka = kinds.add_parser(
        "kafka", help="the same questions through the bare engine and through Kafka",
        description="Answer N questions with the engine alone, then publish them to an embedded broker and "
                    "read the answers back through `kev serve` (in process); prints both rates and the ratio.")
    kafka.add_argument("--model", default=DEFAULT_MODEL)
    kafka.add_argument("--questions", type=int, default=64)
    kafka.add_argument("--max-new-tokens", type=int, default=32)
    kafka.add_argument("--threads", type=int, default=None)
    kafka.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    model = bench_model(args)
    cfg = msgspec.structs.replace(KevConfig(), metrics=MetricsConfig(port=0))
    anyio.run(lambda: bench_kafka(cfg, model, num_questions=args.questions, max_new_tokens=args.max_new_tokens),
              backend="asyncio")
    return 0


async def bench_kafka(cfg, model, *, num_questions: int, max_new_tokens: int, out=print) -> dict:
    """The same questions through the bare engine and through Kafka (embedded broker), in one process."""
    from engine import IsolatedBatchPipeline
    from engine.prompt import as_question
    from kev_async.app import serve
    from kev_async.demo import publish_questions, read_answers
    from kev_async.runtime.lifecycle import Shutdown

    texts = (QUESTIONS * 32)[:num_questions]
    pipe = IsolatedBatchPipeline(model, max_batch_size=cfg.router.max_parallel_queries)
    started = time.perf_counter()
    answers = await anyio.to_thread.run_sync(lambda: pipe.run(
        [as_question(t, i) for i, t in enumerate(texts)], max_new_tokens=max_new_tokens, temperature=0.0))
    engine_seconds = time.perf_counter() - started
    engine_tokens = sum(a.usage.completion_tokens for a in answers)
    del pipe
    shutdown = Shutdown(drain_deadline=30)
    questions = [QuestionEvent(question_id=f"bench-{i}", prompt=t, params=Params(max_new_tokens=max_new_tokens))
                 for i, t in enumerate(texts)]
    async with anyio.create_task_group() as tg:
        running = await tg.start(partial(serve, cfg, shutdown, model=model))
        started = time.perf_counter()  # broker and group start-up are excluded: the service is ready
        await publish_questions(cfg, running.bootstrap_servers, questions)
        summary = await read_answers(cfg, running.bootstrap_servers, len(questions), lambda _line: None)
        kafka_seconds = time.perf_counter() - started
        shutdown.request("bench finished")
    rows = {"engine alone (IsolatedBatchPipeline)": (engine_tokens, engine_seconds),
            "through Kafka (kev serve, embedded broker)": (summary["tokens"], kafka_seconds)}
    out(f"model {model.name}, {num_questions} questions, <= {max_new_tokens} new tokens, greedy, "
        f"max_parallel_queries {cfg.router.max_parallel_queries}")
    out("| path | tokens | seconds | tokens/s |\n|---|---:|---:|---:|")
    for name, (tokens, seconds) in rows.items():
        out(f"| {name} | {tokens} | {seconds:.2f} | {tokens / seconds:.1f} |")
    ratio = (summary["tokens"] / kafka_seconds) / (engine_tokens / engine_seconds)
    out(f"through Kafka / engine alone = {ratio:.2f}x")
    return {"ratio": ratio, "rows": rows}
