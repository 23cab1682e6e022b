"""When to stop fetching: pause at a high watermark of the engine's inbox, resume at a low one.

The gap between the two keeps a busy engine from flapping the consumer between paused and
running on every message.
"""

from __future__ import annotations

import math


class Watermarks:
    def __init__(self, high: int, low: int) -> None:
        if not 0 <= low < high:
            raise ValueError(f"watermarks need 0 <= low < high, got low={low} high={high}")
        self.high = high
        self.low = low
        self.paused = False

    @classmethod
    def for_buffer(cls, max_buffer_size: float, high: int | None = None, low: int | None = None) -> "Watermarks":
        """Defaults: pause when the inbox is full, resume when it is half empty."""
        if math.isinf(max_buffer_size):
            raise ValueError("the questions stream must be bounded (max_buffer_size is infinite)")
        size = int(max_buffer_size)
        high = high if high is not None else max(size, 1)
        low = low if low is not None else min(size // 2, high - 1)
        return cls(high, low)

    def update(self, used: int) -> bool:
        """Feed the inbox's current depth; returns whether fetching should be paused."""
        if self.paused and used <= self.low:
            self.paused = False
        elif not self.paused and used >= self.high:
            self.paused = True
        return self.paused
