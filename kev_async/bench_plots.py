"""`kev bench scaling` and `kev bench kafka`: throughput against batch size (with a plot), and the cost of
the Kafka path over the bare engine."""

from __future__ import annotations

import time
from functools import partial

import anyio

from engine.bench_questions import QUESTIONS


def plot_scaling(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for name, rates in result["rates"].items():
        ax.plot(result["counts"], rates, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(result["counts"], [str(c) for c in result["counts"]])
    ax.set_xlabel("questions answered together")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"{result['model']}, fp32, CPU, greedy, <= {result['max_new_tokens']} new tokens")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


async def bench_kafka(cfg, model, *, num_questions: int, max_new_tokens: int, out=print) -> dict:
    """The same questions through the bare engine and through Kafka (embedded broker), in one process."""
    from engine import IsolatedBatchPipeline
    from engine.prompt import as_question
    from kev_async.app import serve
    from kev_async.demo import _publish, _read_answers
    from kev_async.lifecycle import Shutdown
    from schemas import Params, QuestionEvent

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
        await _publish(cfg, running.bootstrap_servers, questions)
        summary = await _read_answers(cfg, running.bootstrap_servers, len(questions), lambda _line: None)
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
