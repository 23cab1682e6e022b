"""Speculation: speculative decoding as the scheduler calls it. Before a step's chunks it chooses who
drafts and makes the drafts; while the chunks are planned it hands a decoding question its draft, with
blocks for it; after the forward it says how many of a verified draft the model kept.

The scheduler owns the questions and the pool's bookkeeping of what they computed; this object owns the
drafter, policy auto's odds and cost table, and the counts the metrics read; it settles a verified draft
through the scheduler's `emit`, which ends a question where it would end without drafts. No torch: a model drafter
is an object handed in (engine/speculate/draft_model.py), the step costs plain floats.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.kv.block_pool import BlockPool
from engine.sequence import Sequence
from engine.speculate.acceptance import KindRates, draft_kind, odds, record
from engine.speculate.cost import StepCosts, draft_lengths
from engine.speculate.drafts import accepted_length, can_draft, draft_room, drafter_method, is_model, propose
from engine.step_plan import Chunk
from schemas import SpeculativePolicy


class Speculation:
    def __init__(self, drafter, policy: SpeculativePolicy = "auto", costs: StepCosts | None = None) -> None:
        self.drafter = drafter  # engine/speculate/: NgramDrafter, DraftModel
        self.policy = policy
        self.costs = costs  # policy auto: a forward's seconds against its rows (engine/speculate/setup.py)
        self.kinds = KindRates()  # policy auto: first draft tokens kept, per kind of draft
        self.num_draft_tokens = 0  # verified in forwards
        self.num_accepted_draft_tokens = 0  # of those, emitted
        self.num_draft_verifications = 0  # question-forwards that verified a draft
        self._drafts: dict[str, tuple[int, ...]] = {}  # this step's drafts, by question id
        self._origins: dict[str, dict] = {}  # where each came from, for the audit

    @property
    def method(self) -> str:
        """The drafter's name (ngram, draft_model) in the metrics and the audit."""
        return drafter_method(self.drafter)

    def plan(self, running: list[Sequence], budget: int, max_tokens_per_question: int) -> None:
        """Before the step's chunks: who drafts and how many tokens (the policy), and the drafts.

        Room counts one token of the step's `budget` for every other running question; `draft` then
        trims each draft to what the budget and the pool really leave."""
        self._drafts, self._origins = {}, {}
        budget -= len(running) - 1
        offers = [(seq, draft_room(seq, budget, max_tokens_per_question)) for seq in running if can_draft(seq)]
        offers = [(seq, room) for seq, room in offers if room > 0]
        model = is_model(self.drafter)
        if model:
            offers = [(seq, min(room, self.drafter.max_draft_tokens)) for seq, room in offers]
        else:  # a lookup proposes for free: the policy then takes as much of it as pays
            proposed = [(seq, propose(self.drafter, seq, room)) for seq, room in offers]
            offers = [(seq, draft) for seq, (draft, _) in proposed if draft]
            self._origins = {seq.question_id: origin for seq, (draft, origin) in proposed if draft}
        if not offers:
            return
        most = [room for _, room in offers] if model else [len(draft) for _, draft in offers]
        rows = min(budget + len(running) - 1, sum(seq.num_uncomputed for seq in running))
        lengths = most if self.policy == "always" else self._auto_lengths(offers, most, model, rows)
        if model:
            self._draft_with_model(offers, lengths)
        else:
            self._drafts = {seq.question_id: draft[:k] for (seq, draft), k in zip(offers, lengths) if k}

    def _draft_with_model(self, offers: list, lengths: list[int]) -> None:
        asks = [(seq.question_id, seq.token_ids, k) for (seq, _), k in zip(offers, lengths) if k]
        drafts = self.drafter.draft_batch(asks) if asks else []
        self._drafts = {qid: tuple(d) for (qid, _, _), d in zip(asks, drafts) if d}
        self._origins = {qid: self.drafter.origin(qid, len(tokens)) for qid, tokens, _ in asks if qid in self._drafts}

    def _auto_lengths(self, offers: list, most: list[int], model: bool, base_rows: int) -> list[int]:
        """policy auto: as many drafts as raise the step's expected tokens per second (engine/speculate/cost.py)."""
        self.kinds.fade()
        chances = [odds(seq, 0 if model else draft_kind(self._origins[seq.question_id]), self.kinds, k)
                   for (seq, _), k in zip(offers, most)]
        return draft_lengths(self.costs, base_rows, chances, getattr(self.drafter, "costs", None) if model else None)

    def draft(self, seq: Sequence, budget: int, behind: int, pool: BlockPool,
              max_tokens_per_question: int) -> tuple[int, ...]:
        """This step's draft for a decoding question, with blocks for it taken already; () when it does not
        draft. Drafts never preempt anyone: they use blocks the question holds plus free ones beyond one per
        question `behind` it (each of those may need a new block for its own token this step)."""
        draft = self._drafts.pop(seq.question_id, ())
        if not draft or not can_draft(seq):
            return ()
        draft = draft[: draft_room(seq, budget, max_tokens_per_question)]
        spare_blocks = max(0, pool.num_free - behind)
        room = (len(seq.block_ids) + spare_blocks) * pool.block_size - seq.num_computed_tokens - 1
        draft = draft[: max(0, room)]
        if not draft or not pool.grow(seq.question_id, seq.block_ids, seq.num_tokens + len(draft)):
            return ()
        seq.draft_origin = self._origins.get(seq.question_id)
        return draft

    def settle(self, chunk: Chunk, drawn: list[int], pool: BlockPool, emit: Callable[[int], None]) -> None:
        """After the forward: emit the drafts the model drew itself, then its own next token, one at a time,
        so a stop token, max_new_tokens or the context limit ends the question exactly where it would
        without drafts (`emit` ends it). Its odds and the counts learn from the draft.

        Rejected drafts' KV stays in slots past `num_computed_tokens`: never read (a row sees only
        positions below its own) and overwritten by the next step's tokens. Blocks that only they
        needed go back to the pool now."""
        seq, draft = chunk.seq, chunk.draft
        accepted = accepted_length(draft, drawn)
        record(seq, draft_kind(seq.draft_origin), self.kinds, len(draft), accepted)
        seq.verified = (len(draft), accepted)  # the audit's record of its next forward says so
        seq.drafted_tokens += len(draft)
        self.num_draft_tokens += len(draft)
        self.num_draft_verifications += 1
        seq.num_computed_tokens += 1  # its last token, whatever the drafts
        pool.shrink(seq.question_id, seq.block_ids, seq.num_computed_tokens + accepted)
        for i, token in enumerate(drawn[: accepted + 1]):
            emit(token)
            if i < accepted:  # a kept draft: its KV was computed this step, at the position it now has
                seq.num_computed_tokens += 1
                seq.accepted_draft_tokens += 1
                self.num_accepted_draft_tokens += 1
            if seq.status.finished:
                break

    def forget(self, seq: Sequence) -> None:
        """A question ended: a model drafter frees what it kept for it."""
        if hasattr(self.drafter, "forget"):
            self.drafter.forget(seq.question_id)
