"""Which question drafts this step, how many tokens, and what it keeps after verification.

Plain bookkeeping (no torch), called by the scheduler. A question drafts only while it decodes
(its prompt fully computed, one token left to compute), is free text (no response_format: its
grammar would have to judge every draft before the forward) and has room left: a draft never runs
past max_new_tokens or the question's context, and never takes blocks a neighbour will need.
"""

from __future__ import annotations

from engine.schedule.sequence import Sequence, Status
from engine.speculate.ngram import NgramDrafter

# policy auto: speculate only while the step has at most this many rows before drafting. Below it a
# decode step reads the weights once for few rows (memory bound), so extra verify rows cost little.
AUTO_MAX_ROWS = 8
MAX_BACKOFF = 16  # policy auto: most steps a question waits after its drafts keep failing


def can_draft(seq: Sequence) -> bool:
    return (seq.status == Status.RUNNING and seq.constraint is None and seq.num_uncomputed == 1
            and seq.num_computed_tokens >= seq.num_prompt_tokens)


def draft_room(seq: Sequence, budget: int, max_tokens_per_question: int) -> int:
    """Draft tokens `seq` may verify now: k drafts emit up to k + 1 tokens, all within its limits."""
    left_to_answer = seq.params.max_new_tokens - len(seq.output_ids) - 1
    left_in_context = max_tokens_per_question - seq.num_tokens - 1
    return max(0, min(budget - 1, left_to_answer, left_in_context))


def propose(drafter: NgramDrafter, seq: Sequence, room: int) -> tuple[int, ...]:
    """Drafts from the question's own tokens (prompt + output so far) and nothing else."""
    if room <= 0:
        return ()
    return tuple(drafter.propose(seq.token_ids, room))


def paused(seq: Sequence) -> bool:
    """policy auto: True while a question waits out its backoff (counting the step down)."""
    if seq.draft_pause > 0:
        seq.draft_pause -= 1
        return True
    return False


def back_off(seq: Sequence, accepted: int) -> None:
    """After a wholly rejected draft, pause 1, 2, 4 .. MAX_BACKOFF steps (doubling while it keeps
    failing); any accepted draft resets it. Text with nothing to copy soon stops costing verify rows."""
    if accepted:
        seq.draft_backoff = 0
        return
    seq.draft_backoff = min(MAX_BACKOFF, max(1, 2 * seq.draft_backoff))
    seq.draft_pause = seq.draft_backoff


def accepted_length(draft: tuple[int, ...], targets: list[int]) -> int:
    """How many leading drafts the model drew itself: draft i is kept iff row i drew it."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return accepted
