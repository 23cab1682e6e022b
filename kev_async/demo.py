"""`kev demo`: the whole path on embedded defaults — broker, worker, producer and an answers reader.

It publishes the mixed sample questions plus two bad events (one undecodable, one invalid) to
kev.questions, prints every answer as it arrives on kev.answers, counts the dead letter, and stops
the worker gracefully once everything is answered. The worker serves its metrics as `kev serve` does
(metrics.port; the demo says where, for `kev top`). With `http=True` (`kev demo --http`) it then
starts the OpenAI-compatible gateway, prints a `curl` line that works, and serves until Ctrl-C.
"""

from __future__ import annotations

import time
from functools import partial

import anyio
import msgspec

from consumers.kafka_client.clients import open_consumer, open_producer
from consumers.kafka_client.record_guard import unreadable
from kev_async.app import serve
from kev_async.gateway.demo import demo_over_http
from kev_async.gateway.exposure import with_session_trust_key
from kev_async.observe.dashboard import DEFAULT_URL
from kev_async.runtime.lifecycle import Shutdown
from kev_async.sample_questions import QUESTIONS
from schemas import KafkaConfig, KevConfig, MetricsConfig, Params, QuestionEvent, decode_answer, encode

BAD_EVENTS = [
    b"this is not JSON",  # undecodable: goes to the dead-letter topic unchanged
    b'{"question_id": "bad-temperature", "prompt": "hi", "params": {"temperature": -1}}',  # error answer
]


async def run_demo(cfg: KevConfig, shutdown: Shutdown, *, num_questions: int, max_new_tokens: int,
                   http: bool = False, out=print, task_status=anyio.TASK_STATUS_IGNORED) -> dict:
    questions = [QuestionEvent(question_id=f"demo-{i}", prompt=text, params=Params(max_new_tokens=max_new_tokens))
                 for i, text in enumerate((QUESTIONS * 8)[:num_questions])]
    if http:  # the gateway signs its questions; the worker must know the key
        cfg = with_session_trust_key(cfg)
    async with anyio.create_task_group() as tg:
        running = await tg.start(partial(serve, cfg, shutdown))
        out(f"kev: worker {running.worker} serving {running.model} from {running.bootstrap_servers}")
        if cfg.metrics.port:
            out(_metrics_line(cfg.metrics))
        task_status.started(running)
        started = time.perf_counter()
        await _publish(cfg, running.bootstrap_servers, questions)
        # Generous, but bounded: a lost answer must fail the demo, not hang it.
        with anyio.fail_after(60 + 10 * len(questions)):
            summary = await _read_answers(cfg, running.bootstrap_servers, len(questions) + 1, out)
        summary["seconds"] = time.perf_counter() - started
        summary["dead_letters"] = await _count(cfg.kafka.dlq_topic, running.bootstrap_servers, 1)
        out(f"\n{_count_of(summary['answers'], 'answer')} ({_count_of(summary['errors'], 'error answer')}), "
            f"{_count_of(summary['dead_letters'], 'dead letter')}, {summary['tokens']} tokens in {summary['seconds']:.1f}s "
            f"({summary['tokens'] / summary['seconds']:.1f} tokens/s end to end, through Kafka)")
        if http:
            await demo_over_http(cfg, running.bootstrap_servers, shutdown, max_new_tokens=max_new_tokens, out=out)
        else:
            shutdown.request("demo finished")
    return summary


async def _publish(cfg: KevConfig, servers: str, questions: list[QuestionEvent]) -> None:
    """`questions`, then BAD_EVENTS, to the questions topic; all acked by the broker on return."""
    async with open_producer(_kafka(cfg, servers)) as producer:
        for question in questions:
            await producer.send(cfg.kafka.questions_topic, encode(question), key=question.question_id.encode())
        for raw in BAD_EVENTS:
            await producer.send(cfg.kafka.questions_topic, raw)
        await producer.flush()


async def _read_answers(cfg: KevConfig, servers: str, expected: int, out) -> dict:
    """The answers topic from its start until `expected` answers: each printed through `out`, and counted.
    Read read_committed, as a downstream service should: with exactly_once delivery each answer shows once."""
    summary = {"answers": 0, "errors": 0, "tokens": 0}
    async with open_consumer(_kafka(cfg, servers), cfg.kafka.answers_topic,
                             isolation_level="read_committed") as consumer:
        async for record in consumer:
            if unreadable(record):
                continue
            answer = decode_answer(record.value)
            summary["answers"] += 1
            summary["errors"] += answer.finish_reason == "error"
            summary["tokens"] += answer.usage.completion_tokens
            out(_line(answer))
            if summary["answers"] >= expected:
                return summary
    return summary


async def _count(topic: str, servers: str, expected: int, timeout: float = 10.0) -> int:
    seen = 0
    async with open_consumer(KafkaConfig(bootstrap_servers=servers), topic) as consumer:
        with anyio.move_on_after(timeout):
            async for _record in consumer:
                seen += 1
                if seen >= expected:
                    break
    return seen


def _kafka(cfg: KevConfig, servers: str) -> KafkaConfig:
    return msgspec.structs.replace(cfg.kafka, bootstrap_servers=servers)


def _metrics_line(metrics: MetricsConfig) -> str:
    host = f"[{metrics.host}]" if ":" in metrics.host else metrics.host
    url = f"http://{host}:{metrics.port}/metrics"
    watch = "kev top" if url == DEFAULT_URL else f"kev top --url {url}"
    return f"kev: worker metrics on {url} (watch them: {watch})"


def _line(answer) -> str:
    if answer.error:
        return f"[{answer.question_id}] error {answer.error.code}: {answer.error.message}"
    text = answer.text.replace("\n", " ")
    text = text if len(text) <= 90 else text[:87] + "..."
    return (f"[{answer.question_id}] {answer.finish_reason:6} {answer.usage.completion_tokens:3} tokens "
            f"{answer.timings.e2e_ms / 1000:5.1f}s  {text}")


def _count_of(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
