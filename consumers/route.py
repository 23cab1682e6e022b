"""`kev route`'s loop: questions from the intake topic re-published to the questions topic, each on
the partition its routing strategy picks (consumers/publish/partitioner.py), so it lands on that worker.

The same at-least-once rule as `kev serve`: a record's offset is committed only after its outcome
is acked: the re-published question, or the dead letter for an event that is not a question at all.
An invalid question (valid JSON with a bad field) is forwarded unchanged to the partition of its id:
the worker there answers it with the error, as it would a question sent to it directly. The value,
key and headers are kept; a `kev.route` header names the strategy. Kept headers include the
signature (schemas/signing.py; its producer signs for the questions topic, where the question is
answered, and the record key is kept), so a signed question stays signed: routing needs no key and
grants no trust.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord
from anyio.abc import TaskStatus

from consumers.broker.embedded import EMBEDDED
from consumers.kafka_client.clients import fetch, open_consumer, open_producer
from consumers.intake.committer import Committer, RevocationListener
from consumers.intake.ledger import QuestionLedger
from consumers.messages import Position
from consumers.intake.offsets import OffsetTracker
from consumers.publish.partitioner import Partitioner, Semantic
from consumers.publish.publisher import Publisher
from consumers.kafka_client.record_guard import printable_headers, unreadable
from consumers.kafka_client.topics import create_topics, topic_configs, topic_plan
from schemas import InvalidQuestion, KafkaConfig, UndecodableEvent, decode_question

log = structlog.get_logger("kev.consumers.route")

HEADER_ROUTE = "kev.route"


class RouteService:
    def __init__(self, cfg: KafkaConfig, strategy: str, *, intake_topic: str | None = None,
                 group_id: str | None = None, max_records: int = 256, shutdown_timeout: float = 10.0,
                 consumer_options: Mapping[str, Any] | None = None, semantic: Semantic | None = None) -> None:
        """`semantic`: semantic_hash's partition function (consumers/publish/partitioner.py), for that strategy only."""
        if cfg.bootstrap_servers == EMBEDDED:
            raise ValueError('kev route needs a running broker: kafka.bootstrap_servers is "embedded"')
        self.cfg = cfg
        Partitioner(strategy, 1, semantic=semantic)  # a bad strategy is refused here, not at the first fetch
        self.strategy = strategy
        self.semantic = semantic
        self.intake_topic = intake_topic or cfg.intake_topic
        self.group_id = group_id or f"{cfg.group_id}.route"
        self.max_records = max_records
        self.shutdown_timeout = shutdown_timeout
        self.consumer_options = dict(consumer_options or {})
        self.tracker = OffsetTracker()
        self.counts = {"records": 0, "forwarded": 0, "invalid": 0, "dead_letters": 0}
        self.partitioner: Partitioner | None = None
        self._stop = anyio.CancelScope()
        self._assigned = anyio.Event()

    def stop(self) -> None:
        """Stop fetching; run() returns once every forward in flight is acked and committed."""
        self._stop.cancel()

    async def wait_assigned(self) -> None:
        await self._assigned.wait()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        cfg = self.cfg
        await create_topics(cfg, {**topic_plan(cfg), self.intake_topic: cfg.partitions}, configs=topic_configs(cfg))
        async with open_producer(cfg, stop_timeout_s=self.shutdown_timeout) as producer, \
                open_consumer(cfg, stop_timeout_s=self.shutdown_timeout, group_id=self.group_id,
                              **self.consumer_options) as consumer:
            committer = Committer(consumer, self.tracker, interval_s=cfg.commit_interval_ms / 1000,
                                  every=cfg.commit_every)
            listener = RevocationListener(committer, on_assigned=self._assigned.set)
            consumer.subscribe([self.intake_topic], listener=listener)
            try:
                await self._serve(consumer, producer, committer, listener, task_status)
            finally:
                with anyio.move_on_after(self.shutdown_timeout, shield=True):
                    committed = await committer.commit()
                    log.info("route.stopping", committed=len(committed), in_flight=self.tracker.in_flight(),
                             **self.counts)

    async def _serve(self, consumer, producer, committer: Committer, listener: RevocationListener,
                     task_status: TaskStatus[None]) -> None:
        def settled(positions: Sequence[Position]) -> None:
            for position in positions:
                self.tracker.done(position.partition_key, position.offset)
            committer.settled(len(positions))

        async with anyio.create_task_group() as tg:
            tg.start_soon(committer.run)
            async with Publisher(producer, self.cfg, QuestionLedger(), settled) as publisher:
                await self._refresh_partitioner(producer)
                log.info("route.started", strategy=self.strategy, intake=self.intake_topic,
                         questions=self.cfg.questions_topic, partitions=self.partitioner.num_partitions)
                task_status.started()
                with self._stop:
                    while True:
                        await self._poll_once(consumer, producer, publisher, listener)
            # Every forward is acked (leaving Publisher waits): commit, then stop the commit loop.
            await committer.commit()
            tg.cancel_scope.cancel()

    async def _poll_once(self, consumer, producer, publisher: Publisher, listener: RevocationListener) -> None:
        batch = await fetch(consumer, timeout_ms=100, max_records=self.max_records)
        if batch:
            await self._refresh_partitioner(producer)
        epoch = listener.epoch
        for records in batch.values():
            for record in records:
                if listener.epoch != epoch:
                    return  # a rebalance reset positions: the rest is fetched again from the commit point
                await self._route(record, publisher)

    async def _route(self, record: ConsumerRecord, publisher: Publisher) -> None:
        source = Position(record.topic, record.partition, record.offset)
        self.tracker.track(source.partition_key, record.offset)
        self.counts["records"] += 1
        if (broken := unreadable(record)) is not None:  # not forwarded: no producer can write its headers
            log.warning("dead_letter", reason=broken.reason, message=broken.message, partition=record.partition,
                        offset=record.offset)
            self.counts["dead_letters"] += 1
            await publisher.dead_letter(record.value, record.key, printable_headers(record.headers), source,
                                        broken.reason, broken.message)
            return
        headers = [*record.headers, (HEADER_ROUTE, self.strategy.encode())]
        try:
            question = decode_question(record.value if record.value is not None else b"", limits=self.cfg.limits)
        except UndecodableEvent as bad:
            log.warning("dead_letter", reason=bad.reason, message=bad.message, partition=record.partition,
                        offset=record.offset)
            self.counts["dead_letters"] += 1
            await publisher.dead_letter(record.value, record.key, list(record.headers), source, bad.reason,
                                        bad.message)
            return
        except InvalidQuestion as bad:  # the worker on its id's partition sends the error answer
            self.counts["invalid"] += 1
            partition = self.partitioner.fallback(bad.question_id)
        except Exception as error:  # a decoder bug must not stop the partition: park the record
            log.exception("decode_crashed", partition=record.partition, offset=record.offset)
            self.counts["dead_letters"] += 1
            await publisher.dead_letter(record.value, record.key, list(record.headers), source, "decode_crashed",
                                        repr(error))
            return
        else:
            partition = self.partitioner.partition(question)
            self.counts["forwarded"] += 1
        await publisher.forward(self.cfg.questions_topic, record.key, record.value, headers, partition, source,
                                timestamp_ms=record.timestamp)  # deadlines count from the original publish

    async def _refresh_partitioner(self, producer: AIOKafkaProducer) -> None:
        """Follow the questions topic's partition count (cached metadata; refreshed by aiokafka)."""
        partitions = await producer.partitions_for(self.cfg.questions_topic)
        if self.partitioner is None or self.partitioner.num_partitions != len(partitions):
            if self.partitioner is not None:
                log.warning("route.partitions_changed", before=self.partitioner.num_partitions, after=len(partitions))
            self.partitioner = Partitioner(self.strategy, partitions, semantic=self.semantic)
