"""The order in which waiting questions are offered a place in the batch, per admission policy.

Pure Python: the scheduler tries them in this order and skips (a bounded number of times) those
that do not fit the pool. Under policy fair this is the order within one principal (priority, then the
earliest deadline); engine/schedule/fair_share.py decides between principals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from engine.sequence import Sequence, Status
from schemas import SchedulingPolicy

ORDER: dict[SchedulingPolicy, Callable[[Sequence], tuple]] = {
    # Preempted questions go first in every policy: they already waited once.
    "fcfs": lambda s: (s.status != Status.PREEMPTED, s.arrival),
    "shortest_prompt_first": lambda s: (s.status != Status.PREEMPTED, s.num_tokens, s.arrival),
    "priority": lambda s: (s.status != Status.PREEMPTED, -s.priority, s.arrival),
    "fair": lambda s: (s.status != Status.PREEMPTED, -s.priority, due(s), s.arrival),
}


def due(seq: Sequence) -> float:
    """Its deadline, for earliest-deadline-first; a question without one comes after every one with one."""
    return math.inf if seq.deadline is None else seq.deadline


def admission_order(waiting: list[Sequence], running: list[Sequence], policy: SchedulingPolicy,
                    length_aware: bool) -> Iterator[Sequence]:
    """`waiting` in the policy's order; length-aware, nearest the batch's first question's length first.

    `running` is read as the caller admits: when the batch was empty, the first question admitted
    becomes the anchor that orders the rest.
    """
    order = _ordered(waiting, running, policy, length_aware)
    anchored = bool(running)
    for i in range(len(order)):
        if not anchored and running:
            anchored = True
            order[i:] = _ordered(order[i:], running, policy, length_aware)
        yield order[i]


def _ordered(seqs: list[Sequence], running: list[Sequence], policy: SchedulingPolicy,
             length_aware: bool) -> list[Sequence]:
    key = ORDER[policy]
    if length_aware and running:
        anchor = running[0].num_tokens.bit_length()
        return sorted(seqs, key=lambda s: (abs(s.num_tokens.bit_length() - anchor), key(s)))
    return sorted(seqs, key=key)
