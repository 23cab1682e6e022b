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
from aiokafka import AIOKafkaProducer, TopicPartition

from consumers.messages import Partition


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
    unverified: bool = False  # a record was acked without an offset: it may not be in the log (see send_again)
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

    async def send_again(self, window_s: float) -> None:
        """Abort the open transaction and send its records once more in a new one; `unverified` afterwards
        says whether a record came back acked without an offset again (Transactions._redo says why)."""
        with anyio.CancelScope(shield=True), anyio.fail_after(window_s):  # as the commit: no half-redo
            await self.producer.abort_transaction()
            await self.producer.begin_transaction()
            pending = [await deferred.again(self.producer) for deferred in self.deferred]
            acks = [await ack for ack in pending]
        self.unverified = any(ack.offset < 0 for ack in acks)

    def reset(self) -> None:
        """No transaction open: the next record begins one."""
        self.began, self.records, self.deferred = None, 0, []
