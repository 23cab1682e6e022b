"""A question's deadline counts from when it was published, not from when a worker got to it.

After a backlog, a question whose caller gave up long ago would otherwise be computed in full for
nobody; so would one whose deadline is too near for its prompt (`deadline_ending`). The publish time
is a wall-clock instant (a Kafka record's timestamp, ms since the epoch);
the engine's clock is time.monotonic(), so the publish time is carried over as an age.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from engine.schedule.step_cost import StepCost
from engine.sequence import Sequence

# A shared host's step times swing about twofold: a question is given up before it is computed only if
# it could not make its deadline even at this many times the measured speed.
FASTEST_PLAUSIBLE = 0.5


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


def clock_start(arrival: float, published: float | None) -> float:
    """Where a deadline counts from: the publish time, or the arrival when it was not published earlier."""
    return arrival if published is None else min(published, arrival)


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


def unreachable_message(deadline_in_s: float, prompt_tokens: int, fastest_s: float) -> str:
    """Why a question was answered "timeout" before any of it was computed: its deadline was too near."""
    return (f"the question's deadline could not be met: {deadline_in_s * 1000:.0f} ms were left, and its "
            f"{prompt_tokens} prompt tokens take at least {fastest_s * 1000:.0f} ms to compute on this worker "
            f"even if started at once; it was answered at once and not computed")


def deadline_ending(seq: Sequence, now: float, fastest_prefill_s: Callable[[Sequence], float | None]) -> tuple | None:
    """Whether `seq` ends "timeout" now: None if not, else (error, error code) for its answer, both None for
    a question that was computed (it keeps its partial text). A waiting question ends before its deadline
    when `fastest_prefill_s(seq)`, the least its prompt could take here, is more than the time left."""
    if seq.deadline is None:
        return None
    if now >= seq.deadline:
        if seq.awaits_adapter:  # never computed: the answer says why it is empty
            return (f"the question's deadline passed while it waited for adapter {seq.adapter!r} to get a "
                    f"resident slot (adapters.max_resident, every one in use)", None)
        if seq.admitted_at is None:
            return "the question's deadline passed while it waited for a place in the batch", None
        return None, None
    if seq.admitted_at is None:
        needed = fastest_prefill_s(seq)
        if needed is not None and now + needed > seq.deadline:
            return unreachable_message(seq.deadline - now, seq.num_tokens, needed), "deadline_unreachable"
    return None


def hopeless(seqs: list[Sequence], now: float, costs: StepCost,
             max_tokens_per_step: int) -> Iterator[tuple[Sequence, str | None, str | None]]:
    """The questions of `seqs` that end "timeout" now, each with its answer's error and error code
    (`deadline_ending`): past their deadline, or waiting and unable to meet it even if started now."""

    def fastest_prefill(seq: Sequence) -> float | None:
        """The least time `seq`'s prompt takes here, at the fastest this worker plausibly runs."""
        seconds = costs.prefill_seconds(seq.num_tokens, max_tokens_per_step)
        return None if seconds is None else FASTEST_PLAUSIBLE * seconds

    for seq in seqs:
        ending = deadline_ending(seq, now, fastest_prefill)
        if ending is not None:
            yield seq, *ending
