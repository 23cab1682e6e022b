"""Stall-free steps (Sarathi-Serve's idea): how much prompt a step may carry while questions decode.

Every decoding question waits for the whole step before its next token, so a step that prefills 2,048
prompt tokens stalls every stream behind it for seconds. While anyone decodes, the prompt rows of a step
therefore cost at most what `scheduler.prompt_chunk_tokens` fresh prompt tokens cost: a chunk deep in a
long prompt, whose rows each read thousands of keys, is shorter. Cost is counted in rows, a key read
being worth `StepCost.key_cost` rows (measured), so neither the host's speed nor a step's fixed part
matters. With nobody decoding no one waits: prompts take the whole `scheduler.max_tokens_per_step`.
Plain numbers, no torch.
"""

from __future__ import annotations

import math

from engine.step_plan import chunk_keys


class PromptRoom:
    """The prompt rows one step may still take. `limited` False: nobody decodes, only the token budget counts."""

    def __init__(self, chunk_tokens: int, key_cost: float, decoding: bool, grid: bool = False) -> None:
        """`grid`: prompt chunks end only on multiples of chunk_tokens (prompt_grid.py); the step's first
        chunk then always fits, whatever it costs, or prompts would never move while anyone decodes."""
        self.chunk_tokens = chunk_tokens
        self.key_cost = key_cost
        self.grid = grid
        self.limited = bool(chunk_tokens and decoding)
        self.left = self._cost(chunk_tokens, chunk_keys(0, chunk_tokens))
        self.first = True

    @property
    def exhausted(self) -> bool:
        return self.limited and not self.first and self.left < 1

    def rows(self, start: int, wanted: int) -> int:
        """How many of `wanted` prompt rows from position `start` fit the step (the step's first chunk: at
        least one row, or its whole grid cell)."""
        if not self.limited:
            return wanted
        fit = self._rows_within(max(0.0, self.left), start)
        if self.first:
            fit = max(fit, min(wanted, self.chunk_tokens) if self.grid else 1)
        return min(wanted, fit)

    def take(self, start: int, rows: int) -> None:
        if rows > 0:
            self.left -= self._cost(rows, chunk_keys(start, rows))
            self.first = False
    def _cost(self, rows: int, keys: int) -> float:
        return rows + self.key_cost * keys

    def _rows_within(self, room: float, start: int) -> int:
        """The most rows r from `start` with r + key_cost * keys(start, r) <= room."""
        k = self.key_cost
        if k <= 0:
            return int(room)
        # k/2 r^2 + (1 + k (start + 1/2)) r <= room
        b = 1 + k * (start + 0.5)
        rows = int((-b + math.sqrt(b * b + 2 * k * room)) / k)
        while rows > 0 and self._cost(rows, chunk_keys(start, rows)) > room:  # float rounding at the edge
            rows -= 1
        return rows
