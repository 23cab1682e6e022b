"""Records out to Kafka, each settling its source positions once the broker acks it.

`send()` only queues a record into the producer's batch; a settle task per record waits for the
broker's ack (acks=all) and only then reports the source positions as done. Those tasks run in the
publisher's task group, so leaving `async with Publisher(...)` waits for every ack in flight.

A failure is sorted by consumers/publish/delivery.py `decide` (consumers/publish/failed_records.py): a transient one
is sent again with backoff until `retry_s` after the record's first send (on a caller's reply topic:
the record's own window, the question's deadline); a record refused for itself, or one its reply topic
did not take within its window, is replaced by its fallback (consumers/publish/records.py: an error answer, a
dead letter; never another topic); a reply topic the broker refuses is avoided
(consumers/publish/reply_topics.py): its next records go to their fallback at once. What is left raises
PublishFailed, and the source of that record is never settled, so never committed.

With exactly_once delivery (a `transactions`, consumers/publish/transactions.py) a record that ends a question
goes out in the open transaction of its questions partition, to partition `questions partition mod
partitions` of its topic (a delta, outside any transaction, to the same one), and once acked its
settlement waits for that transaction's commit; an aborted transaction's records are settled never.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import anyio
import structlog
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaTimeoutError, UnknownTopicOrPartitionError
from anyio.abc import TaskGroup

from consumers.kafka_client.clients import tracked
from consumers.publish.delivery import PublishFailed, Retries
from consumers.publish.failed_records import after_failure, fail_fast
from consumers.intake.ledger import QuestionLedger
from consumers.messages import Position
from consumers.publish.partition_transaction import Deferred, Transaction
from consumers.publish.records import Record
from consumers.publish.reply_topics import ReplyTopics
from consumers.publish.transactions import Transactions

log = structlog.get_logger("kev.consumers.publish.publisher")  # the publisher's lines, whichever of its modules writes them

ACK_WAIT_S = 1.0  # on revocation, how long the acks in flight are waited for (the rebalance waits too)
# The publish loop waits this long at most for a reply topic's metadata on a record's first send; the
# rest of its window is retried in its settle task, so one slow reply topic does not hold up every answer.
REPLY_QUEUE_WAIT_S = 5.0


class Sender:
    def __init__(
        self,
        producer: AIOKafkaProducer,
        ledger: QuestionLedger,
        on_settled: Callable[[Sequence[Position]], None],
        tasks: TaskGroup,  # the publisher's: the settle tasks run there
        reply_topics: ReplyTopics,
        counts: dict[str, int],  # the publisher's counts: each acked record adds one to its kind
        *,
        max_in_flight: int,
        retry_s: float,
        transactions: Transactions | None = None,  # exactly_once: each partition's records go in its transaction
    ) -> None:
        self.producer = producer
        self.transactions = transactions
        self.ledger = ledger
        self.on_settled = on_settled  # positions whose outcome the broker acked
        self.tasks = tasks
        self.reply_topics = reply_topics
        self.counts = counts
        self.retry_s = retry_s
        self._slots = anyio.Semaphore(max_in_flight)
        self._unacked = 0
        self._acked = anyio.Event()

    async def send_together(self, records: list[Record]) -> None:
        """Queue records that settle the same source (a question's samples): with exactly_once all go into one
        transaction, entered once for all of them, so no commit falls between two of them."""
        if self.transactions is None or len(records) == 1 or not records[0].settles:
            for record in records:
                await self.send(record)
            return
        txn = await self.transactions.enter(records[0].settles[0].partition_key, places=len(records))
        if txn is None:
            for record in records:
                self._left_to_new_owner(record)
            return
        for i, record in enumerate(records):
            try:
                await self.send(record, entered=txn)
            except BaseException:
                for _ in records[i + 1:]:  # their places are nobody's now
                    txn.leave()
                raise

    async def send(self, record: Record, *, home: int | None = None, entered: Transaction | None = None) -> None:
        """Queue the record (in call order, so one question's deltas precede its answer); a task settles it.
        `home`: the questions partition of a record that settles none (a delta), for exactly_once's affinity.
        `entered`: the transaction send_together took a place in for it."""
        if record.reply and (unusable := self.reply_topics.unusable(record.topic)) is not None:
            record = fail_fast(record, unusable)
            if record is None:
                if entered is not None:
                    entered.leave()
                return
        await self._slots.acquire()
        try:
            txn = entered if entered is not None else await self._transaction(record)
        except BaseException:
            self._slots.release()
            raise
        if txn is False:
            self._slots.release()
            return
        retries = Retries(self._window(record))  # the window counts from here, the first send
        within_s = retries.left()
        try:
            pending = await self._try_send(record, min(within_s, REPLY_QUEUE_WAIT_S) if record.reply else within_s,
                                           txn, home)
        except BaseException:
            self._slots.release()
            if txn is not None:
                txn.leave()
            raise
        self._unacked += 1
        self.tasks.start_soon(self._settle, record, pending, retries, txn, home)

    async def _transaction(self, record: Record) -> Transaction | None | bool:
        """The transaction the record goes into; None: none (at_least_once, or a record that settles
        nothing); False: its partition is no longer this worker's, so the record is left to the new owner."""
        if self.transactions is None or not record.settles:
            return None
        txn = await self.transactions.enter(record.settles[0].partition_key)
        if txn is None:
            self._left_to_new_owner(record)
            return False
        return txn

    def _left_to_new_owner(self, record: Record) -> None:
        if record.finishes is not None:
            self.ledger.abandon(record.finishes)
        log.info("answer_left_to_new_owner", kind=record.kind, question_id=record.question_id,
                 source_partition=record.settles[0].partition, source_offset=record.settles[0].offset)

    async def quiesce(self, timeout: float = ACK_WAIT_S) -> None:
        """Wait (bounded) until every record sent so far is acked or has failed."""
        with anyio.move_on_after(timeout):
            while self._unacked:
                await self._acked.wait()

    async def _try_send(self, record: Record, within_s: float | None, txn: Transaction | None = None,
                        home: int | None = None) -> asyncio.Future | Exception:
        """The ack's future, or the error. send() itself can wait request_timeout_ms for a topic's
        metadata (in the publish loop, for a first send): given up after `within_s` (cancelled there,
        nothing was queued)."""
        producer = self.producer if txn is None else txn.producer
        try:
            with anyio.fail_after(within_s):
                await tracked(producer, record.topic)
                partition = record.partition
                if partition is None and self.transactions is not None:
                    partition = await self._affine(producer, record, home)
                return await producer.send(record.topic, value=record.value, key=record.key,
                                           headers=record.headers, partition=partition,
                                           timestamp_ms=record.timestamp_ms)
        except TimeoutError:
            if producer.client.cluster.partitions_for_topic(record.topic) is None:
                return UnknownTopicOrPartitionError(f"no metadata for topic {record.topic[:300]!r} "
                                                    f"within {within_s:.1f}s")
            return KafkaTimeoutError(f"not queued within {within_s:.1f}s")
        except Exception as error:  # noqa: BLE001 - sorted in _deliver, like a failed ack
            return error

    @staticmethod
    async def _affine(producer: AIOKafkaProducer, record: Record, home: int | None) -> int | None:
        """The record's questions partition mod its topic's partitions: one transactional writer per
        partition (consumers/publish/transactions.py says why)."""
        source = record.settles[0].partition if record.settles else home
        if source is None:
            return None
        return source % len(await producer.partitions_for(record.topic))

    async def _settle(self, record: Record, pending: asyncio.Future | Exception, retries: Retries,
                      txn: Transaction | None = None, home: int | None = None) -> None:
        delivered = None
        try:
            delivered = await self._deliver(record, pending, retries, txn, home)
        except PublishFailed:
            if txn is not None:  # not committed without it: this error, not the commit's, is the worker's
                txn.broken = True
            raise
        finally:
            self._slots.release()
            self._unacked -= 1
            self._acked.set()
            self._acked = anyio.Event()
            if txn is not None:
                if delivered is not None:  # settled when its transaction commits
                    txn.settle_later(self._deferred(*delivered))
                txn.leave()
        if delivered is not None and txn is None:
            self._settled(*delivered)

    def _settled(self, record: Record, metadata) -> None:
        self.counts[record.kind] = self.counts.get(record.kind, 0) + 1  # "forwarded" appears only in kev route
        settles = list(record.settles)
        if record.finishes is not None:
            settles += self.ledger.finish(record.finishes)
        self._done(record, metadata, settles)

    def _done(self, record: Record, metadata, settles: list[Position]) -> None:
        if settles:
            self.on_settled(settles)
            source = settles[0]
            log.info("published", kind=record.kind, topic=record.topic, partition=metadata.partition,
                     offset=metadata.offset, question_id=record.question_id, source_partition=source.partition,
                     source_offset=source.offset)

    def _deferred(self, record: Record, metadata) -> Deferred:
        """An acked record of a transaction: its positions done before the transaction's offsets are taken, its
        question answered (the ledger) only once the transaction commits, forgotten if it aborts."""
        waiting: list[Position] = []

        def ready() -> None:
            waiting[:] = self.ledger.waiting(record.finishes) if record.finishes is not None else []
            self._done(record, metadata, [*record.settles, *waiting])

        def settle() -> None:
            self.counts[record.kind] = self.counts.get(record.kind, 0) + 1
            if record.finishes is not None:  # redeliveries admitted since ready() settle now, into the next one
                self._done(record, metadata, self.ledger.finish(record.finishes)[len(waiting):])

        def drop() -> None:
            if record.finishes is not None:
                self.ledger.abandon(record.finishes)

        async def again(producer: AIOKafkaProducer) -> asyncio.Future:
            return await producer.send(record.topic, value=record.value, key=record.key, headers=record.headers,
                                       partition=metadata.partition, timestamp_ms=record.timestamp_ms)

        return Deferred(ready, settle, drop, again, TopicPartition(metadata.topic, metadata.partition), metadata.offset)

    async def _deliver(self, record: Record, pending: asyncio.Future | Exception, retries: Retries,
                       txn: Transaction | None = None, home: int | None = None):
        """(the record acked, its metadata), or None when it was dropped; raises PublishFailed. One
        window (`retries`) for the record and what replaces it, from its first send; only a dead letter
        replacing a reply topic's record (whose window was its question's) gets one of its own."""
        first_of_fallback = False
        while True:
            try:
                return record, await self._ack(record, pending, retries, bounded=not first_of_fallback)
            except Exception as error:  # noqa: BLE001 - every failure is sorted below
                following = after_failure(record, error, retries, self.reply_topics)
            if following is None:
                return None
            first_of_fallback = following is not record
            if following is record:
                await retries.wait()
            elif following.reply != record.reply:  # a reply topic's window was the question's: the fleet's own
                retries = Retries(self._window(following))  # topic (the dead letter) gets a window of its own
            record = following
            pending = await self._try_send(record, None if first_of_fallback else retries.left(), txn, home)

    async def _ack(self, record: Record, pending: asyncio.Future | Exception, retries: Retries, *, bounded: bool):
        """The broker's ack. Waited for within the record's window, except for the first try of a record
        replacing a refused one (its own try, bounded by request_timeout_ms). A reply topic's record given
        up may still arrive after its fallback: that is a dead letter without the text, never a second
        answer where the caller reads."""
        if isinstance(pending, Exception):
            raise pending
        if not bounded:
            return await pending
        with anyio.move_on_after(retries.left()):
            return await asyncio.shield(pending)  # not cancelled: aiokafka still owns the record
        raise KafkaTimeoutError(f"no ack within {retries.budget_s:g}s of the first send")

    def _window(self, record: Record) -> float:
        return self.retry_s if record.window_s is None else record.window_s
