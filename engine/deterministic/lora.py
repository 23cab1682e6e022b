"""Deterministic mode's LoRA: each adapter alone, its rows in fixed tiles (engine/deterministic/tiles.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.adapters.files import LoraAdapter
from engine.adapters.lora import group_rows
from engine.deterministic.tiles import TileCheck, tiled_matmul


@dataclass
class TiledLoraBatch:
    """The adapters of one packed forward, each applied to its own rows only.

    LoraBatch pads every adapter to the mix's largest rank and group, so a row's sums would change
    length with its neighbours' adapters. Here a row meets only its own adapter's matrices, at their
    own rank, in ROW_TILE-row tiles: its delta does not depend on the mix.
    """

    groups: list[tuple[LoraAdapter, torch.Tensor]]  # each adapter and its rows, in a fixed order

    @classmethod
    def build(cls, spans, device) -> "TiledLoraBatch | None":
        """`spans`: (adapter or None, first row, rows) per chunk; None when no chunk has an adapter."""
        groups = group_rows(spans)
        if not groups:
            return None
        for adapter in groups:
            TileCheck.weights([m.t() for layer in adapter.layers for f in layer.values() for m in (f.shrink, f.expand)])
        ordered = sorted(groups.items(), key=lambda item: item[0].key)
        return cls([(a, torch.tensor(rows, dtype=torch.long, device=device)) for a, rows in ordered])

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += each adapter's delta on x[rows], for its own rows only."""
        for adapter, rows in self.groups:
            lora = adapter.layers[layer].get(projection)
            if lora is not None:
                out.index_add_(0, rows, tiled_matmul(tiled_matmul(x[rows], lora.shrink), lora.expand))
