"""Commit what the OffsetTracker says is safe: soon after records settle, and on revocation.

Promptly, because whatever is acked but not committed is answered twice if the worker dies: a
commit follows a settle by at most `debounce_s` (settles close together share one commit), at once
when `every` have settled, and otherwise every `interval_s` if anything is left.

One lock serialises commits, so positions reach the broker in the order the tracker produced them.
A failed commit is logged and retried on the next trigger: the positions stay committable, and if
the partition moved to another worker its records are simply redelivered there (at-least-once).

The RevocationListener also says which partitions are this worker's now (`owns_now`, or `owns` to
wait out a rebalance), so an answer that finishes after its partition moved to another worker can be
left to that worker (no duplicate).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

import anyio
import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from consumers.messages import Partition
from consumers.intake.offsets import OffsetTracker

log = structlog.get_logger("kev.consumers.intake.committer")


class Committer:
    def __init__(self, consumer: AIOKafkaConsumer, tracker: OffsetTracker, *, interval_s: float, every: int,
                 debounce_s: float = 0.05) -> None:
        self.consumer = consumer
        self.tracker = tracker
        self.interval_s = interval_s
        self.every = every
        self.debounce_s = debounce_s
        self.commits = 0  # successful commit requests
        self._settled_since_commit = 0
        self._lock = anyio.Lock()
        self._due = anyio.Event()

    def settled(self, count: int = 1) -> None:
        """Records' outcomes were acked (call after tracker.done): a commit follows shortly."""
        self._settled_since_commit += count
        self._due.set()

    async def run(self) -> None:
        """Commit `debounce_s` after a settle (at once after `every`), and every `interval_s` regardless."""
        while True:
            with anyio.move_on_after(self.interval_s):
                await self._due.wait()
            if self._due.is_set() and self._settled_since_commit < self.every:
                with anyio.move_on_after(self.debounce_s):  # let settles close together share a commit
                    while self._settled_since_commit < self.every:
                        self._due = anyio.Event()
                        await self._due.wait()
            self._due = anyio.Event()
            await self.commit()

    async def commit(self) -> dict[Partition, int]:
        """Commit every committable position now; returns what the broker accepted."""
        async with self._lock:
            return await self._commit(self.tracker.committable())

    async def commit_revoked(self, partitions: Iterable[Partition]) -> dict[Partition, int]:
        """Commit what is done on partitions being revoked, then forget their in-flight records."""
        async with self._lock:
            return await self._commit(self.tracker.forget(partitions))

    async def assigned(self, partitions: Iterable[Partition]) -> None:
        """Nothing to prepare for new partitions (exactly_once's Transactions starts their producers here)."""

    async def _commit(self, positions: dict[Partition, int]) -> dict[Partition, int]:
        self._settled_since_commit = 0
        if not positions:
            return {}
        try:
            await self.consumer.commit({TopicPartition(*p): position for p, position in positions.items()})
        except KafkaError as error:
            log.warning("commit_failed", error=repr(error), positions=_loggable(positions))
            return {}
        self.tracker.mark_committed(positions)
        self.commits += 1
        log.info("committed", positions=_loggable(positions))  # the audit trail `kev drill` checks
        return positions


class RevocationListener(ConsumerRebalanceListener):
    """Commits the revoked partitions' finished work; `epoch` tells the fetch loop a rebalance began.
    `committer` is a Committer, or exactly_once's Transactions (consumers/publish/transactions.py), which also
    starts each assigned partition's transactional producer before its first fetch.

    `before_commit` (the publisher's wait for its acks in flight, bounded) runs first, so an answer
    sent just before the revocation is committed with it instead of answered again by the next owner.
    """

    def __init__(self, committer: Committer, on_assigned: Callable[[], None] = lambda: None,
                 *, ownership_wait_s: float = 30.0) -> None:
        self.committer = committer
        self.on_assigned = on_assigned
        self.before_commit: Callable[[], Awaitable[None]] | None = None
        self.ownership_wait_s = ownership_wait_s
        self.epoch = 0
        self._assigned: frozenset[Partition] = frozenset()
        self._stable = anyio.Event()  # set while an assignment is in force, clear during a rebalance

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self.epoch += 1
        if self._stable.is_set():  # else a rebalance is already in progress: its waiters keep their event
            self._stable = anyio.Event()
        revoked = [Partition(tp.topic, tp.partition) for tp in revoked]
        if revoked:  # the first join "revokes" nothing
            if self.before_commit is not None:
                await self.before_commit()
            committed = await self.committer.commit_revoked(revoked)
            log.info("partitions_revoked", partitions=[f"{p.topic}:{p.partition}" for p in revoked],
                     committed=_loggable(committed))  # read by `kev drill` (late acks after a revocation)

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        assigned = sorted(assigned)
        self._assigned = frozenset(Partition(tp.topic, tp.partition) for tp in assigned)
        await self.committer.assigned(self._assigned)
        self._stable.set()
        log.info("partitions_assigned", partitions=[f"{tp.topic}:{tp.partition}" for tp in assigned])
        self.on_assigned()

    def owns_now(self, partition: Partition) -> bool | None:
        """Whether `partition` is this worker's, or None while a rebalance is under way (no waiting:
        the publisher defers only the answers that need to know)."""
        if not self._stable.is_set():
            return None
        return Partition(*partition) in self._assigned

    async def owns(self, partition: Partition) -> bool:
        """Whether `partition` is this worker's; during a rebalance, waits (bounded) for its outcome.
        True when still unknown after the wait: answering twice is better than not at all."""
        with anyio.move_on_after(self.ownership_wait_s):
            await self._stable.wait()
        return not self._stable.is_set() or Partition(*partition) in self._assigned


def _loggable(positions: dict[Partition, int]) -> dict[str, int]:
    return {f"{p.topic}:{p.partition}": position for p, position in positions.items()}
