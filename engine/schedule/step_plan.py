"""What the scheduler hands the model runner for one step: a StepPlan of Chunks, and nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.schedule.sequence import Sequence


@dataclass
class Chunk:
    """One question's share of a step: tokens [start, start + length) of its sequence."""

    seq: Sequence
    start: int  # tokens already in this question's cache; also its first position this step
    length: int  # tokens computed this step (1 for a decode)
    sample: bool  # True when the chunk reaches the end of the known tokens, so a next token is drawn

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.length]


@dataclass
class StepPlan:
    """Everything the runner needs for one packed forward; it sees nothing else."""

    chunks: list[Chunk] = field(default_factory=list)  # flat-token order: chunk i's tokens follow chunk i-1's
    preempted: list[Sequence] = field(default_factory=list)  # evicted this step; they will recompute later

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)

    @property
    def sampled_chunks(self) -> list[Chunk]:
        return [c for c in self.chunks if c.sample]

    def __bool__(self) -> bool:
        return bool(self.chunks)
