"""Tenants: each principal's weight and quotas, as kev.yaml's `tenants` section names them.

A principal (schemas/principal.py) is who asked: the key that signed a question and the tenant it names.
Fair share and quotas are kept per principal; the rules are looked up by its tenant's name, `default`
for a tenant not named and `anonymous` (else `default`) for unsigned questions. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from schemas.config import ANONYMOUS_TENANT, DEFAULT_TENANT, TenantConfig
from schemas.principal import Principal


def tenant_name(principal: Principal) -> str:
    """The name its rules and its metrics go by: its tenant, or "anonymous" when it names none."""
    return principal.tenant if principal.tenant is not None else ANONYMOUS_TENANT


@dataclass(frozen=True)
class Tenants:
    """kev.yaml's `tenants`: tenant name -> TenantConfig (weight, max_tokens_per_second, max_in_flight)."""

    named: Mapping[str, TenantConfig] = field(default_factory=dict)

    def rules(self, principal: Principal) -> TenantConfig:
        name = tenant_name(principal)
        if name in self.named:
            return self.named[name]
        return self.named.get(DEFAULT_TENANT, _UNLIMITED)

    def weight(self, principal: Principal) -> float:
        return self.rules(principal).weight


_UNLIMITED = TenantConfig()


@dataclass
class TenantCounts:
    """What one tenant got from this worker, for the kev_tenant_* metrics."""

    served: int = 0  # tokens computed for it, prompt and answer
    admitted: int = 0  # questions that joined the batch (first admissions)
    queued_s: float = 0.0  # their time from arrival to admission, summed
    throttled: int = 0  # questions that waited because the tenant was over a quota
    throttled_s: float = 0.0  # that waiting, summed (part of queued_s)
    recent: float = 0.0  # tokens computed, fading with a half-life of RECENT_S: its share of late
    recent_at: float = 0.0

    def serve(self, tokens: int, now: float) -> None:
        self.served += tokens
        self.recent = self.recent_at_time(now) + tokens
        self.recent_at = now

    def recent_at_time(self, now: float) -> float:
        return self.recent * 0.5 ** (max(0.0, now - self.recent_at) / RECENT_S)


RECENT_S = 10.0  # the service share's half-life: what a dashboard refreshed every few seconds shows
