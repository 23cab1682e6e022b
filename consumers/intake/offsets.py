"""Which source offsets may be committed: at-least-once bookkeeping, pure Python.

A record is tracked when it is fetched and marked done when its outcome (answer, error answer or
dead letter) has been acked by the broker. A partition's commit position is `offset + 1` of the
last record such that it and every earlier tracked record on that partition are done; a later
record finishing first does not move it. Positions only move forward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from consumers.messages import Partition


class OffsetRegression(RuntimeError):
    """An offset or commit position went backwards within one assignment: a bug, never ignored."""


@dataclass
class _PartitionState:
    pending: deque[int] = field(default_factory=deque)  # tracked, not yet committable, in fetch order
    outstanding: set[int] = field(default_factory=set)  # tracked and not yet done
    finished: set[int] = field(default_factory=set)  # done, but behind an unfinished earlier offset
    position: int | None = None  # next offset to commit (last contiguous done + 1)
    committed: int | None = None  # last position the broker accepted


class OffsetTracker:
    """Per partition: offsets in flight, offsets done, and the position safe to commit."""

    def __init__(self) -> None:
        self._partitions: dict[Partition, _PartitionState] = {}

    def track(self, partition: Partition, offset: int) -> None:
        """A record was fetched; its offset must exceed every offset tracked before on the partition."""
        state = self._partitions.setdefault(Partition(*partition), _PartitionState())
        last = state.pending[-1] if state.pending else (state.position or 0) - 1
        if offset <= last:
            raise OffsetRegression(f"{partition}: offset {offset} tracked after {last}")
        state.pending.append(offset)
        state.outstanding.add(offset)

    def done(self, partition: Partition, offset: int) -> bool:
        """The record's outcome was acked. False when it is not in flight (forgotten or already done)."""
        state = self._partitions.get(Partition(*partition))
        if state is None or offset not in state.outstanding:
            return False
        state.outstanding.remove(offset)
        state.finished.add(offset)
        while state.pending and state.pending[0] in state.finished:
            head = state.pending.popleft()
            state.finished.remove(head)
            self._advance(partition, state, head + 1)
        return True

    def committable(self) -> dict[Partition, int]:
        """Positions (`offset + 1`) that moved past what was last committed, per partition."""
        return {
            partition: state.position
            for partition, state in self._partitions.items()
            if state.position is not None and state.position != state.committed
        }

    def mark_committed(self, positions: Mapping[Partition, int]) -> None:
        """The broker accepted these positions; a position behind the last one raises."""
        for partition, position in positions.items():
            state = self._partitions.get(Partition(*partition))
            if state is None:
                continue  # revoked while the commit was in flight
            if state.committed is not None and position < state.committed:
                raise OffsetRegression(f"{partition}: commit {position} after {state.committed}")
            state.committed = position

    def forget(self, partitions: Iterable[Partition]) -> dict[Partition, int]:
        """Drop revoked partitions' state; returns their positions still to commit."""
        out = {}
        for partition in partitions:
            state = self._partitions.pop(Partition(*partition), None)
            if state is not None and state.position is not None and state.position != state.committed:
                out[Partition(*partition)] = state.position
        return out

    def in_flight(self) -> int:
        """Tracked records whose outcome is not acked yet, over all partitions."""
        return sum(len(state.outstanding) for state in self._partitions.values())

    def in_flight_at(self, partition: Partition) -> int:
        """Tracked records of one partition whose outcome is not acked yet."""
        state = self._partitions.get(Partition(*partition))
        return 0 if state is None else len(state.outstanding)

    def partitions(self) -> frozenset[Partition]:
        return frozenset(self._partitions)

    @staticmethod
    def _advance(partition: Partition, state: _PartitionState, position: int) -> None:
        if state.position is not None and position < state.position:
            raise OffsetRegression(f"{partition}: position {position} after {state.position}")
        state.position = position
