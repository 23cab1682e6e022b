"""The scheduler's speculative decoding: drafts chosen and made, drafting chunks planned, verified drafts
kept or rolled back.

A mixin of Scheduler (engine/schedule/scheduler.py), kept apart so the step logic stays readable; it
uses the scheduler's pool, limits, drafter and `step_costs`. No torch: a model drafter is an object
handed in (engine/speculate/draft_model.py), the step costs plain floats.
"""

from __future__ import annotations

from engine.schedule.prefix_chain import name_filled_blocks
from engine.schedule.sequence import Sequence
from engine.schedule.step_plan import Chunk
from engine.speculate.acceptance import draft_kind, odds, record
from engine.speculate.cost import draft_lengths
from engine.speculate.drafts import accepted_length, can_draft, draft_room, drafter_method, is_model, propose


class Speculation:
    def _plan_drafts(self) -> None:
        """Before the step's chunks: who drafts and how many tokens (the policy), and the drafts.

        Room counts one token of the step's budget for every other running question; the chunks
        then trim each draft to what the budget and the pool really leave (`_draft`)."""
        self._step_drafts: dict[str, tuple[int, ...]] = {}
        self._step_origins: dict[str, dict] = {}  # where each draft came from, for the audit
        if self.drafter is None:
            return
        budget = self.limits.max_tokens_per_step - (len(self.running) - 1)
        offers = [(seq, draft_room(seq, budget, self.max_tokens_per_question)) for seq in self.running
                  if can_draft(seq)]
        offers = [(seq, room) for seq, room in offers if room > 0]
        model = is_model(self.drafter)
        if model:
            offers = [(seq, min(room, self.drafter.max_draft_tokens)) for seq, room in offers]
        else:  # a lookup proposes for free: the policy then takes as much of it as pays
            proposed = [(seq, propose(self.drafter, seq, room)) for seq, room in offers]
            offers = [(seq, draft) for seq, (draft, _) in proposed if draft]
            self._step_origins = {seq.question_id: origin for seq, (draft, origin) in proposed if draft}
        if not offers:
            return
        most = [room for _, room in offers] if model else [len(draft) for _, draft in offers]
        lengths = most if self.limits.speculative_policy == "always" else self._auto_lengths(offers, most, model)
        if model:
            asks = [(seq.question_id, seq.token_ids, k) for (seq, _), k in zip(offers, lengths) if k]
            drafts = self.drafter.draft_batch(asks) if asks else []
            self._step_drafts = {qid: tuple(d) for (qid, _, _), d in zip(asks, drafts) if d}
            self._step_origins = {qid: self.drafter.origin(qid, len(tokens)) for qid, tokens, _ in asks
                                  if qid in self._step_drafts}
        else:
            self._step_drafts = {seq.question_id: draft[:k] for (seq, draft), k in zip(offers, lengths) if k}

    def _auto_lengths(self, offers: list, most: list[int], model: bool) -> list[int]:
        """policy auto: as many drafts as raise the step's expected tokens per second (engine/speculate/cost.py)."""
        base_rows = min(self.limits.max_tokens_per_step, sum(seq.num_uncomputed for seq in self.running))
        self.draft_kinds.fade()
        chances = [odds(seq, 0 if model else draft_kind(self._step_origins[seq.question_id]), self.draft_kinds, k)
                   for (seq, _), k in zip(offers, most)]
        return draft_lengths(self.step_costs, base_rows, chances, getattr(self.drafter, "costs", None) if model else None)

    def _draft(self, seq: Sequence, length: int, budget: int, behind: int) -> tuple[int, ...]:
        """This step's drafts for a decoding question, with blocks for them taken already; () when it
        does not draft.

        Drafts never preempt anyone: they use blocks the question holds plus free ones beyond one per
        question behind it (each of those may need a new block for its own token this step)."""
        draft = self._step_drafts.pop(seq.question_id, ()) if self.drafter is not None else ()
        if not draft or length != 1 or not can_draft(seq):
            return ()
        draft = draft[: draft_room(seq, budget, self.max_tokens_per_question)]
        spare_blocks = max(0, self.pool.num_free - behind)
        room = (len(seq.block_ids) + spare_blocks) * self.pool.block_size - seq.num_computed_tokens - 1
        draft = draft[: max(0, room)]
        if not draft or not self.pool.grow(seq.question_id, seq.block_ids, seq.num_tokens + len(draft)):
            return ()
        seq.draft_origin = self._step_origins.get(seq.question_id)
        return draft

    @property
    def speculative_method(self) -> str | None:
        """The drafter's name (ngram, draft_model); None without speculative decoding."""
        return None if self.drafter is None else drafter_method(self.drafter)

    def _drafts_done(self, seq: Sequence) -> None:
        """A question ended: a model drafter frees what it kept for it."""
        if self.drafter is not None and hasattr(self.drafter, "forget"):
            self.drafter.forget(seq.question_id)

    def _verify(self, chunk: Chunk, drawn: list[int], batch_size: int, new_tokens: list) -> None:
        """Keep the drafts the model drew itself, then its own next token; one at a time, so a stop token,
        max_new_tokens or the context limit ends the question exactly where it would without drafts.

        Rejected drafts' KV stays in slots past `num_computed_tokens`: never read (a row sees only
        positions below its own) and overwritten by the next step's tokens. Blocks that only they
        needed go back to the pool now.
        """
        seq, draft = chunk.seq, chunk.draft
        accepted = accepted_length(draft, drawn)
        record(seq, draft_kind(seq.draft_origin), self.draft_kinds, len(draft), accepted)
        seq.verified = (len(draft), accepted)  # the audit's record of its next forward says so
        self.num_draft_tokens += len(draft)
        self.num_draft_verifications += 1
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
