"""Attention for deterministic mode: fixed tiles, fixed reduction order, no dependence on neighbours.

`FixedTileAttention` answers TorchAttention's step its own way: a row's role decides its path, never
the batch. Prompt rows go through `attend_prompt_tiles` (queries in ROW_TILE-row tiles), generated-token
rows through `FixedDecodes` (one token per question, all questions in one batched call). The
scheduler never mixes the two roles in a chunk and computes generated tokens one per chunk, even when
they are recomputed after a preemption, so a token's row takes the same path solo, packed, chunked or
recomputed.

Both paths read keys from the cache in tiles of KEY_TILE aligned at position 0, so a row meets the
same tiles whatever else was scheduled. A tile past a row's position is fully masked: it adds exact
zeros to the sums, which is why padding a batch to its longest context changes no bit of a shorter
row. Every matmul item has a shape fixed by the model (rows per tile x head_dim x KEY_TILE).
"""

from __future__ import annotations

import torch

from engine.deterministic.tiles import ROW_TILE, check_items, pad_rows
from engine.kernels.attention import Segment, TorchAttention, context_slots
from engine.kv.cache import KVCache, LayerKV, padded_slots

KEY_TILE = 64  # keys per tile


class FixedTileAttention(TorchAttention):
    """Deterministic mode's attention: keys always read from the cache, in fixed tiles, so a row's bits
    depend on neither its neighbours nor how its prompt was split into chunks (or recomputed)."""

    name = "torch-fixed-tiles"

    def __init__(self, kv: KVCache):  # not TorchAttention's: the paged decode kernel is neither used nor built
        self.kv = kv
        check_fixed_attention(kv.k.shape[-1], kv.compute_dtype, kv.group)

    def is_decode(self, seg: Segment) -> bool:
        """By role: a generated token always takes the decode path, a prompt row never."""
        return seg.generated

    def decode_group(self, decodes: list[Segment], device) -> "FixedDecodes":
        assert all(s.q_len == 1 for s in decodes), "the scheduler gives generated tokens one per chunk"
        return FixedDecodes(decodes, self.kv.block_size, device)

    def context(self, seg: Segment, device) -> torch.Tensor:
        """Every prompt chunk reads its keys from the cache, its fresh ones too."""
        return context_slots(seg.block_ids, seg.kv_len, self.kv.block_size).to(device)

    def attend_prompt(self, q, k, v, cache: LayerKV, ctx: torch.Tensor, seg: Segment) -> torch.Tensor:
        return attend_prompt_tiles(q, cache, ctx, seg.cached)


def check_fixed_attention(head_dim: int, dtype: torch.dtype, group: int) -> None:
    """Prove on this CPU that the item shapes both paths use are batch-invariant (logs if not)."""
    for rows in {ROW_TILE, group}:
        check_items(rows, head_dim, KEY_TILE, dtype)
        check_items(rows, KEY_TILE, head_dim, dtype)


def attend_prompt_tiles(q, cache, ctx: torch.Tensor, cached: int) -> torch.Tensor:
    """One question's prompt rows q [L, H, D] at positions cached.., over its cache slots `ctx`.

    Queries in tiles of ROW_TILE rows, keys in tiles of KEY_TILE, combined with an online softmax
    (as flash attention does), tile by tile in key order.
    """
    rows, heads, dim = q.shape
    group, form = heads // cache.kv_heads, cache.form
    query = pad_rows(q, ROW_TILE).transpose(0, 1).reshape(heads, -1, ROW_TILE, dim) * form.scale
    tiles = query.shape[1]
    # Whole key tiles: padding reads the question's own first slot (finite, and masked: its index is
    # past every row's position). Dequantised per token when the cache is int8: row-local.
    k_rows, v_rows = cache.gather(pad_rows(ctx, KEY_TILE, fill=ctx[0]))
    keys = k_rows.transpose(0, 1).repeat_interleave(group, 0)
    values = v_rows.transpose(0, 1).repeat_interleave(group, 0)
    positions = torch.arange(tiles * ROW_TILE, device=q.device).view(tiles, ROW_TILE, 1) + cached
    best = torch.full((heads, tiles, ROW_TILE, 1), float("-inf"), device=q.device, dtype=query.dtype)
    total = torch.zeros_like(best)
    acc = torch.zeros_like(query)
    for start in range(0, keys.shape[1], KEY_TILE):
        # Expanded per query tile, so the batched matmul runs with M = ROW_TILE, never a folded height;
        # copied, so its layout is the same with one query tile or many.
        key_tile = keys[:, None, start : start + KEY_TILE].expand(-1, tiles, -1, -1).contiguous()
        value_tile = values[:, None, start : start + KEY_TILE].expand(-1, tiles, -1, -1).contiguous()
        keys_at = torch.arange(start, start + KEY_TILE, device=q.device)
        visible = keys_at <= positions
        if form.window is not None:
            visible &= keys_at > positions - form.window
        scores = _capped(torch.matmul(query, key_tile.transpose(-1, -2)), form).masked_fill(~visible, float("-inf"))
        new_best = torch.maximum(best, scores.amax(-1, keepdim=True))
        # -inf only while a sliding window has hidden every key so far: those tiles then add exact zeros.
        shift = new_best.masked_fill(new_best == float("-inf"), 0.0)
        scale, weights = torch.exp(best - shift), torch.exp(scores - shift)
        total = total * scale + weights.sum(-1, keepdim=True)
        acc = acc * scale + torch.matmul(weights, value_tile)
        best = new_best
    out = (acc / total).reshape(heads, -1, dim)[:, :rows]
    return out.transpose(0, 1)


