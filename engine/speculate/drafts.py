"""Which question may draft this step, how many tokens at most, and what a verified draft teaches.

Plain bookkeeping (no torch), called by the scheduler. A question drafts only while it decodes
(its prompt fully computed, one token left to compute), is free text (no response_format: its
grammar would have to judge every draft before the forward) and has room left: a draft never runs
past max_new_tokens or the question's context, and never takes blocks a neighbour will need.
"""

from __future__ import annotations

from engine.sequence import Sequence, Status


def can_draft(seq: Sequence) -> bool:
    return (seq.status == Status.RUNNING and seq.constraint is None and seq.num_uncomputed == 1
            and seq.num_computed_tokens >= seq.num_prompt_tokens)


def draft_room(seq: Sequence, budget: int, max_tokens_per_question: int) -> int:
    """Draft tokens `seq` may verify now: k drafts emit up to k + 1 tokens, all within its limits."""
    left_to_answer = seq.params.max_new_tokens - len(seq.output_ids) - 1
    left_in_context = max_tokens_per_question - seq.num_tokens - 1
    return max(0, min(budget - 1, left_to_answer, left_in_context))


def propose(drafter, seq: Sequence, room: int) -> tuple[tuple[int, ...], dict]:
    """A lookup drafter's drafts from the question's own tokens (prompt + output so far) and nothing else,
    and their origin for the audit: where in those tokens the draft was copied from (`source`, after a
    match of `match` tokens), when the drafter says (NgramDrafter.propose_at)."""
    if room <= 0:
        return (), {}
    method = drafter_method(drafter)
    if hasattr(drafter, "propose_at"):
        draft, source, match = drafter.propose_at(seq.token_ids, room)
        return tuple(draft), {"method": method, "source": source, "match": match}
    return tuple(drafter.propose(seq.token_ids, room)), {"method": method}


def drafter_method(drafter) -> str:
    """Its name in metrics and the audit: ngram, draft_model, or a drafter's class name."""
    return getattr(drafter, "method", type(drafter).__name__)


def is_model(drafter) -> bool:
    """A drafter that runs forwards of its own (engine/speculate/draft_model.py) and drafts every
    question of a step together; a lookup drafter (prompt lookup) proposes per question for free."""
    return hasattr(drafter, "draft_batch")


def accepted_length(draft: tuple[int, ...], targets: list[int]) -> int:
    """How many leading drafts the model drew itself: draft i is kept iff row i drew it."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return accepted
