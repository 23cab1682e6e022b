"""policy auto: how many drafts each question verifies this step, chosen so the step's tokens per second rise.

Plain numbers, no torch. `StepCosts` is a forward's seconds against its rows, measured once when the
engine starts (engine/speculate/probe.py); each question brings the chances of its drafts
(engine/speculate/acceptance.py). A step of R rows does R tokens of useful work (prompt tokens
computed and tokens emitted alike) in T(R) seconds. A question whose first draft token is kept with
probability p, and each later one with q, adds p·q^(j-1) expected tokens with its j-th draft (draft j
counts only if drafts 1..j-1 were kept) and one row. Drafts are added greedily, the likeliest first,
while each draft's expected tokens per second of the time it adds (to the forward and the drafter's
own forwards) beat the step's current rate by MARGIN. In a memory-bound step (T nearly flat in R) a
few rows cost little, so questions with a decent acceptance rate draft; in a compute-bound one (T
proportional to R) a row that yields p < 1 tokens lowers the rate, so nobody drafts.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass

from engine.speculate.acceptance import Odds

# A draft expected to be kept less than once in ten is not verified even when rows look free: the
# table does not see the per-row bookkeeping outside the forward, nor its own noise.
MIN_DRAFT_PROB = 0.1
# A draft must bring its expected tokens at least this much faster than the step's own rate: the table
# is probed on short contexts, where a row's attention is cheap, so it underprices rows of long ones
# (open chat at 16 questions lost 7% when drafts only had to raise the rate at all).
MARGIN = 0.25


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one forward against its rows (rows ascending); linear between measured points and
    beyond the last, made non-decreasing (a noisy probe must not make more rows look cheaper)."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.seconds) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError(f"step costs need ascending distinct rows, one time each: {self.rows}, {self.seconds}")
        object.__setattr__(self, "seconds", tuple(itertools.accumulate(self.seconds, max)))

    def time(self, rows: int) -> float:
        if rows <= 0:
            return 0.0
        xs, ys = self.rows, self.seconds
        i = bisect.bisect_left(xs, rows)
        if i < len(xs) and xs[i] == rows:
            return ys[i]
        if i == 0:
            return ys[0]
        if i == len(xs):  # past the last point: its last segment's slope
            if len(xs) == 1:
                return ys[0]
            i -= 1
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    def summary(self) -> dict:
        """For the start-up log: rows and milliseconds."""
        return {"rows": list(self.rows), "ms": [round(s * 1000, 3) for s in self.seconds]}


def draft_lengths(costs: StepCosts | None, base_rows: int, offers: list[Odds],
                  draft_costs: StepCosts | None = None) -> list[int]:
    """Drafts per question: `offers` the chances of each question's drafts and how many it may take
    (engine/speculate/acceptance.py), in any order; `base_rows` the step's rows without drafts. `draft_costs`: the drafter's own forward against
    its rows (a draft model runs one forward per draft depth, over the questions drafting that deep);
    None for a drafter that costs nothing (prompt lookup). `costs` None: rows count as free."""
    lengths = [0] * len(offers)
    depth_rows: list[int] = []  # questions drafting at least j + 1 tokens
    work = float(max(base_rows, 1))
    extra = 0
    now = _seconds(costs, draft_costs, base_rows, extra, depth_rows)
    queue = [(-offer.first, i) for i, offer in enumerate(offers) if offer.most > 0]
    heapq.heapify(queue)
    while queue:
        gain, i = heapq.heappop(queue)
        gain = -gain
        if gain < MIN_DRAFT_PROB:
            break  # the likeliest draft left is unlikely: so are all the others
        depth = lengths[i]
        if depth == len(depth_rows):
            depth_rows.append(0)
        depth_rows[depth] += 1
        after = _seconds(costs, draft_costs, base_rows, extra + 1, depth_rows)
        if gain * now <= (1 + MARGIN) * work * (after - now):  # not clearly faster: this question stops here
            depth_rows[depth] -= 1
            continue
        lengths[i] += 1
        work, extra, now = work + gain, extra + 1, after
        if lengths[i] < offers[i].most:
            heapq.heappush(queue, (-(gain * offers[i].then), i))
    return lengths


def _seconds(costs: StepCosts | None, draft_costs: StepCosts | None, base_rows: int, extra: int,
             depth_rows: list[int]) -> float:
    if costs is None:
        return 1.0  # nothing measured: only MIN_DRAFT_PROB limits drafts
    forward = costs.time(base_rows + extra)
    if draft_costs is None:
        return forward
    return forward + sum(draft_costs.time(rows) for rows in depth_rows if rows)