def _capped(scores: torch.Tensor, form) -> torch.Tensor:
    """Gemma 2's soft cap on the scores, where the layer has one."""
    return scores if form.softcap is None else torch.tanh(scores / form.softcap) * form.softcap


class FixedDecodes:
    """The generated-token rows of a step, one per question, attended in one batched computation.

    Scores come from (group x head_dim) @ (head_dim x KEY_TILE) items, one per question, KV head
    and key tile. The softmax uses each row's own maximum (exact: max has no rounding), per-tile
    sums over exactly KEY_TILE keys, and a running sum over tiles in key order (cumsum is a
    sequential scan), so trailing padded tiles add exact zeros and nothing depends on the batch.
    """

    def __init__(self, segments, block_size: int, device: torch.device):
        tiles = max(-(-seg.kv_len // KEY_TILE) for seg in segments)
        width = tiles * KEY_TILE
        slots, visible = padded_slots(segments, block_size, width)  # padding: the row's own first slot
        self.rows = torch.tensor([seg.q_start for seg in segments], device=device)
        self.slots = slots.flatten().to(device)
        self.batch, self.tiles = len(segments), tiles
        self.hidden = (~visible).view(self.batch, 1, tiles, 1, KEY_TILE).to(device)
        self.lengths = torch.tensor([seg.kv_len for seg in segments], device=device)
        self.windowed: dict[int, torch.Tensor] = {}

    def hidden_keys(self, window: int | None) -> torch.Tensor:
        """The keys each row does not see: past its length, and before its sliding window if it has one."""
        if window is None:
            return self.hidden
        if window not in self.windowed:
            keys = torch.arange(self.tiles * KEY_TILE, device=self.hidden.device)
            early = keys[None, :] < (self.lengths - window)[:, None]
            self.windowed[window] = self.hidden | early.view(self.batch, 1, self.tiles, 1, KEY_TILE)
        return self.windowed[window]

    def attend(self, q, cache) -> torch.Tensor:
        """q [B, H, D]: the decode rows only, in segment order."""
        batch, heads, dim = q.shape
        kv_heads = cache.kv_heads
        group = heads // kv_heads
        shape = (batch, self.tiles, KEY_TILE, kv_heads, dim)
        k_rows, v_rows = cache.gather(self.slots)
        # Contiguous operands: a strided view could reach BLAS in another layout (another kernel) when
        # the batch happens to be of size one. Keys are then transposed as a view, which folds into
        # the same (transposed) layout for every batch.
        keys = k_rows.view(shape).permute(0, 3, 1, 2, 4).contiguous()  # [B, KVH, T, KT, D]
        values = v_rows.view(shape).permute(0, 3, 1, 2, 4).contiguous()  # [B, KVH, T, KT, D]
        form = cache.form
        query = (q * form.scale).view(batch, kv_heads, 1, group, dim).expand(-1, -1, self.tiles, -1, -1).contiguous()
        scores = _capped(torch.matmul(query, keys.transpose(-1, -2)), form)
        scores = scores.masked_fill(self.hidden_keys(form.window), float("-inf"))  # [B, KVH, T, group, KT]
        best = scores.amax(dim=(2, 4), keepdim=True)  # finite: a row always sees its own key
        weights = torch.exp(scores - best)
        total = weights.sum(-1, keepdim=True).cumsum(2)[:, :, -1]  # [B, KVH, group, 1]
        acc = torch.matmul(weights, values).cumsum(2)[:, :, -1]  # [B, KVH, group, D]
        return (acc / total).reshape(batch, heads, dim)
