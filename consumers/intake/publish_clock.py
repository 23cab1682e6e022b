"""When a question was published, by a clock Kev can trust.

A question's deadline counts from its record's timestamp (CreateTime: the producer's clock), so that a
question whose caller gave up during a backlog is not computed for nobody. But a producer whose clock
runs behind the workers' makes every fresh question look old: a gateway 70 s behind expired every
60 s question uncomputed. Both look the same in one timestamp; where the record sits in its partition
tells them apart:

- a record fetched at the head of its partition (fewer than `head_records` behind the highwater the
  broker reported with the fetch) was published moments ago, whatever its stamp says. If its stamp is
  older than its own timeout, the stamp is wrong, not the question late: its deadline counts from its
  arrival here, and the skew is logged (`intake.clock_skew`, at most once a minute) and exported;
- a record deep in a backlog keeps its stamp: older than its timeout, it ends `timeout` uncomputed;
- a stamp from the future counts as now (engine/schedule/deadlines.py), and is logged the same way.

`skew_ms` is the latest apparent skew at the head of a partition (positive: the producer's clock is
behind this worker's); what the Kafka worker's statistics and `kev_kafka_clock_skew_ms` show.
LogAppendTime (a topic setting, the broker's clock) would make all this moot on Apache Kafka; the
embedded Tansu accepts the setting but returns the producer's stamp, so Kev does not rely on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

log = structlog.get_logger("kev.consumers.intake.loop")

FUTURE_TOLERANCE_MS = 1_000  # a producer this much ahead is only a little ahead: not worth a line
LOG_EVERY_S = 60.0


class PublishClock:
    def __init__(self, default_timeout_ms: int | None, *, head_records: int = 64,
                 now_ms: Callable[[], float] = lambda: time.time() * 1000,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.default_timeout_ms = default_timeout_ms
        self.head_records = head_records
        self.now_ms, self.monotonic = now_ms, monotonic
        self.skew_ms = 0.0
        self.untrusted = 0  # questions whose stamp was not believed: their deadline counted from arrival
        self._logged_at = float("-inf")

    def published_ms(self, stamp: int | None, timeout_ms: int | None, lag: int | None) -> int | None:
        """The publish time a question's deadline counts from: its record's `stamp`, or None (from its
        arrival) when the stamp cannot be believed. `lag`: records between it and the partition's
        highwater at its fetch (None: not known)."""
        if stamp is None or stamp < 0:
            return stamp
        age_ms = self.now_ms() - stamp
        at_head = lag is not None and lag < self.head_records
        if at_head:
            self.skew_ms = age_ms
        if age_ms < -FUTURE_TOLERANCE_MS:
            self._say(age_ms, trusted=True)  # counted as now downstream: it buys no extra time
            return stamp
        timeout = timeout_ms or self.default_timeout_ms
        if at_head and timeout and age_ms > timeout:
            self.untrusted += 1
            self._say(age_ms, trusted=False)
            return None
        return stamp

    def _say(self, age_ms: float, *, trusted: bool) -> None:
        if self.monotonic() - self._logged_at < LOG_EVERY_S:
            return
        self._logged_at = self.monotonic()
        behind = "behind" if age_ms > 0 else "ahead of"
        log.warning("intake.clock_skew", skew_ms=round(age_ms), untrusted=self.untrusted,
                    note=f"a producer's clock runs about {abs(age_ms) / 1000:.0f} s {behind} this worker's"
                         + ("" if trusted else "; deadlines of fresh questions count from their arrival"))
