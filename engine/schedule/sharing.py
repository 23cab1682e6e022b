"""Sharing: the principals who share the engine, and what each gets.

It keeps each principal's service (fair_share.py: the counter policy fair orders by), its tenant's quotas
(quotas.py) and each tenant's counts for the kev_tenant_* metrics. The scheduler tells it what happens to
a question (it arrives, waits over a quota, is admitted, is computed, ends); it answers who goes first,
who may be preempted, and who may not join yet. Pure Python.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from engine.schedule.admission_order import ORDER, admission_order, due
from engine.schedule.fair_share import FairShare, Lanes, overserved
from engine.schedule.light_pace import LightPace
from engine.schedule.quotas import Quotas
from engine.schedule.step_cost import StepCost
from engine.schedule.tenants import TenantCounts, Tenants, tenant_name
from engine.sequence import Sequence
from schemas import SchedulingPolicy
from schemas.principal import Principal


class Sharing:
    def __init__(self, tenants: Tenants, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self.fair = FairShare(tenants)  # service is counted under every policy: the metrics show it
        self.quotas = Quotas(tenants)
        self.counts: dict[str, TenantCounts] = {}  # by tenant name
        self._live: Counter = Counter()  # questions waiting or running, by principal
        self._at_step_start: dict[Principal, float] = {}  # counters as this step began (open_step)
        self._prompt_ceiling: float | None = None  # prompts of principals served more than this wait
        self._pace: LightPace | None = None  # this step's rows for the backlogged beside a light principal

    @property
    def fair_policy(self) -> bool:
        return self.policy == "fair"

    # -- what happens to a question --------------------------------------------------------------------
    def arrive(self, seq: Sequence) -> None:
        if not self._live[seq.principal]:
            self.fair.join(seq.principal, +self._live)
        self._live[seq.principal] += 1

    def depart(self, seq: Sequence, now: float) -> None:
        """`seq` left the waiting queue or the batch for good."""
        self._unthrottle(seq, now)
        self._live[seq.principal] -= 1
        if not self._live[seq.principal]:
            del self._live[seq.principal]
            self.fair.leave(seq.principal, self._live)
            self.quotas.forget(seq.principal, now)

    def computed(self, seq: Sequence, tokens: int, now: float) -> None:
        self.fair.charge(seq.principal, tokens)
        self.quotas.charge(seq.principal, tokens, now)
        self._counts(seq).serve(tokens, now)

    def report(self, running: list[Sequence], waiting: list[Sequence], now: float) -> dict[str, dict]:
        """Per tenant: its counts, its questions running and waiting, and its share of the recent service.
        Safe to call from another thread than the one stepping (it reads copies)."""
        counts = dict(self.counts)
        recent = {name: c.recent_at_time(now) for name, c in counts.items()}
        total = sum(recent.values()) or 1.0
        report = {name: {**vars(c), "share": recent[name] / total, "running": 0, "waiting": 0}
                  for name, c in counts.items()}
        for state, seqs in (("running", list(running)), ("waiting", list(waiting))):
            for seq in seqs:
                entry = report.setdefault(tenant_name(seq.principal), {**vars(TenantCounts()), "share": 0.0,
                                                                      "running": 0, "waiting": 0})
                entry[state] += 1
        return report

    def admits(self, seq: Sequence, running: list[Sequence], now: float) -> bool:
        """Whether its tenant's quotas let `seq` join the batch now; if not, its throttled time runs."""
        in_batch = sum(s.principal == seq.principal for s in running)
        if self.quotas.admits(seq.principal, in_batch, now):
            self._unthrottle(seq, now)
            return True
        if seq.throttled_since is None:
            seq.throttled_since = now
            self._counts(seq).throttled += 1
        return False

    def admitted(self, seq: Sequence, now: float) -> None:
        """`seq` joined the batch for the first time."""
        counts = self._counts(seq)
        counts.admitted += 1
        counts.queued_s += max(0.0, now - seq.arrival)

    def retry_in(self, waiting: Iterable[Sequence], now: float) -> float:
        """Seconds until a tenant over its token rate may admit one of `waiting` again (0: one may now)."""
        return min((self.quotas.retry_in(seq.principal, now) for seq in waiting), default=0.0)

    # -- who goes first --------------------------------------------------------------------------------
    def open_step(self, running: list[Sequence], waiting: list[Sequence], costs: StepCost) -> None:
        """Policy fair: while a less-served principal's question decodes, a more-served one's prompts wait, so
        their prefill never slows that stream (counters as the step starts), and beside a light principal
        the backlogged ones' rows are paced (light_pace.py)."""
        self._at_step_start = dict(self.fair.counters)
        decoding = [self._at_step_start.get(s.principal, 0.0) for s in running if s.decoding]
        self._prompt_ceiling = min(decoding) if self.fair_policy and decoding else None
        self._pace = LightPace(costs, self._at_step_start, running, waiting) if self._prompt_ceiling is not None \
            else None

    def may_step(self, seq: Sequence) -> bool:
        """Whether a running question gets a row in this step (policy fair paces some beside a light one)."""
        return self._pace is None or self._pace.allows(seq)

    def may_prefill(self, seq: Sequence) -> bool:
        return self._prompt_ceiling is None or self._at_step_start.get(seq.principal, 0.0) <= self._prompt_ceiling

    def keep_order(self, seq: Sequence) -> tuple:
        """Running questions, most important first (the step's tokens go to them first); fair: the
        least-served principal first."""
        if self.fair_policy:
            return self.fair.counter(seq.principal), -seq.priority, due(seq), seq.arrival
        return -seq.priority, seq.arrival

    def victim_order(self, seq: Sequence) -> tuple:
        """The largest is preempted first: the least important and newest; fair: the most-served principal's
        least important question, and of those the one cheapest to recompute."""
        if self.fair_policy:
            return self.fair.counter(seq.principal), -seq.priority, -seq.num_computed_tokens, seq.arrival
        return self.keep_order(seq)

    def lanes(self, waiting: list[Sequence], running: list[Sequence], length_aware: bool) -> Lanes:
        """Waiting questions in the order they are offered a place: fair, the least-served principal's next
        (each principal's own by priority, then deadline); else the policy's one queue."""
        if not self.fair_policy:
            lanes = Lanes(lambda _: 0.0)
            lanes.add(None, admission_order(waiting, running, self.policy, length_aware))
            return lanes
        by_principal: dict[Principal, list[Sequence]] = {}
        for seq in waiting:
            by_principal.setdefault(seq.principal, []).append(seq)
        lanes = Lanes(self.fair.counter)
        for principal, mine in by_principal.items():
            lanes.add(principal, admission_order(mine, running, "fair", length_aware))
        return lanes

    def hungry(self, waiting: list[Sequence]) -> list[Principal]:
        """Principals with waiting questions, the least served first."""
        return sorted(dict.fromkeys(s.principal for s in waiting), key=self.fair.counter)

    def giver(self, channels: Counter, hungry: Principal) -> Principal | None:
        """Whom `hungry` may take a channel from (fair_share.overserved), if it had not been served more as the
        step began."""
        giver = overserved(channels, hungry, self.fair.weight)
        if giver is None or self._at_step_start.get(hungry, 0.0) > self._at_step_start.get(giver, 0.0):
            return None
        return giver

    @staticmethod
    def first_of(principal: Principal, waiting: list[Sequence]) -> list[Sequence]:
        """`principal`'s waiting questions in the order it would have them admitted."""
        return sorted((s for s in waiting if s.principal == principal), key=ORDER["fair"])

    # -- helpers ---------------------------------------------------------------------------------------
    def _unthrottle(self, seq: Sequence, now: float) -> None:
        if seq.throttled_since is not None:
            waited = max(0.0, now - seq.throttled_since)
            seq.throttled_s += waited
            self._counts(seq).throttled_s += waited
            seq.throttled_since = None

    def _counts(self, seq: Sequence) -> TenantCounts:
        return self.counts.setdefault(tenant_name(seq.principal), TenantCounts())
