"""Rotary tables: each position's cos and signed sine per table, for every position the model allows, but
computed only as far as questions reach.

A table holds `max_position` rows (Gemma 3: 32,768 x 256 per table, two tables: 128 MiB in fp32; Qwen2.5
0.5B: 16 MiB). Its tensors are allocated whole, so every reference to them (the layer stack's, an engine's
copy of the weights) stays valid, but rows are written only as `reach` asks: a page of the allocation no row
was written to is never resident. A row depends on its position alone, so a row computed late holds the bits
it would have held computed with the rest (the whole table is a multiple of the vector width wide).
"""

from __future__ import annotations

import torch

from engine.model.layers import signed_sin

FIRST_REACH = 2048  # rows computed at load: the default max_context; an engine reaches its own at start


class RotaryTables:
    """`tables[key]` = (cos, signed sine) [positions, rotary_dim] in the model's dtype; rows below `filled`
    are computed. `frequencies[key]` = (inverse frequencies [rotary_dim / 2] float32, attention scaling)."""

    def __init__(self, frequencies: dict[str, tuple[torch.Tensor, float]], positions: int, interleaved: bool,
                 dtype: torch.dtype, device: torch.device):
        self.frequencies = frequencies
        self.interleaved = interleaved
        self.positions = positions
        self.filled = 0
        width = 2 * next(iter(frequencies.values()))[0].numel()
        self.tables = {key: (torch.empty(positions, width, dtype=dtype, device=device),
                             torch.empty(positions, width, dtype=dtype, device=device)) for key in frequencies}

    @classmethod
    def whole(cls, tables: dict[str, tuple[torch.Tensor, torch.Tensor]], interleaved: bool) -> "RotaryTables":
        """Tables given whole (cos, plain sine), as rope_tables computes them: nothing left to reach."""
        rotary = cls.__new__(cls)
        rotary.frequencies, rotary.interleaved = {}, interleaved
        rotary.tables = {key: (cos, signed_sin(sin, interleaved)) for key, (cos, sin) in tables.items()}
        rotary.positions = rotary.filled = next(iter(rotary.tables.values()))[0].shape[0]
        return rotary

    def reach(self, positions: int) -> None:
        """Compute the rows of positions below `positions` (at most the model's max_position) not yet computed."""
        end = min(positions, self.positions)
        if end <= self.filled:
            return
        for key, (inv_freq, scaling) in self.frequencies.items():
            cos, sin = rows(inv_freq, scaling, self.filled, end, self.interleaved)
            table_cos, table_sin = self.tables[key]
            table_cos[self.filled:end] = cos.to(table_cos.dtype)
            table_sin[self.filled:end] = signed_sin(sin, self.interleaved).to(table_sin.dtype)
        self.filled = end  # last: a reader on another engine's thread checks it before reading a row


def rows(inv_freq: torch.Tensor, scaling: float, start: int, end: int,
         interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and plain sine [end - start, rotary_dim] float32 for positions start .. end - 1, as transformers
    computes them."""
    positions = torch.arange(start, end, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :].float()
    emb = torch.repeat_interleave(freqs, 2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling
