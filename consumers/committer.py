"""Commit what the OffsetTracker says is safe: on an interval, every N settled records, on revocation.

One lock serialises commits, so positions reach the broker in the order the tracker produced them.
A failed commit is logged and retried on the next trigger: the positions stay committable, and if
the partition moved to another worker its records are simply redelivered there (at-least-once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import anyio
import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from consumers.messages import Partition
from consumers.offsets import OffsetTracker

log = structlog.get_logger("kev.consumers.committer")


class Committer:
    def __init__(self, consumer: AIOKafkaConsumer, tracker: OffsetTracker, *, interval_s: float, every: int) -> None:
        self.consumer = consumer
        self.tracker = tracker
        self.interval_s = interval_s
        self.every = every
        self.commits = 0  # successful commit requests
        self._settled_since_commit = 0
        self._lock = anyio.Lock()
        self._due = anyio.Event()

    def settled(self, count: int = 1) -> None:
        """Records' outcomes were acked (call after tracker.done); wakes the loop every `every`."""
        self._settled_since_commit += count
        if self._settled_since_commit >= self.every:
            self._due.set()

    async def run(self) -> None:
        """Commit every `interval_s`, or sooner when `every` records have settled."""
        while True:
            with anyio.move_on_after(self.interval_s):
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
        log.info("committed", positions=_loggable(positions))  # at most ~1/s: the audit trail `kev drill` checks
        return positions


class RevocationListener(ConsumerRebalanceListener):
    """Commits the revoked partitions' finished work; `epoch` tells the fetch loop a rebalance began."""

    def __init__(self, committer: Committer, on_assigned: Callable[[], None] = lambda: None) -> None:
        self.committer = committer
        self.on_assigned = on_assigned
        self.epoch = 0

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self.epoch += 1
        revoked = [Partition(tp.topic, tp.partition) for tp in revoked]
        if revoked:  # the first join "revokes" nothing
            committed = await self.committer.commit_revoked(revoked)
            log.info("partitions_revoked", partitions=len(revoked), committed=_loggable(committed))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        assigned = sorted(assigned)
        log.info("partitions_assigned", partitions=[f"{tp.topic}:{tp.partition}" for tp in assigned])
        self.on_assigned()


def _loggable(positions: dict[Partition, int]) -> dict[str, int]:
    return {f"{p.topic}:{p.partition}": position for p, position in positions.items()}
