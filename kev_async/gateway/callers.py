"""Who is asking, and how much of the gateway they may hold at once.

A caller with an API key is its key's tenant: its questions share the tenant's prefix cache, so
`cached_tokens` tells it about its own tenant's traffic only. An anonymous caller gets a fresh random
cache_salt on every request, so no two anonymous requests share a prefix block and none can learn what
another sent; it is told `cached_tokens: 0`. Kev's audit (worker, blocks, batch sizes) goes only to
tenants listed in gateway.audit_tenants. A request takes its tenant's slot from its headers alone, before
its body is read or anything compiled, and holds it to its response's last byte.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from kev_async.gateway.errors import ApiError
from kev_async.gateway.slot_table import SlotTable
from schemas import GatewayConfig

RETRY_AFTER_S = 1  # a slot frees as soon as any answer in flight comes back


@dataclass(frozen=True)
class Caller:
    tenant: str | None  # None: anonymous
    audit: bool = False  # may see the x-kev-audit header

    @property
    def anonymous(self) -> bool:
        return self.tenant is None

    def cache_salt(self) -> str | None:
        """A new salt per anonymous request (its prefix blocks are its own); none for a tenant."""
        return secrets.token_hex(16) if self.anonymous else None


def caller_of(tenant: str | None, cfg: GatewayConfig) -> Caller:
    return Caller(tenant, audit=tenant is not None and tenant in cfg.audit_tenants)


def new_question_id(prefix: str) -> str:
    """128 random bits: nobody can guess (and so cancel or look for) another request's question."""
    return f"{prefix}-{secrets.token_hex(16)}"


class TenantSlots:
    """At most `limit` requests in flight per tenant; the next one gets a 429 with Retry-After. Counted in this
    process, or in a SlotTable every process of `--processes N` shares."""

    def __init__(self, limit: int, table: SlotTable | None = None) -> None:
        self.limit = limit
        self._table = table
        self._held: dict[str | None, int] = {}  # None: every anonymous caller, together

    def take(self, tenant: str | None) -> "_Slot":
        if not self._admit(tenant):
            who = "anonymous callers" if tenant is None else "your API key's tenant"
            raise ApiError(429, f"Too many requests in flight for {who} (at most {self.limit}); "
                                f"retry after {RETRY_AFTER_S} s.",
                           code="rate_limit_exceeded", headers={"retry-after": str(RETRY_AFTER_S)})
        return _Slot(self, tenant)

    def _admit(self, tenant: str | None) -> bool:
        if self._table is not None:
            return self._table.take(tenant, self.limit)
        held = self._held.get(tenant, 0)
        if held >= self.limit:
            return False
        self._held[tenant] = held + 1
        return True

    def _release(self, key: str | None) -> None:
        if self._table is not None:
            self._table.release(key)
            return
        left = self._held[key] - 1
        if left:
            self._held[key] = left
        else:
            del self._held[key]


class _Slot:
    """A taken slot, given back once on leaving the `with` block."""

    def __init__(self, slots: TenantSlots, key: str | None) -> None:
        self._slots, self._key = slots, key
        self._released = False

    def __enter__(self) -> "_Slot":
        return self

    def __exit__(self, *_exc) -> None:
        if not self._released:
            self._released = True
            self._slots._release(self._key)
