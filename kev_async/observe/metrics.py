"""Prometheus metrics and the canonical answer log line, served on `metrics.port` (0 = off).

    metrics = Metrics(log_prompts=cfg.logging.log_prompts)
    metrics.watch_mailboxes(questions, answers)
    metrics.watch_kafka(worker)
    engine_factory = lambda: metrics.watch_engine(Engine(model, options))
    wrap = metrics.wrap(Outbound)           # every answer is observed, then wrapped as before
    async with metrics.endpoint(cfg.metrics.port):
        ...                                 # GET http://127.0.0.1:PORT/metrics, GET /health

Answer-level histograms and counters are updated as each answer leaves the engine actor. Everything
that lives in other objects (the scheduler's queues, the KV pool, the mailboxes, the Kafka worker) is
read when Prometheus scrapes, by a collector: no polling task, no thread. The endpoint (uvicorn, on the
worker's asyncio loop: observe/metrics_endpoint.py) also answers GET /health for a liveness probe:
200 {"status":"ok"} while the watched Kafka loop is consuming, 503 otherwise; the body says nothing more.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, get_args

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from engine.step_hook import BatchSizes
from kev_async.observe.live_collector import LiveCollector
from kev_async.observe.metrics_endpoint import MetricsRoutes, serve_metrics
from kev_async.runtime.actors import Mailbox
from schemas import AnswerEvent, FinishReason

log = structlog.get_logger("kev.metrics")
answers_log = structlog.get_logger("kev.answers")

# Seconds. LLM latencies span milliseconds (a decode step) to minutes (a long answer under load).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class Metrics:
    """One registry of Kev's metrics; see the module docstring for the wiring."""

    def __init__(self, *, log_prompts: bool = False) -> None:
        self.log_prompts = log_prompts
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kev_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("kev_inter_token_latency_seconds", "Mean time between generated tokens, per answer.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("kev_end_to_end_latency_seconds", "Arrival to the answer's last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("kev_queue_time_seconds", "Arrival to admission into the running batch.",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.batch_size = Histogram("kev_step_batch_size", "Questions in one packed forward pass.",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.answers = Counter("kev_answers", "Answers sent, by finish reason.", ["finish_reason"], registry=r)
        for reason in get_args(FinishReason):  # every series exists from the start, so rate() sees the first
            self.answers.labels(reason)
        self.errors = Counter("kev_errors", "Error answers, by error code.", ["code"], registry=r)
        self.prompt_tokens = Counter("kev_prompt_tokens", "Prompt tokens of answered questions.", registry=r)
        self.cached_prompt_tokens = Counter("kev_cached_prompt_tokens", "Prompt tokens of answered questions "
                                            "read from the prefix cache.", registry=r)
        self.unknown_fields = Counter("kev_unknown_fields", "Keys of answered questions Kev did not know "
                                      "(listed in their audit.ignored_fields; intake.unknown_fields: report).",
                                      registry=r)
        self.incomplete = Counter("kev_incomplete_answers", "Answers with a response_format that ended before "
                                  "their grammar was complete (max_new_tokens, a stop string).", registry=r)
        self.live = LiveCollector()
        r.register(self.live)

    # -- what is read at scrape time -----------------------------------------------------------------
    def watch_engine(self, engine):
        """Read `engine`'s scheduler, KV pool and counters from now on; returns it (for engine factories)."""
        engine.core.hooks.append(BatchSizes(self.batch_size.observe))
        self.live.attach_engine(engine)
        return engine

    def watch_kafka(self, worker) -> None:
        """A consumers.KafkaWorker: in-flight records, paused partitions, consumer lag."""
        self.live.kafka = worker

    def watch_mailboxes(self, *mailboxes: Mailbox) -> None:
        self.live.mailboxes += mailboxes

    # -- per answer -----------------------------------------------------------------------------------
    def wrap(self, build: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """An engine_actor `wrap` that observes each final answer, then builds what `build` builds."""

        def observed(event, source):
            if isinstance(event, AnswerEvent):
                self.observe_answer(event, source)
            return build(event, source)

        return observed

    def observe_answer(self, answer: AnswerEvent, source: Any = None) -> None:
        """Count the answer, time it, and write its canonical log line."""
        self.answers.labels(answer.finish_reason).inc()
        self.prompt_tokens.inc(answer.usage.prompt_tokens)
        self.cached_prompt_tokens.inc(answer.usage.cached_prompt_tokens)
        self.unknown_fields.inc(len(answer.audit.ignored_fields))
        if answer.incomplete:
            self.incomplete.inc()
        if answer.error is not None:
            self.errors.labels(answer.error.code).inc()
        else:  # an error answer never ran: its timings are zeros, not latencies
            self._observe_timings(answer)
        answers_log.info("answer", **answer_fields(answer, source, self.log_prompts))

    def _observe_timings(self, answer: AnswerEvent) -> None:
        t, tokens = answer.timings, answer.usage.completion_tokens
        self.queue_time.observe(t.queued_ms / 1000)
        self.e2e.observe(t.e2e_ms / 1000)
        if t.ttft_ms is not None:
            self.ttft.observe(t.ttft_ms / 1000)
            if tokens > 1:
                self.itl.observe(max(0.0, t.e2e_ms - t.ttft_ms) / 1000 / (tokens - 1))

    # -- the HTTP endpoint ----------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def scrape(self) -> bytes:
        """The exposition text, Kafka lag sampled first."""
        await self.live.sample_lag()
        return self.render()

    @asynccontextmanager
    async def endpoint(self, port: int, host: str = "127.0.0.1") -> AsyncIterator[int | None]:
        """Serve GET /metrics and GET /health on host:port while the block runs, on this asyncio loop;
        yields the port (None when port is 0: nothing served)."""
        if not port:
            yield None
            return
        async with serve_metrics(MetricsRoutes(self.scrape, self.live.healthy), port, host) as bound:
            yield bound


def answer_fields(answer: AnswerEvent, source: Any, log_prompts: bool) -> dict[str, Any]:
    """The canonical line's fields. Prompt and answer text only when `log_prompts` (they may be personal)."""
    question = getattr(source, "question", None)
    fields = {
        "question_id": answer.question_id, "request_id": answer.request_id,
        "tenant": getattr(question, "tenant", None),
        "partition": getattr(source, "partition", None), "offset": getattr(source, "offset", None),
        "finish_reason": answer.finish_reason, "error": answer.error.code if answer.error else None,
        "prompt_tokens": answer.usage.prompt_tokens, "completion_tokens": answer.usage.completion_tokens,
        "cached_prompt_tokens": answer.usage.cached_prompt_tokens,
        "queued_ms": answer.timings.queued_ms, "ttft_ms": answer.timings.ttft_ms, "e2e_ms": answer.timings.e2e_ms,
        "worker": answer.audit.worker, "channel": answer.audit.channel, "blocks": list(answer.audit.blocks),
        "routing_bucket": answer.audit.routing_bucket,
    }
    if answer.audit.constraint is not None:  # a structured answer: which format held it, and whether it finished
        fields.update(constraint=answer.audit.constraint, incomplete=answer.incomplete)
    if answer.audit.ignored_fields:
        fields["ignored_fields"] = list(answer.audit.ignored_fields)
    if log_prompts:
        if question is not None:
            fields["system"] = question.system
            fields["prompt"] = question.prompt if question.prompt is not None else [
                {"role": m.role, "content": m.content} for m in question.messages or ()]
        fields["text"] = answer.text
    return fields
