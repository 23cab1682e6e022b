"""One owned questions partition's transactional producer, the transaction it has open, and the
settlements of the records acked into it (consumers/publish/transactions.py commits them).

With `kafka.delivery: exactly_once` every questions partition a worker owns has a transactional
producer of its own, `transactional_id` = "<group>/<topic>/<partition>". Starting it (InitProducerId)
bumps that id's epoch: the partition's previous owner, dead or paused past its session, is fenced,
and its open transaction aborted (KIP-98; aiokafka 0.14's `send_offsets_to_transaction` sends
TxnOffsetCommit v0, without the group's generation, so KIP-447's fencing is not available).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import structlog
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from consumers.messages import Partition
from consumers.publish.commit_markers import unmarked

log = structlog.get_logger("kev.consumers.publish.transactions")

REDO_TRIES = 3  # how often a transaction's records are sent again at most (acked without an offset, or unmarked)


def transactional_id(group_id: str, partition: Partition) -> str:
    """One per questions partition of a group: whoever owns the partition next fences its previous owner."""
    return f"{group_id}/{partition.topic}/{partition.partition}"


@dataclass
class Deferred:
    """An acked record's settlement, in three parts: `ready` before its transaction's offsets are taken (its
    source positions are done), `settle` once the transaction committed (its question answered), `drop`
    when it aborted instead (the question is this worker's no more)."""

    ready: Callable[[], None]
    settle: Callable[[], None]
    drop: Callable[[], None]
    again: Callable[[AIOKafkaProducer], Awaitable[asyncio.Future]]  # send it once more, to the same partition
    placed: TopicPartition  # where it went
    offset: int  # at which offset (-1: the broker did not say)


@dataclass
class Transaction:
    """One owned partition's transactional producer and the transaction it has open."""

    partition: Partition
    producer: AIOKafkaProducer
    began: float | None = None  # monotonic time of the open transaction's first record; None: none open
    records: int = 0  # sent into the open transaction
    in_play: int = 0  # sent and not yet acked or replaced
    deferred: list[Deferred] = field(default_factory=list)
    gone: bool = False  # revoked or failed: nothing more goes into it
    broken: bool = False  # a record of it was not published: abort, its PublishFailed ends the worker
    closed: bool = False  # ended for good: a record acked from now on is settled never
    lock: anyio.Lock = field(default_factory=anyio.Lock)  # one commit at a time
    beginning: anyio.Lock = field(default_factory=anyio.Lock)
    _open: anyio.Event = field(default_factory=anyio.Event)  # set while records may enter
    _idle: anyio.Event = field(default_factory=anyio.Event)  # set when nothing is in play

    def __post_init__(self) -> None:
        self._open.set()
        self._idle.set()

    @property
    def tid(self) -> str:
        return self.producer._txn_manager.transactional_id

    def settle_later(self, deferred: Deferred) -> None:
        """An acked record's settlement, for the commit; dropped at once if the transaction has ended for good."""
        if self.closed:
            deferred.drop()
        else:
            self.deferred.append(deferred)

    def leave(self) -> None:
        """A record sent into this transaction was acked, replaced or given up."""
        self.in_play -= 1
        if self.in_play == 0:
            self._idle.set()

    async def drained(self, timeout: float = float("inf")) -> bool:
        with anyio.move_on_after(timeout):
            await self._idle.wait()
        return self._idle.is_set()

    async def commit(self, positions: dict[Partition, int], group_id: str, window_s: float) -> None:
        """Add the group's `positions` to the open transaction and commit it."""
        # Shielded: aiokafka ends a commit it has begun whoever stops waiting for it, and a caller cancelled
        # mid-commit (the periodic committer at a graceful stop) left `began` set on a producer already READY:
        # the stop's own commit then sent offsets outside any transaction (IllegalOperation) and exited 1.
        with anyio.CancelScope(shield=True), anyio.fail_after(window_s):
            if positions:
                await self.producer.send_offsets_to_transaction(
                    {TopicPartition(*p): at for p, at in positions.items()}, group_id)
            await self.producer.commit_transaction()

    async def redo(self, window_s: float) -> int:
        """A record acked without an offset (the broker counted it a duplicate of one it holds) is not shown to
        be in the log: on Tansu, after a SIGKILL of the broker and of the records' previous producer, the first
        batch of the partition's next producer came back so and was not there. Such a transaction is aborted
        (whatever of it is in the log, readers drop) and its records are sent again in a new one. Returns the
        transactions aborted."""
        for attempt in range(1, REDO_TRIES + 1):
            if not any(deferred.offset < 0 for deferred in self.deferred):
                return attempt - 1
            log.warning("transaction.redone", transactional_id=self.tid, records=len(self.deferred), attempt=attempt,
                        reason="a record was acknowledged without an offset")
            with anyio.CancelScope(shield=True), anyio.fail_after(window_s):  # as the commit: no half-redo
                await self.producer.abort_transaction()
                await self.producer.begin_transaction()
                self._placed_again(self.deferred, await self._send_again(self.deferred))
        if any(deferred.offset < 0 for deferred in self.deferred):
            raise KafkaError(f"records acknowledged without an offset {REDO_TRIES} times over")
        return REDO_TRIES

    def last_offsets(self, records: list[Deferred] | None = None) -> dict[TopicPartition, int]:
        """Per partition the records (default: the transaction's) went to, the offset of the last."""
        last: dict[TopicPartition, int] = {}
        for deferred in self.deferred if records is None else records:
            last[deferred.placed] = max(last.get(deferred.placed, -1), deferred.offset)
        return last

    async def mend(self, positions: dict[Partition, int], group_id: str, window_s: float) -> int:
        """Make good a commit that the broker answered without writing its marker after the records
        (commit_markers.py). Returns the transactions aborted."""
        for attempt in range(1, REDO_TRIES + 2):
            if not (missing := await unmarked(self.producer, self.last_offsets())):
                return attempt - 1
            if attempt > REDO_TRIES:
                raise KafkaError(f"records without their commit marker {REDO_TRIES} times over")
            log.warning("transaction.unmarked", transactional_id=self.tid, attempt=attempt,
                        partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in missing))
            await self._mend(missing, positions, group_id, window_s)
        return REDO_TRIES

    async def _mend(self, partitions: set[TopicPartition], positions: dict[Partition, int], group_id: str,
                    window_s: float) -> None:
        """Abort the records on `partitions` together with copies of them (the abort marker decides both), then
        send them once more in a transaction that commits, with the positions again. Where the marker only
        came late (it has by the time the copies' transaction is open), just the copies are aborted."""
        mending = [deferred for deferred in self.deferred if deferred.placed in partitions]
        first = self.last_offsets(mending)
        with anyio.CancelScope(shield=True), anyio.fail_after(window_s):
            await self.producer.begin_transaction()
            await self._send_again(mending)  # the copies, to be aborted: the originals' offsets stay
            still = await unmarked(self.producer, first, wait_s=0.0)
            await self.producer.abort_transaction()
            resent = [deferred for deferred in mending if deferred.placed in still]
            for _ in range(REDO_TRIES if resent else 0):
                await self.producer.begin_transaction()
                offsets = await self._send_again(resent)
                if min(offsets) < 0:  # no telling where it went (see redo): aborted, sent once more
                    await self.producer.abort_transaction()
                    continue
                await self.commit(positions, group_id, window_s)
                self._placed_again(resent, offsets)
                return
            if resent:
                raise KafkaError(f"records sent again were acknowledged without an offset {REDO_TRIES} times over")

    async def _send_again(self, records: list[Deferred]) -> list[int]:
        """Each record once more, into the open transaction; the offsets they got."""
        pending = [await deferred.again(self.producer) for deferred in records]
        return [(await ack).offset for ack in pending]

    @staticmethod
    def _placed_again(records: list[Deferred], offsets: list[int]) -> None:
        for deferred, offset in zip(records, offsets):
            deferred.offset = offset

    def reset(self) -> None:
        """No transaction open: the next record begins one."""
        self.began, self.records, self.deferred = None, 0, []
