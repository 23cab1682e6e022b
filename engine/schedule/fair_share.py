"""Fair share across principals (scheduler.policy fair): the virtual token counter of VTC ("Fairness in
Serving Large Language Models", OSDI 2024).

Each principal's counter is the service it received, tokens prefilled and decoded, over its tenant's
weight. The scheduler serves the least-served principal first (its running prompts, then its
admissions), so while two principals have work each gets its weighted share; alone, a principal gets
everything. A principal that comes back from idle is lifted to the least-served busy principal's
counter (or to the last one's to go idle), so time spent idle banks no credit.

The counter decides the order of tokens; channels (router.max_parallel_queries) are held for a whole
answer, so a principal that holds the whole batch would keep a newcomer waiting until its answers end.
`overserved` names whom to preempt for a principal below its weighted share of the channels: only
while moving one channel keeps the newcomer at or below the one it is taken from, so it never swings
back. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator

from engine.schedule.tenants import Tenants
from engine.sequence import Sequence
from schemas.principal import Principal


class FairShare:
    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants
        self.counters: dict[Principal, float] = {}  # tokens served / weight, lifted on return from idle
        self._idle_floor = 0.0  # the counter of the last principal to go idle while nobody else had work

    def weight(self, principal: Principal) -> float:
        return self.tenants.weight(principal)

    def counter(self, principal: Principal) -> float:
        return self.counters.get(principal, 0.0)

    def join(self, principal: Principal, busy: Iterable[Principal]) -> None:
        """`principal` has work again, beside the `busy` ones: no credit for its idle time."""
        others = [self.counter(p) for p in busy if p != principal]
        floor = min(others) if others else self._idle_floor
        self.counters[principal] = max(self.counter(principal), floor)

    def leave(self, principal: Principal, busy: Iterable[Principal]) -> None:
        """`principal` has nothing left in flight; forgotten when it is owed nothing."""
        others = [self.counter(p) for p in busy if p != principal]
        if not others:
            self._idle_floor = max(self._idle_floor, self.counter(principal))
        elif self.counter(principal) <= min(others):  # it would be lifted to at least this anyway on return
            self.counters.pop(principal, None)

    def charge(self, principal: Principal, tokens: int) -> None:
        self.counters[principal] = self.counter(principal) + tokens / self.weight(principal)


def overserved(channels: dict[Principal, int], hungry: Principal,
               weight: Callable[[Principal], float]) -> Principal | None:
    """The principal to take one channel from for `hungry`, a principal with waiting work: the one holding the
    most channels per weight, if moving one keeps `hungry` at or below it; None when shares are even."""
    held = {p: n for p, n in channels.items() if p != hungry and n > 0}
    if not held:
        return None
    richest = max(held, key=lambda p: held[p] / weight(p))
    if (channels.get(hungry, 0) + 1) / weight(hungry) <= (held[richest] - 1) / weight(richest):
        return richest
    return None


class Lanes:
    """One step's admissions, lane by lane: the lane whose `level` is lowest offers its next question.
    Fair: a lane per principal, levelled by its counter, which each chunk planned raises; else one lane."""

    def __init__(self, level: Callable[[Hashable], float]) -> None:
        self._level = level
        self._heads: dict[Hashable, Sequence] = {}
        self._rest: dict[Hashable, Iterator[Sequence]] = {}

    def add(self, key: Hashable, seqs: Iterable[Sequence]) -> None:
        rest = iter(seqs)
        head = next(rest, None)
        if head is not None:
            self._heads[key], self._rest[key] = head, rest

    def __iter__(self) -> Iterator[Sequence]:
        while self._heads:
            key = min(self._heads, key=self._level)
            yield self._heads[key]
            following = next(self._rest[key], None)  # only now: a lane may order itself by what was admitted
            if following is None:
                del self._heads[key], self._rest[key]
            else:
                self._heads[key] = following
