"""Channels: the batch's places (router.max_parallel_queries). A running question holds one; the lowest free
channel is taken first, so the audit's channel numbers stay small and reused. Pure Python."""

from __future__ import annotations

import heapq


class Channels:
    def __init__(self, count: int) -> None:
        self._free = list(range(count))  # a heap

    def take(self) -> int:
        return heapq.heappop(self._free)

    def give(self, channel: int) -> None:
        heapq.heappush(self._free, channel)
