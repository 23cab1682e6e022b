"""Where a prompt may be cut into chunks: only on a fixed grid of positions (scheduler.prompt_chunk_tokens).

A prompt cut where a busy step's budget happened to run out would be cut elsewhere alone, and its
attention calls (and so its last bits) would depend on its neighbours. On the grid a chunk ends at a
multiple of the grid or at the prompt's end; one that does not fit the step's budget waits a step.
"""

from __future__ import annotations


def on_grid(start: int, end: int, length: int, grid: int) -> int:
    """The chunk from `start` (at most `length` tokens) that ends at `end` or at the next multiple of
    `grid`, whichever is first; 0 if `length` does not reach it. The same cuts whatever budget a step has."""
    stop = min(end, (start // grid + 1) * grid)
    return stop - start if start + length >= stop else 0
