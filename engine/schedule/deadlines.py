"""A question's deadline counts from when it was published, not from when a worker got to it.

After a backlog, a question whose caller gave up long ago would otherwise be computed in full for
nobody. The publish time is a wall-clock instant (a Kafka record's timestamp, ms since the epoch);
the engine's clock is time.monotonic(), so the publish time is carried over as an age.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def published_at(published_ms: int | None, *, wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic) -> float | None:
    """The `clock` instant of a wall-clock publish time, never later than now.

    A producer whose clock runs ahead (or that stamps a future time on purpose) must not extend its
    own deadline, so a future timestamp counts as "published now". None or a negative timestamp
    (Kafka's "no timestamp") gives None: the deadline then counts from the question's arrival.
    """
    if published_ms is None or published_ms < 0:
        return None
    age_s = max(0.0, wall() - published_ms / 1000)
    return clock() - age_s


def deadline(start: float, timeout_ms: int | None) -> float | None:
    """`start` + the timeout, on the same clock; None when there is no timeout."""
    return start + timeout_ms / 1000 if timeout_ms else None


def expired_message(start: float, arrival: float, timeout_ms: int, now: float) -> str:
    """Why a question was not computed, with the numbers a caller needs to see what happened."""
    waited_ms = (now - start) * 1000
    before_ms = (arrival - start) * 1000
    return (f"the question's deadline (timeout_ms={timeout_ms}, counted from its publish time) passed "
            f"before it reached the engine: it was published {waited_ms:.0f} ms ago and reached this worker "
            f"{before_ms:.0f} ms after publishing; it was not computed")
