"""Exactly-once delivery: a partition's answers and the offsets of the questions they answer, in one
Kafka transaction.

With `kafka.delivery: exactly_once` every questions partition a worker owns has a transactional
producer of its own that fences the partition's previous owner (consumers/publish/partition_transaction.py).

Everything that ends a question of the partition (its answer, an error answer, a dead letter) goes
out in the partition's open transaction, and its settlement (the ledger, the offset tracker, the
`published` line) waits for the commit. A transaction is committed `kafka.transaction_ms` after its
first record, or at once after `kafka.commit_every` records: first every record in it is acked (or
replaced by its fallback), then the partition's commit position joins it (`send_offsets_to_transaction`)
and the transaction commits (a position settled without a record, a redelivery of an answered question,
rides with the partition's next record: `settled`). Answers, their offsets and the group's position move
together or not at all: a worker that dies before the commit leaves nothing a read_committed reader sees,
and the partition's next owner answers those questions once.

After each commit the producer's marker is looked for after its records: a broker killed mid-commit can
answer the retried EndTxn without writing it, and such records are sent again (commit_markers.py).

A rebalance commits the revoked partitions' transactions (aborts one whose records are still unacked
after a short wait: its questions go to the new owner) and closes their producers before aiokafka
releases the partitions. A failure to commit ends the worker (PublishFailed), as an unpublishable
answer does: what it had not committed is answered by the next owner. A fenced producer's commit never
succeeds (on Tansu it is not even answered), so a zombie ends there too.

Records of one transaction go to partition `source partition mod partitions` of their topic (the
publisher's affinity), so each answers partition has one transactional writer: Tansu keeps a
transaction whose records interleave with another open one's undecided, and the partition's last
stable offset with it, until that one ends too; with several writers that went on for seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import anyio
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import IllegalOperation, KafkaError

from consumers.kafka_client.clients import STOP_TIMEOUT_S, producer_options, quietly
from consumers.publish.delivery import PublishFailed, short_error
from consumers.messages import Partition
from consumers.intake.offsets import OffsetTracker
from consumers.publish.partition_transaction import Transaction, transactional_id
from schemas import KafkaConfig

log = structlog.get_logger("kev.consumers.publish.transactions")

REVOKE_WAIT_S = 1.0  # on revocation, how long unacked records may hold the commit before the transaction aborts


class Transactions:
    """Per owned questions partition, one transactional producer; commits its transaction by time and count.

    It stands where the Committer stands in at_least_once (`settled`, `run`, `commit`, `commit_revoked`,
    `assigned`, `commits`); the publisher's sender asks `enter(partition)` for the transaction a record goes
    into and hands it the record's settlement (`Deferred`) once acked.
    """

    def __init__(self, cfg: KafkaConfig, tracker: OffsetTracker, *, interval_s: float, every: int, window_s: float,
                 producer_overrides: Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.tracker = tracker
        self.interval_s = interval_s
        self.every = every
        self.window_s = window_s  # a commit (or an InitProducerId) not done within this fails the worker
        self.producer_overrides = dict(producer_overrides or {})
        self.commits = 0  # transactions committed that carried offsets (the Committer's count)
        self.committed = 0  # transactions committed
        self.aborted = 0
        self.seconds = 0.0  # over committed transactions: first record to commit done
        self.answers = 0  # over committed transactions: records that ended a question
        self._owned: dict[Partition, Transaction] = {}
        self._failed: BaseException | None = None  # a producer that could not start: the worker cannot go on
        self._wake = anyio.Event()
        # Set once the producers of the latest assignment have started: aiokafka may hand over a new partition's
        # records before its listener returns, and a record must wait for its partition's producer.
        self._ready = anyio.Event()

    async def __aenter__(self) -> "Transactions":
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.move_on_after(STOP_TIMEOUT_S * 2, shield=True):
            await self._close(list(self._owned))

    # -- ownership ----------------------------------------------------------------------------------------
    async def assigned(self, partitions: Iterable[Partition]) -> None:
        """Start a transactional producer for each newly assigned partition (fencing its previous owner)."""
        new = [Partition(*p) for p in partitions if Partition(*p) not in self._owned]
        async with anyio.create_task_group() as tg:
            for partition in new:
                tg.start_soon(self._start, partition)
        self._ready.set()

    async def _start(self, partition: Partition) -> None:
        tid = transactional_id(self.cfg.group_id, partition)
        producer = AIOKafkaProducer(**producer_options(self.cfg, **{**self.producer_overrides, "transactional_id": tid,
                                                                    "enable_idempotence": True}))
        try:
            with anyio.fail_after(self.window_s):
                await producer.start()
        except BaseException as error:
            with anyio.move_on_after(STOP_TIMEOUT_S, shield=True):
                await quietly(producer.stop(), "transactional producer")
            if isinstance(error, Exception):
                self._failed = error
                log.error("transaction.start_failed", transactional_id=tid, error=short_error(error))
                return
            raise
        self._owned[partition] = Transaction(partition, producer)
        log.info("transaction.ready", transactional_id=tid, producer_id=producer._txn_manager.producer_id,
                 epoch=producer._txn_manager.producer_epoch)

    async def commit_revoked(self, partitions: Iterable[Partition]) -> dict[Partition, int]:
        """Commit each revoked partition's transaction (abort it if records are still unacked), close its
        producer, forget its offsets; returns the positions committed."""
        revoked = [Partition(*p) for p in partitions]
        if self._ready.is_set():
            self._ready = anyio.Event()  # records wait for the next assignment's producers
        committed = await self._close(revoked)
        self.tracker.forget(revoked)
        return committed

    async def _close(self, partitions: list[Partition]) -> dict[Partition, int]:
        committed: dict[Partition, int] = {}

        async def close(txn: Transaction) -> None:
            txn.gone = True
            if await txn.drained(REVOKE_WAIT_S):
                committed.update(await self._commit(txn, failing=False))
            else:
                await self._abort(txn, "records still unacked at revocation")
            txn.closed = True
            await quietly(txn.producer.stop(), "transactional producer")

        with anyio.move_on_after(STOP_TIMEOUT_S + self.window_s, shield=True):
            async with anyio.create_task_group() as tg:
                for partition in partitions:
                    if (txn := self._owned.pop(partition, None)) is not None:
                        tg.start_soon(close, txn)
        return committed

    # -- sending --------------------------------------------------------------------------------------------
    async def enter(self, partition: Partition, places: int = 1) -> Transaction | None:
        """The partition's transaction to send `places` records into (begun if none is open), once it is not
        committing; the caller calls `leave()` when each record is acked, replaced or given up. None: the
        partition is not this worker's (revoked meanwhile): the records are left to its new owner."""
        partition = Partition(*partition)
        if partition not in self._owned:
            with anyio.move_on_after(self.window_s):
                await self._ready.wait()
        if self._failed is not None:
            raise PublishFailed(f"a transactional producer could not start: {short_error(self._failed)}")
        while (txn := self._owned.get(partition)) is not None and not txn.gone and not txn._open.is_set():
            await txn._open.wait()
        if txn is None or txn.gone:
            return None
        if txn.in_play == 0:
            txn._idle = anyio.Event()
        txn.in_play += places  # before any wait: a commit now waits for these records
        txn.records += places
        try:
            async with txn.beginning:  # aiokafka's begin_transaction waits a moment: begin once
                if txn.began is None:
                    await txn.producer.begin_transaction()
                    txn.began = time.monotonic()
        except BaseException:
            for _ in range(places):
                txn.leave()
            raise
        if txn.records >= self.every:
            self._wake.set()
        return txn

    # -- the Committer's part -------------------------------------------------------------------------------
    def settled(self, count: int = 1) -> None:
        """Positions were settled outside any record (a redelivery of an answered question): the partition's
        next transaction with a record carries them. Not one of offsets alone: Tansu applies a producer's first
        such transaction and drops the offsets of its later ones (tests/test_exactly_once.py shows it), so the
        group would stay behind what this worker logged committed."""

    async def run(self) -> None:
        """Commit each transaction `interval_s` after its first record (at once after `every` records)."""
        while True:
            with anyio.move_on_after(self._until_due()):
                await self._wake.wait()
            self._wake = anyio.Event()
            now = time.monotonic()
            due = [txn for txn in self._owned.values() if not txn.gone and self._due(txn, now)]
            if due:
                async with anyio.create_task_group() as tg:
                    for txn in due:
                        tg.start_soon(self._commit, txn)

    async def commit(self) -> dict[Partition, int]:
        """Commit every open transaction now; returns the positions committed."""
        committed: dict[Partition, int] = {}

        async def commit(txn: Transaction) -> None:
            committed.update(await self._commit(txn))

        async with anyio.create_task_group() as tg:
            for txn in list(self._owned.values()):
                tg.start_soon(commit, txn)
        return committed

    def _until_due(self) -> float:
        began = [txn.began for txn in self._owned.values() if txn.began is not None]
        return max(0.0, min(began) + self.interval_s - time.monotonic()) if began else self.interval_s

    def _due(self, txn: Transaction, now: float) -> bool:
        return txn.began is not None and (txn.records >= self.every or now - txn.began >= self.interval_s)

    async def _commit(self, txn: Transaction, *, failing: bool = True) -> dict[Partition, int]:
        """Wait for the transaction's records, settle them, add the partition's commit position, commit.
        A failure raises PublishFailed (`failing`) or is logged (a revocation: the partition is leaving)."""
        async with txn.lock:
            txn._open = anyio.Event()  # records wait for the next transaction
            try:
                await txn.drained()
                if txn.broken:
                    await self._abort(txn, "a record of it could not be published")
                    return {}
                return await self._end(txn)
            except (KafkaError, IllegalOperation, TimeoutError, AssertionError) as error:
                # aiokafka asserts on a transition its state forbids (a producer its sender gave up on), and
                # refuses the offsets of a transaction a failed send left abortable (IllegalOperation): abort it
                await self._abort(txn, short_error(error))
                if failing:
                    raise PublishFailed(f"transaction {txn.tid} could not commit: {short_error(error)}") from error
                return {}
            finally:
                txn._open.set()

    async def _end(self, txn: Transaction) -> dict[Partition, int]:
        self.aborted += await txn.redo(self.window_s)
        for deferred in txn.deferred:
            deferred.ready()
        settled, began = txn.deferred, txn.began
        if began is None:
            return {}  # positions settled without a record wait for the partition's next record (see `settled`)
        positions = {p: at for p, at in self.tracker.committable().items() if p == txn.partition}
        with anyio.CancelScope(shield=True):  # as Transaction.commit's: what is committed is checked and settled
            await txn.commit(positions, self.cfg.group_id, self.window_s)
            with anyio.fail_after(self.window_s):
                self.aborted += await txn.mend(positions, self.cfg.group_id, self.window_s)
        txn.reset()
        for deferred in settled:
            deferred.settle()
        self.tracker.mark_committed(positions)
        self.committed += 1
        self.commits += bool(positions)
        self.answers += len(settled)
        seconds = time.monotonic() - began
        self.seconds += seconds
        # "committed": the audit trail `kev drill` checks, as the Committer's
        log.info("committed", positions={f"{p.topic}:{p.partition}": at for p, at in positions.items()},
                 transactional_id=txn.tid, answers=len(settled), seconds=round(seconds, 4))
        return positions

    async def _abort(self, txn: Transaction, why: str) -> None:
        """End the transaction without its records (best effort: a fenced producer's abort fails too)."""
        for deferred in txn.deferred:
            deferred.drop()
        had = txn.began is not None
        txn.reset()
        txn.gone = txn.closed = True  # its producer is not trusted any more; the partition's next owner starts afresh
        if had:
            self.aborted += 1
            log.warning("transaction.aborted", transactional_id=txn.tid, reason=why)
            if txn.producer._txn_manager.is_fatal_error():
                return  # aiokafka gave the producer up (fenced): the broker aborts it at the next owner's start
            with anyio.move_on_after(min(STOP_TIMEOUT_S, self.window_s)):
                try:
                    await txn.producer.abort_transaction()
                except (KafkaError, AssertionError) as error:
                    log.warning("transaction.abort_failed", transactional_id=txn.tid, error=short_error(error))
