"""Who asked: the principal, Kev's one notion of a question's owner.

A principal is the key that signed the question (its verified key id, or "unsigned") and the tenant it
names. Deduplication, scheduling, compile budgets and the gateway all key on it; neither part alone is
enough: the gateway signs every tenant's questions with one key, and an unsigned producer may write any
tenant name (the trust gate clears it, so every unsigned question is the one anonymous principal).
"""

from __future__ import annotations

from typing import NamedTuple

UNSIGNED = "unsigned"


class Principal(NamedTuple):
    key_id: str  # the verified key id, or UNSIGNED
    tenant: str | None

    @property
    def signed(self) -> bool:
        return self.key_id != UNSIGNED

    def __str__(self) -> str:
        return f"{self.key_id}/{self.tenant or '-'}"


ANONYMOUS = Principal(UNSIGNED, None)


def principal_of(key_id: str | None, tenant: str | None) -> Principal:
    """The principal of a question signed by `key_id` (None: not signed, or not verified) naming `tenant`;
    an unsigned question's tenant does not count (nobody vouched for it)."""
    return ANONYMOUS if key_id is None else Principal(key_id, tenant)
