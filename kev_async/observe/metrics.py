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

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, get_args

import anyio
import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from kev_async.observe.metrics_endpoint import MetricsRoutes, serve_metrics
from kev_async.observe.speculative_metrics import draft_counts, speculative_counts, speculative_families
from kev_async.observe.structured_metrics import STRUCTURED_COUNTERS, structured_counts
from kev_async.observe.tenant_metrics import tenant_families
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
        self.live = _LiveCollector()
        r.register(self.live)

    # -- what is read at scrape time -----------------------------------------------------------------
    def watch_engine(self, engine):
        """Read `engine`'s scheduler, KV pool and counters from now on; returns it (for engine factories)."""
        engine.core.step_observer = self.batch_size.observe
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


class _LiveCollector:
    """Reads engine, mailbox and Kafka state when scraped. Families are always listed, empty until attached."""

    def __init__(self) -> None:
        self.engine = None
        self.retired = dict.fromkeys(_COUNTERS, 0)  # from engines a restart replaced
        self.retired_speculative: dict[tuple[str, str], float] = {}  # the same, per drafter
        self.mailboxes: tuple[Mailbox, ...] = ()
        self.kafka = None
        self.lag: dict[tuple[str, int], int] = {}  # (topic, partition) -> records behind, at the last scrape

    def attach_engine(self, engine) -> None:
        if self.engine is not None:  # counters continue across a scheduler restart
            for key, value in _engine_counts(self.engine.core).items():
                self.retired[key] += value
            for key, value in speculative_counts(self.engine.core).items():
                self.retired_speculative[key] = self.retired_speculative.get(key, 0) + value
        self.engine = engine

    def healthy(self) -> bool:
        """The watched Kafka loop is consuming (nothing watched: nothing to be unhealthy about)."""
        return self.kafka is None or self.kafka.healthy()

    def describe(self) -> Iterator[Metric]:
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        yield from self._engine_families()
        depth = GaugeMetricFamily("kev_mailbox_depth", "Messages waiting in a mailbox.", labels=["mailbox"])
        capacity = GaugeMetricFamily("kev_mailbox_capacity", "A mailbox's bound.", labels=["mailbox"])
        for mailbox in self.mailboxes:
            stats = mailbox.stats()
            depth.add_metric([stats.name], stats.depth)
            capacity.add_metric([stats.name], stats.capacity)
        yield depth
        yield capacity
        yield from self._kafka_families()

    def _engine_families(self) -> Iterator[Metric]:
        core = self.engine.core if self.engine is not None else None
        counts = _engine_counts(core) if core is not None else dict.fromkeys(self.retired, 0)
        for key, (name, text) in _COUNTERS.items():
            yield CounterMetricFamily(name, text, value=self.retired[key] + counts[key])
        drafts = {key: self.retired_speculative.get(key, 0) + value for key, value in speculative_counts(core).items()}
        total = {key: self.retired[key] + counts[key] for key in ("generated", "forwards", "question_steps")}
        yield from speculative_families(drafts, total["generated"], total["forwards"], total["question_steps"])
        yield from tenant_families(core)
        gauges = {}
        if core is not None:
            scheduler, pool = core.scheduler, core.pool
            gauges = {"running": len(scheduler.running), "waiting": len(scheduler.waiting),
                      "used": pool.num_used, "free": pool.num_free, "cached": pool.num_cached,
                      "hit_rate": scheduler.cached_tokens_admitted / max(1, scheduler.prompt_tokens_admitted)}
        for key, name, text in (("running", "kev_running_questions", "Questions in the running batch."),
                                ("waiting", "kev_waiting_questions", "Questions queued for the batch."),
                                ("used", "kev_kv_blocks_used", "KV blocks held by questions."),
                                ("free", "kev_kv_blocks_free", "KV blocks free in the pool (idle cached ones too)."),
                                ("cached", "kev_kv_blocks_cached", "KV blocks in the prefix cache, held or idle."),
                                ("hit_rate", "kev_prefix_cache_hit_rate",
                                 "Prompt tokens read from the prefix cache / prompt tokens admitted.")):
            family = GaugeMetricFamily(name, text)
            if key in gauges:
                family.add_metric([], gauges[key])
            yield family

    def _kafka_families(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily("kev_kafka_in_flight", "Fetched records whose outcome is not acked yet.")
        assigned = GaugeMetricFamily("kev_kafka_assigned_partitions", "Partitions assigned to this worker.")
        paused = GaugeMetricFamily("kev_kafka_paused_partitions", "Partitions paused by backpressure "
                                   "(the engine's inbox full, or the partition at its read-ahead window).")
        lag = GaugeMetricFamily("kev_consumer_lag", "Records on the broker not yet fetched (highwater - position).",
                                labels=["topic", "partition"])
        records = CounterMetricFamily("kev_kafka_records", "Question records fetched.")
        duplicates = CounterMetricFamily("kev_kafka_duplicates", "Questions not answered again (already seen).")
        commits = CounterMetricFamily("kev_kafka_commits", "Offset commits.")
        skew = GaugeMetricFamily("kev_kafka_clock_skew_ms", "How far a producer's clock runs behind this worker's "
                                 "(negative: ahead), by the latest record fetched at a partition's head.")
        untrusted = CounterMetricFamily("kev_kafka_untrusted_timestamps", "Fresh questions whose record stamp was "
                                        "older than their timeout: their deadline counted from arrival instead.")
        published = CounterMetricFamily("kev_kafka_published", "Records acked by the broker, by kind "
                                        "(error_answers include invalid questions the engine never saw).",
                                        labels=["kind"])
        transactions = CounterMetricFamily("kev_kafka_transactions", "exactly_once delivery: Kafka transactions "
                                           "ended, by outcome (committed, aborted).", labels=["outcome"])
        transaction_seconds = SummaryMetricFamily("kev_kafka_transaction_seconds", "Committed transactions: from "
                                                  "the first record to the commit done (the longest a read_committed "
                                                  "reader waits for an answer that is already sent).")
        transaction_answers = SummaryMetricFamily("kev_kafka_transaction_answers", "Committed transactions: the "
                                                  "answers, error answers and dead letters each carried.")
        if self.kafka is not None:
            stats = self.kafka.statistics()
            in_flight.add_metric([], stats.in_flight)
            assigned.add_metric([], len(stats.assigned))
            paused.add_metric([], len(stats.paused))
            for (topic, partition), behind in sorted(self.lag.items()):
                lag.add_metric([topic, str(partition)], behind)
            records.add_metric([], stats.records)
            duplicates.add_metric([], stats.duplicates)
            commits.add_metric([], stats.commits)
            skew.add_metric([], stats.clock_skew_ms)
            untrusted.add_metric([], stats.untrusted_timestamps)
            for kind in ("answers", "error_answers", "deltas", "dead_letters"):
                published.add_metric([kind], getattr(stats, kind))
            transactions.add_metric(["committed"], stats.transactions)
            transactions.add_metric(["aborted"], stats.transactions_aborted)
            transaction_seconds.add_metric([], stats.transactions, stats.transaction_seconds)
            transaction_answers.add_metric([], stats.transactions, stats.transaction_answers)
        yield from (in_flight, assigned, paused, lag, records, duplicates, commits, skew, untrusted, published,
                    transactions, transaction_seconds, transaction_answers)

    async def sample_lag(self) -> None:
        """Lag per assigned partition: aiokafka's highwater (from the last fetch response) minus position.

        Not end_offsets(): the embedded Tansu broker gets that wrong, while the highwater it sends with
        each fetch is right. A paused partition is not fetched, so its highwater (and lag) is as of its
        last fetch until it resumes.
        """
        consumer = getattr(self.kafka, "consumer", None)
        lag = {}
        try:
            with anyio.move_on_after(0.5):
                for tp in consumer.assignment() if consumer is not None else ():
                    highwater = consumer.highwater(tp)
                    if highwater is not None:
                        lag[(tp.topic, tp.partition)] = max(0, highwater - await consumer.position(tp))
        except Exception as error:  # noqa: BLE001 - revoked or stopping mid-scrape: report what we have
            log.debug("metrics.lag_unavailable", error=repr(error))
        self.lag = lag


# The engine's own counters, read at scrape time: key -> (metric, help).
_COUNTERS = {
    "generated": ("kev_generated_tokens", "Tokens generated."),
    "forwards": ("kev_forwards", "Packed forward passes."),
    "question_steps": ("kev_question_steps", "Forwards counted once per question that emitted tokens in them; "
                       "kev_generated_tokens over it: tokens per question per forward (speculative.md)."),
    "preemptions": ("kev_preemptions", "Questions preempted for KV room."),
    "draft_tokens": ("kev_draft_tokens", "Speculative draft tokens verified in forwards (speculative.method)."),
    "accepted_draft_tokens": ("kev_accepted_draft_tokens", "Speculative draft tokens the model agreed with and "
                              "emitted; over kev_draft_tokens: the acceptance rate."),
    **STRUCTURED_COUNTERS,
}


def _engine_counts(core) -> dict[str, float]:
    return {"generated": core.num_generated, "forwards": core.num_forwards,
            "question_steps": core.scheduler.num_question_steps,
            "preemptions": core.scheduler.num_preemptions, **draft_counts(core.scheduler.speculation),
            **structured_counts(core.constraints)}
