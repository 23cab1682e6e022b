"""What a scrape reads from live objects: the engine (its counters, queues, KV pool and tenants), the
mailboxes, and the Kafka worker (its counts and each partition's lag). Nothing polls: the collector
reads at scrape time, and keeps the counters of engines a restart replaced so totals never go back."""

from __future__ import annotations

from collections.abc import Iterator
import anyio
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from kev_async.observe.speculative_metrics import draft_counts, speculative_counts, speculative_families
from kev_async.observe.structured_metrics import STRUCTURED_COUNTERS, structured_counts
from kev_async.observe.tenant_metrics import tenant_families
from kev_async.runtime.actors import Mailbox

log = structlog.get_logger("kev.metrics")


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


class LiveCollector:
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
                                   "(the engine's inbox full).")
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
