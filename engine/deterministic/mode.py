"""MathMode: the kernels a forward computes with, chosen once per engine by `math_mode(deterministic)`.

The model code asks its mode for a matmul (`linear`), an attention backend over a KV cache, a LoRA
batch and a start-up check of its weights, and never tests the mode itself. `FAST` takes the quickest
kernel for each shape; `DETERMINISTIC` (isolation.deterministic) takes kernels whose results for a row
do not depend on what else shares the forward: row_linear where its start-up check passes, else
fixed-tile kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.adapters.lora import LoraBatch, LoraStacks
from engine.deterministic import rows
from engine.deterministic.attention import FixedTileAttention
from engine.deterministic.lora import TiledLoraBatch
from engine.deterministic.tiles import TileCheck, tiled_linear
from engine.kernels.attention import TorchAttention
from engine.kernels.row_linear import RowWeight
from engine.kernels.rowwise import RowwiseAttention
from engine.kv.cache import KVCache


class MathMode:
    """Default mode: the fastest kernel for each shape. A row's last bits may depend on how many rows
    share its forward (kernels pick their blocking by shape); greedy tokens match a solo run."""

    @staticmethod
    def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias); `weight` is a tensor, an Int8Weight (weight-only int8) or a PackedWeight."""
        if isinstance(weight, torch.Tensor):
            return F.linear(x, weight, bias)
        return weight.linear(x, bias)

    @staticmethod
    def row_weight(matrix) -> RowWeight | None:
        """The row_linear weight this mode multiplies `matrix` by, or None (another kernel)."""
        return matrix if isinstance(matrix, RowWeight) else None

    def check(self, matrices: list) -> None:
        """Prove, before serving, that this CPU computes `matrices` as the mode promises."""

    def attention(self, kv: KVCache) -> RowwiseAttention | TorchAttention:
        """The attention backend on devices without flash-attn: every row as a decode of its own position
        where the paged kernel covers the cache (engine/kernels/rowwise.py), else torch SDPA per question."""
        return RowwiseAttention(kv) if RowwiseAttention.usable(kv) else TorchAttention(kv)

    def lora_batch(self, spans, device, stacks: LoraStacks):
        """The step's adapters and their rows; `spans`: (adapter or None, first row, rows) per chunk."""
        return LoraBatch.build(spans, device, stacks)


class DeterministicMode(MathMode):
    """Batch-invariant: every matmul through row_linear (one fixed order of additions per output) or,
    where its check fails or cannot run, in fixed row tiles; every row's attention as a decode of its own
    position read from the cache (fixed tiles where the paged kernel cannot run); each adapter's LoRA
    alone in tiles. A row's logits are bitwise the same whatever shares its
    forward, however its prompt was chunked."""

    @staticmethod
    def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        row = rows.row_weight(weight)
        if row is not None:
            return row.linear(x, bias)
        return tiled_linear(x, weight, bias)

    @staticmethod
    def row_weight(matrix) -> RowWeight | None:
        return rows.row_weight(matrix)

    def check(self, matrices: list) -> None:
        TileCheck.weights(rows.take(matrices))

    def attention(self, kv: KVCache) -> RowwiseAttention | FixedTileAttention:
        """Every row as a decode of its own position where the paged kernel covers the cache, else tiles."""
        return RowwiseAttention(kv) if RowwiseAttention.usable(kv) else FixedTileAttention(kv)

    def lora_batch(self, spans, device, stacks: LoraStacks):
        return TiledLoraBatch.build(spans, device)


FAST, DETERMINISTIC = MathMode(), DeterministicMode()


def math_mode(deterministic: bool) -> MathMode:
    return DETERMINISTIC if deterministic else FAST
