"""The scheduler's speculative decoding: drafting chunks planned, and verified drafts kept or rolled back.

A mixin of Scheduler (engine/schedule/scheduler.py), kept apart so the step logic stays readable; it
uses the scheduler's pool, limits and drafter. No torch.
"""

from __future__ import annotations

from engine.schedule.prefix_chain import name_filled_blocks
from engine.schedule.sequence import Sequence
from engine.schedule.step_plan import Chunk
from engine.speculate.drafts import AUTO_MAX_ROWS, accepted_length, back_off, can_draft, draft_room, paused, propose


class Speculation:
    def _draft(self, seq: Sequence, length: int, budget: int, behind: int) -> tuple[int, ...]:
        """Drafts for a decoding question, with blocks for them taken already; () when it does not draft.

        Drafts never preempt anyone: they use blocks the question holds plus free ones beyond one per
        question behind it (each of those may need a new block for its own token this step)."""
        if self.drafter is None or length != 1 or not can_draft(seq):
            return ()
        if self.limits.speculative_policy == "auto" and (len(self.running) > AUTO_MAX_ROWS or paused(seq)):
            return ()
        draft = propose(self.drafter, seq, draft_room(seq, budget, self.max_tokens_per_question))
        spare_blocks = max(0, self.pool.num_free - behind)
        room = (len(seq.block_ids) + spare_blocks) * self.pool.block_size - seq.num_computed_tokens - 1
        draft = draft[: max(0, room)]
        if not draft or not self.pool.grow(seq.question_id, seq.block_ids, seq.num_tokens + len(draft)):
            return ()
        return draft

    def _verify(self, chunk: Chunk, drawn: list[int], batch_size: int, new_tokens: list) -> None:
        """Keep the drafts the model drew itself, then its own next token; one at a time, so a stop token,
        max_new_tokens or the context limit ends the question exactly where it would without drafts.

        Rejected drafts' KV stays in slots past `num_computed_tokens`: never read (a row sees only
        positions below its own) and overwritten by the next step's tokens. Blocks that only they
        needed go back to the pool now.
        """
        seq, draft = chunk.seq, chunk.draft
        accepted = accepted_length(draft, drawn)
        back_off(seq, accepted)
        self.num_draft_tokens += len(draft)
        seq.drafted_tokens += len(draft)
        seq.num_computed_tokens += 1  # its last token, whatever the drafts
        self.pool.shrink(seq.question_id, seq.block_ids, seq.num_computed_tokens + accepted)
        self._stepped(seq, batch_size)  # one forward, however many tokens it emits
        for i, token in enumerate(drawn[: accepted + 1]):
            self._emit(seq, token, new_tokens)
            if i < accepted:  # a kept draft: its KV was computed this step, at the position it now has
                seq.num_computed_tokens += 1
                seq.accepted_draft_tokens += 1
                self.num_accepted_draft_tokens += 1
            if seq.status.finished:
                break
        name_filled_blocks(self.pool, seq)

