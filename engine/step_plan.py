"""What the scheduler hands the model runner for one step: a StepPlan of Chunks, and nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence


@dataclass
class Chunk:
    """One question's share of a step: tokens [start, start + length) of its sequence."""

    seq: Sequence
    start: int  # tokens already in this question's cache; also its first position this step
    length: int  # tokens computed this step (1 for a decode)
    sample: bool  # True when the chunk reaches the end of the known tokens, so a next token is drawn
    # Speculative decoding (engine/speculate/): tokens proposed after the question's last one, computed
    # in this chunk's last rows (included in `length`) and kept only as far as the model agrees.
    draft: tuple[int, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        known = self.seq.token_ids[self.start : self.start + self.length - len(self.draft)]
        return known + list(self.draft) if self.draft else known

    @property
    def num_sample_rows(self) -> int:
        """Rows whose next token is drawn: the last one, and with a draft every draft row too."""
        return 1 + len(self.draft) if self.sample else 0


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

    @property
    def sample_row_chunks(self) -> list[Chunk]:
        """The chunk of each drawn row, in logits row order (a drafting chunk once per row)."""
        return [c for c in self.chunks for _ in range(c.num_sample_rows)]

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(c.draft) for c in self.chunks)

    @property
    def num_keys(self) -> int:
        """Keys the step's attention reads, each row its own question's keys up to its position."""
        return sum(chunk_keys(c.start, c.length) for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


def chunk_keys(start: int, rows: int) -> int:
    """Keys read by `rows` rows of one question whose first row sits at position `start` (row i reads
    start + i + 1: every key up to its own)."""
    return rows * start + rows * (rows + 1) // 2
