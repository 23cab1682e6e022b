"""When the next step runs: at once while anyone is computing, else after a short window for company.

An idle engine that gets one question holds its first step up to `batch_window_s` from the oldest
arrival, so questions arriving together share their prefill; it does not wait when the waiting
questions fill a step already, nor past a tenant's quota (which may hold the step longer).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.schedule.limits import SchedulerLimits
from engine.schedule.sharing import Sharing
from engine.sequence import Sequence


def seconds_to_hold(waiting: list[Sequence], busy: bool, sharing: Sharing, limits: SchedulerLimits,
              clock: Callable[[], float]) -> float | None:
    """Seconds to hold the next step for company, or for a tenant's quota; 0 = step now, None = idle
    until an arrival. `busy`: questions are running, lingering or have endings to report."""
    if busy:
        return 0.0
    if not waiting:
        return None
    now = clock()
    throttled = sharing.retry_in(waiting, now)
    if throttled > 0:
        return throttled
    if len(waiting) >= limits.max_parallel_queries or _waiting_fill_a_step(waiting, limits.max_tokens_per_step):
        return 0.0  # company would not join this step: it is full already
    oldest = min(seq.arrival for seq in waiting)
    return max(0.0, oldest + limits.batch_window_s - now)


def _waiting_fill_a_step(waiting: list[Sequence], budget: int) -> bool:
    for seq in waiting:
        budget -= seq.num_uncomputed
        if budget <= 0:
            return True
    return False
