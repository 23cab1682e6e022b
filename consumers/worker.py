"""All of Kev's Kafka I/O as one actor: questions in to the engine's inbox, answers out, offsets committed.

    send_q, recv_q = anyio.create_memory_object_stream[Inbound](16)
    send_a, recv_a = anyio.create_memory_object_stream[Outbound](16)
    await tg.start(run_kafka_io, cfg, send_q, recv_a)   # the engine actor reads recv_q, writes send_a

aiokafka is asyncio-only: build and run this on anyio's asyncio backend. Shutdown, gracefully: call
`worker.stop_intake()`; the inbox closes, the engine drains and closes its outbox, every answer in
flight is acked, the settled offsets are committed, then `run()` returns. Cancelled instead, it
commits what is already settled (shielded, bounded) and unsettled questions are redelivered later.
An answer that cannot be published within `publish_retry_s` of its first send, or a refusal of the
fleet's own topics, ends `run()` with PublishFailed (settled offsets committed first): the worker
cannot go on, and its caller should exit non-zero.

`kafka.delivery` picks how offsets are committed (logged once at start, `kafka.delivery`): after the
answers' acks (at_least_once, consumers/intake/committer.py), or with them in one Kafka transaction per
questions partition (exactly_once, consumers/publish/transactions.py; questions are then read read_committed).
A transaction lives on one cluster: `producer_options` that send the answers to other brokers make
`auto` pick at_least_once.

`healthy()` says whether the loop is consuming: it has polled within `health_window_s` (a paused
partition is still polled).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import anyio
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from consumers.intake.backpressure import Watermarks
from consumers.broker.embedded import EMBEDDED
from consumers.kafka_client.clients import open_consumer, open_producer
from consumers.intake.committer import Committer, RevocationListener
from consumers.publish.delivery import PublishFailed
from consumers.publish.delivery_mode import choose_delivery
from consumers.intake.loop import COUNTS as INTAKE_COUNTS, Intake
from consumers.intake.ledger import QuestionLedger
from consumers.messages import Inbound, Outbound, Partition, Position
from consumers.intake.offsets import OffsetTracker
from consumers.intake.publish_clock import PublishClock
from consumers.publish.publisher import Publisher
from consumers.kafka_client.topics import ensure_topics
from consumers.publish.transactions import Transactions
from schemas import KafkaConfig

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

log = structlog.get_logger("kev.consumers.worker")


# A rebalance that a member leaves while another joins can stall on the embedded Tansu broker until the coordinator's
# rebalance timeout, which aiokafka sets to max_poll_interval_ms (5 minutes): no member gets an assignment meanwhile
# (seen in the fault drill; reproduced with plain aiokafka consumers). With these the group recovered in 19-29 s in
# every try. Heartbeats come from aiokafka's own task, never blocked by the model: 6 s without one means it is gone.
GROUP_TIMEOUTS = {"rebalance_timeout_ms": 5_000, "session_timeout_ms": 6_000, "heartbeat_interval_ms": 1_000}


@dataclass(frozen=True)
class KafkaStatistics:
    assigned: frozenset[Partition]
    paused: frozenset[Partition]
    in_flight: int  # fetched records whose outcome the broker has not acked yet
    records: int  # fetched
    questions: int  # sent to the engine
    duplicates: int  # not answered again (being answered, or answered recently)
    answers: int  # acked, per kind
    error_answers: int
    deltas: int
    dead_letters: int
    commits: int
    pauses: int  # every partition paused: the engine's inbox was full
    resumes: int
    read_ahead_held: int = 0  # records fetched past their partition's window, held until it had room
    polls: int = 0  # fetch rounds: a paused worker goes on polling (its partitions give nothing)
    samples_gathering: int = 0  # answers of questions with params.n > 1 held until their last sample
    abandoned: int = 0  # answers left to the partition's new owner after a rebalance (not published)
    clock_skew_ms: float = 0.0  # the latest apparent skew of a producer's clock at a partition's head (publish_clock.py)
    untrusted_timestamps: int = 0  # fresh questions whose stamp was older than their timeout: timed from arrival
    delivery: str = "at_least_once"  # as chosen at start (kafka.delivery)
    transactions: int = 0  # exactly_once: transactions committed
    transactions_aborted: int = 0
    transaction_seconds: float = 0.0  # summed over committed transactions: first record to commit done
    transaction_answers: int = 0  # summed over committed transactions: answers, error answers, dead letters


class KafkaWorker:
    def __init__(
        self,
        cfg: KafkaConfig,
        questions_out: MemoryObjectSendStream[Inbound],
        answers_in: MemoryObjectReceiveStream[Outbound],
        *,
        high_watermark: int | None = None,
        low_watermark: int | None = None,
        dedup_capacity: int = 10_000,
        max_records: int = 64,
        read_ahead: int | None = None,  # records in flight per partition; default: cfg.read_ahead (None: no window)
        shutdown_timeout: float = 10.0,
        create_topics: bool = True,
        consumer_options: Mapping[str, Any] | None = None,  # extra AIOKafkaConsumer kwargs
        producer_options: Mapping[str, Any] | None = None,  # extra AIOKafkaProducer kwargs (may override any)
        publish_retry_s: float | None = None,  # default: cfg.publish_retry_ms (counted from an answer's first send)
        reply_avoid_s: float = 60.0,  # a reply topic the broker refused is not tried again for this long
        commit_debounce_s: float = 0.05,  # a settled offset is committed this soon (settles close together share it)
        health_window_s: float = 30.0,
        default_timeout_ms: int | None = None,  # a question's deadline when it sets none (aggregator.timeout_ms)
    ) -> None:
        if cfg.bootstrap_servers == EMBEDDED:
            raise ValueError('bootstrap_servers is "embedded": start it first with consumers.embedded_kafka(cfg)')
        self.cfg = cfg
        self.questions_out = questions_out
        self.answers_in = answers_in
        self.watermarks = Watermarks.for_buffer(questions_out.statistics().max_buffer_size,
                                                high_watermark, low_watermark)
        self.max_records = max_records
        self.read_ahead = cfg.read_ahead if read_ahead is None else read_ahead
        self.shutdown_timeout = shutdown_timeout
        self.create_topics = create_topics
        self.consumer_options = dict(consumer_options or {})
        self.producer_options = dict(producer_options or {})
        self.publish_retry_s = cfg.publish_retry_ms / 1000 if publish_retry_s is None else publish_retry_s
        self.reply_avoid_s = reply_avoid_s
        self.health_window_s = health_window_s
        self.clock = PublishClock(default_timeout_ms, head_records=max_records)
        self.commit_debounce_s = commit_debounce_s
        self.tracker = OffsetTracker()
        self.ledger = QuestionLedger(dedup_capacity)
        self.consumer: AIOKafkaConsumer | None = None  # built in run(): aiokafka wants a running loop
        self.producer: AIOKafkaProducer | None = None
        self.committer: Committer | Transactions | None = None
        self.delivery = "at_least_once"  # chosen in run() (kafka.delivery)
        self.listener: RevocationListener | None = None
        self._assigned = anyio.Event()
        self._intake: Intake | None = None
        self._publisher: Publisher | None = None
        self._intake_scope = anyio.CancelScope()
        self._serving = False  # between the loop's start and its end

    def healthy(self) -> bool:
        """The Kafka loop is running and has polled for questions within `health_window_s`."""
        if not self._serving or self._intake is None:
            return False
        last_poll = getattr(self._intake, "last_poll", None)
        return last_poll is not None and time.monotonic() - last_poll <= self.health_window_s

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until the engine closes its outbox; raises PublishFailed when an answer cannot go out."""
        try:
            await self._run(task_status)
        except BaseExceptionGroup as group:  # task groups wrap it: hand the caller the one error that matters
            failed, _rest = group.split(PublishFailed)
            if failed is None:
                raise
            while isinstance(failed, BaseExceptionGroup):
                failed = failed.exceptions[0]
            raise failed from None

    async def _run(self, task_status: TaskStatus[None]) -> None:
        cfg = self.cfg
        try:
            if self.create_topics:
                await ensure_topics(cfg)
            self.delivery, why = await choose_delivery(cfg, self.producer_options.get("bootstrap_servers"))
            log.info("kafka.delivery", mode=self.delivery, why=why)
            exactly_once = self.delivery == "exactly_once"
            # A first try need not outlast the whole retry budget (aiokafka's default is 40 s).
            producer_options = {"request_timeout_ms": min(40_000, cfg.publish_retry_ms), **self.producer_options}
            async with AsyncExitStack() as clients:
                self.producer = await clients.enter_async_context(
                    open_producer(cfg, stop_timeout_s=self.shutdown_timeout, **producer_options))
                self.consumer = await clients.enter_async_context(open_consumer(
                    cfg, stop_timeout_s=self.shutdown_timeout, group_id=cfg.group_id,
                    # a question a transactional producer aborted is never answered
                    **{"fetch_max_wait_ms": cfg.fetch_max_wait_ms, **GROUP_TIMEOUTS,
                       "isolation_level": "read_committed" if exactly_once else "read_uncommitted",
                       **self.consumer_options}))
                if exactly_once:
                    self.committer = await clients.enter_async_context(Transactions(
                        cfg, self.tracker, interval_s=cfg.transaction_ms / 1000, every=cfg.commit_every,
                        window_s=self.publish_retry_s, producer_overrides=producer_options))
                else:
                    self.committer = Committer(self.consumer, self.tracker, interval_s=cfg.commit_interval_ms / 1000,
                                               every=cfg.commit_every, debounce_s=self.commit_debounce_s)
                self.listener = RevocationListener(self.committer, on_assigned=self._assigned.set)
                self.consumer.subscribe([cfg.questions_topic], listener=self.listener)
                log.info("kafka_io_started", bootstrap=cfg.bootstrap_servers, group=cfg.group_id,
                         topic=cfg.questions_topic)
                failed = False
                try:
                    await self._serve(task_status)
                except BaseException:
                    failed = True
                    raise
                finally:
                    with anyio.move_on_after(self.shutdown_timeout, shield=True):
                        committed = await self._final_commit(failed)
                        log.info("kafka_io_stopping", committed=len(committed), in_flight=self.tracker.in_flight())
        finally:
            self.questions_out.close()
            self.answers_in.close()

    async def _final_commit(self, failed: bool) -> dict:
        """Commit what is settled on the way out; after a failure, a failing commit is logged, not raised: the
        failure that stopped the worker is the one to report."""
        try:
            return await self.committer.commit()
        except PublishFailed as error:
            if not failed:
                raise
            log.warning("kafka_io.final_commit_failed", error=str(error))
            return {}

    def stop_intake(self) -> None:
        """Stop fetching and close the engine's inbox; run() ends once the engine's outbox closes."""
        self._intake_scope.cancel()

    async def wait_assigned(self) -> None:
        """Until this worker has joined its group and received partitions at least once."""
        await self._assigned.wait()

    def statistics(self) -> KafkaStatistics:
        intake = self._intake.counts if self._intake else dict.fromkeys(INTAKE_COUNTS, 0)
        published = self._publisher.counts if self._publisher else dict.fromkeys(
            ("answers", "error_answers", "deltas", "dead_letters", "abandoned"), 0)
        consumer, committer = self.consumer, self.committer
        transactions = {} if not isinstance(committer, Transactions) else {
            "transactions": committer.committed, "transactions_aborted": committer.aborted,
            "transaction_seconds": committer.seconds, "transaction_answers": committer.answers}
        return KafkaStatistics(
            assigned=_partitions(consumer.assignment() if consumer else ()),
            paused=_partitions(consumer.paused() if consumer else ()),
            in_flight=self.tracker.in_flight(), commits=committer.commits if committer else 0,
            samples_gathering=self._publisher.samples_gathering if self._publisher else 0,
            clock_skew_ms=self.clock.skew_ms, untrusted_timestamps=self.clock.untrusted, delivery=self.delivery,
            **intake, **published, **transactions,
        )

    async def _serve(self, task_status: TaskStatus[None]) -> None:
        max_request_size = self.producer_options.get("max_request_size", self.cfg.max_request_size)
        async with anyio.create_task_group() as tg:
            transactions = self.committer if isinstance(self.committer, Transactions) else None
            async with Publisher(self.producer, self.cfg, self.ledger, self._settled, max_request_size=max_request_size,
                                 retry_s=self.publish_retry_s, avoid_s=self.reply_avoid_s,
                                 ownership=self.listener, transactions=transactions) as publisher:
                self._publisher = publisher
                self.listener.before_commit = publisher.quiesce  # acks in flight are committed on revocation
                self._intake = Intake(self.consumer, self.listener, self.tracker, self.ledger, publisher,
                                      self._settled, self.questions_out, self.watermarks,
                                      max_records=self.max_records, read_ahead=self.read_ahead,
                                      trust=self.cfg.trust,
                                      limits=self.cfg.limits, clock=self.clock)
                tg.start_soon(self.committer.run)
                tg.start_soon(self._run_intake)
                self._serving = True
                try:
                    task_status.started()
                    await publisher.run(self.answers_in)
                finally:
                    self._serving = False
            # The engine closed its outbox and every ack is in: nothing more will settle.
            tg.cancel_scope.cancel()

    async def _run_intake(self) -> None:
        with self._intake_scope:
            await self._intake.run()
        self.questions_out.close()  # also when stopped before run() opened it

    def _settled(self, positions: Sequence[Position]) -> None:
        for position in positions:
            self.tracker.done(position.partition_key, position.offset)
        self.committer.settled(len(positions))
        if self._intake is not None:
            self._intake.settled(positions)  # room in a read-ahead window: a held record goes in


async def run_kafka_io(
    cfg: KafkaConfig,
    questions_out: MemoryObjectSendStream[Inbound],
    answers_in: MemoryObjectReceiveStream[Outbound],
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    **options: Any,
) -> None:
    """Run a KafkaWorker (options as its keyword arguments) until the engine closes `answers_in`."""
    await KafkaWorker(cfg, questions_out, answers_in, **options).run(task_status=task_status)


def _partitions(tps) -> frozenset[Partition]:
    return frozenset(Partition(tp.topic, tp.partition) for tp in tps)
