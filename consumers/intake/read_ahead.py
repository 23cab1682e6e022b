"""The read-ahead window of each questions partition (`kafka.read_ahead`): at most `size` records of a
partition in flight (handed to the engine or answered, their outcome not yet acked). Records a fetch
brought past a partition's window are held here, in offset order, and go in as answers settle the
partition's records, without asking the broker again: a freed place is taken within the event loop's
turn, not a fetch round trip later (the embedded Tansu holds every fetch for its whole
`fetch_max_wait_ms`: refilled by fetching, a backlogged partition would go at one window per wait).

While a partition holds records the intake leaves it out of its fetches: its next records wait in
aiokafka's buffer, which is not fetched past until they are taken, so beyond its window a worker holds
a partition's held records (at most one poll's `max_records`) and one fetch, and the next records are
already here when they are due. Held records are not
tracked (offsets.py), so no commit passes them; a rebalance drops them, and their partition is read
again from its committed position.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import anyio
from aiokafka.structs import ConsumerRecord, TopicPartition

from consumers.intake.offsets import OffsetTracker


class ReadAhead:
    def __init__(self, tracker: OffsetTracker, size: int | None) -> None:
        self.tracker = tracker
        self.size = size  # None: no window (the inbox's watermarks alone bound the intake)
        self.held: dict[TopicPartition, deque[tuple[ConsumerRecord, float]]] = {}
        self.epoch = 0  # the rebalance epoch (RevocationListener.epoch) the held records were fetched in
        self.freed = anyio.Event()  # set when a record of a holding partition settles

    def has_room(self, partition: TopicPartition) -> bool:
        """Whether `partition` has fewer than `size` records in flight."""
        return self.size is None or self.tracker.in_flight_at(partition) < self.size

    def admits(self, partition: TopicPartition) -> bool:
        """Whether a record of `partition` just fetched may go in now: room, and no older record held."""
        return partition not in self.held and self.has_room(partition)

    def hold(self, record: ConsumerRecord, fetched_at: float, epoch: int) -> None:
        """Keep `record`, fetched under rebalance `epoch`, until its partition has room."""
        self._drop_stale(epoch)
        partition = TopicPartition(record.topic, record.partition)
        self.held.setdefault(partition, deque()).append((record, fetched_at))

    def holding(self) -> set[TopicPartition]:
        return set(self.held)

    def ready(self) -> Iterator[tuple[ConsumerRecord, float]]:
        """Held records whose partition has room, oldest first, each taken off as it is yielded (the
        caller tracks it before asking for the next, so the room is counted right)."""
        for partition in list(self.held):
            records = self.held[partition]
            while records and self.has_room(partition):
                record = records.popleft()
                if not records:
                    del self.held[partition]  # before the yield: the caller may stop taking
                yield record

    def rearm(self, epoch: int) -> None:
        """A new poll: forget a settle already seen, and drop what an earlier assignment held."""
        self.freed = anyio.Event()
        self._drop_stale(epoch)

    def _drop_stale(self, epoch: int) -> None:
        """Held records of an earlier epoch are dropped: the rebalance since reset their partitions'
        positions to the committed ones, so they are fetched again."""
        if epoch != self.epoch:
            self.held.clear()
            self.epoch = epoch

    def settled(self, partition: TopicPartition) -> None:
        """A record of `partition` has its outcome: a held one may go in."""
        if partition in self.held:
            self.freed.set()
