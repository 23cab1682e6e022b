"""Quotas: a tenant's tokens per second and questions in the batch, on this worker (`tenants.<name>`).

A gate on admission, so it holds the same in process and through Kafka: a question whose principal is
over a quota is not admitted, it waits, never fails, and its wait shows in its timings
(`throttled_ms`) and the `kev_tenant_*` metrics. Running questions are never held back (a stream does
not stall), so a long answer may carry its tenant past its rate; later questions then wait until the
bucket has drained. Per worker: N workers admit up to N times a quota. Pure Python.

max_tokens_per_second is a leaky bucket of tokens computed (prompt and answer, as fair share counts
service) that drains at that rate and holds BUCKET_S seconds' worth: a question is admitted while the
bucket is not full.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.schedule.tenants import Tenants
from schemas.principal import Principal

BUCKET_S = 1.0  # a bucket holds this many seconds of a tenant's rate: its burst


@dataclass
class _Bucket:
    level: float = 0.0  # tokens in it
    at: float = 0.0  # when `level` was read


class Quotas:
    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants
        self._buckets: dict[Principal, _Bucket] = {}

    def admits(self, principal: Principal, in_batch: int, now: float) -> bool:
        """Whether a question of `principal` may join the batch, which holds `in_batch` of its questions."""
        rules = self.tenants.rules(principal)
        if rules.max_in_flight is not None and in_batch >= rules.max_in_flight:
            return False
        rate = rules.max_tokens_per_second
        return rate is None or self._drained(principal, rate, now) < rate * BUCKET_S

    def retry_in(self, principal: Principal, now: float) -> float:
        """Seconds until `principal`'s bucket has room again (0: it has room now, or will in an instant)."""
        rate = self.tenants.rules(principal).max_tokens_per_second
        if rate is None:
            return 0.0
        return max(0.0, self._drained(principal, rate, now) - rate * BUCKET_S) / rate

    def charge(self, principal: Principal, tokens: int, now: float) -> None:
        """`tokens` of `principal`'s were computed."""
        rate = self.tenants.rules(principal).max_tokens_per_second
        if rate is None:
            return
        self._buckets[principal].level = self._drained(principal, rate, now) + tokens

    def forget(self, principal: Principal, now: float) -> None:
        """`principal` has nothing in flight: drop its bucket once empty, so principals seen once do not pile up."""
        rate = self.tenants.rules(principal).max_tokens_per_second
        if rate is not None and principal in self._buckets and self._drained(principal, rate, now) == 0.0:
            del self._buckets[principal]

    def _drained(self, principal: Principal, rate: float, now: float) -> float:
        bucket = self._buckets.setdefault(principal, _Bucket(at=now))
        bucket.level = max(0.0, bucket.level - rate * (now - bucket.at))
        bucket.at = now
        return bucket.level
