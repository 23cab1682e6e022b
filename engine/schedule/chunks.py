"""Chunks: how many of a question's tokens a step computes, and the step being filled with them. Pure Python."""

from __future__ import annotations

from engine.schedule.limits import SchedulerLimits
from engine.schedule.prompt_grid import on_grid
from engine.schedule.sharing import Sharing
from engine.schedule.step_budget import PromptRoom
from engine.sequence import Sequence
from engine.step_plan import Chunk, StepPlan


class Filling:
    """One step while it is planned: its chunks so far, the tokens it has left, the prompt it may still
    carry while questions decode (`room`), and who is charged for what it computes."""

    def __init__(self, budget: int, room: PromptRoom, sharing: Sharing, now: float) -> None:
        self.plan = StepPlan()
        self.budget = budget  # tokens left (scheduler.max_tokens_per_step)
        self.room = room
        self.sharing = sharing
        self.now = now

    def add(self, chunk: Chunk, prompt: bool = True) -> None:
        """Put `chunk` in the step; it will be computed, so its principal is charged for it now.
        `prompt` False: a finished question's rows (early_stop off), outside the prompt room."""
        self.plan.chunks.append(chunk)
        self.budget -= chunk.length
        if prompt and not chunk.seq.decoding:
            self.room.take(chunk.start, chunk.length)
        self.sharing.computed(chunk.seq, chunk.length, self.now)


def chunk_length(seq: Sequence, budget: int, limits: SchedulerLimits, room: PromptRoom | None = None,
                 at_least_one: bool = False) -> int:
    """Tokens of `seq` to compute this step within `budget` (and, for its prompt, the step's `room`);
    0 when its next chunk does not fit. `at_least_one`: a running question moves every step."""
    length = min(seq.num_uncomputed, budget)
    if room is not None and not seq.decoding:
        length = room.rows(seq.num_computed_tokens, length)
        if at_least_one and not limits.chunk_grid:
            length = max(1, length)
    if limits.split_roles:
        prompt_left = seq.num_prompt_tokens - seq.num_computed_tokens
        length = min(length, prompt_left if prompt_left > 0 else 1)
    elif limits.chunk_grid and seq.num_uncomputed > 1:
        length = on_grid(seq.num_computed_tokens, seq.num_tokens, length, limits.chunk_grid)
    return length


def new_chunk(seq: Sequence, length: int, draft: tuple[int, ...] = ()) -> Chunk:
    """`seq`'s next `length` tokens (and `draft` after them); it draws a token where they reach its end."""
    start = seq.num_computed_tokens
    return Chunk(seq=seq, start=start, length=length + len(draft), sample=start + length == seq.num_tokens,
                 draft=draft)
