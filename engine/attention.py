"""Attention over a packed batch, each question seeing only its own keys.

One interface, two backends: `TorchAttention` (any device; torch SDPA per segment, decodes grouped)
and `FlashAttention` in engine/flash.py (CUDA + flash-attn varlen with block tables). Both first write
the step's new K/V into the question's own cache slots, then attend. No backend ever builds a mask
over the whole packed batch: masks are per question, or per group of single-token decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_cache import KVCache


@dataclass(frozen=True)
class Segment:
    """One question's rows in the packed batch."""

    q_start: int  # first row of this question in the flat batch
    q_len: int  # rows (new tokens) this step
    kv_len: int  # keys visible to the last row: cached tokens + this step's
    block_ids: tuple[int, ...]  # the question's KV blocks, in order

    @property
    def cached(self) -> int:
        return self.kv_len - self.q_len


def slot_mapping(segments: list[Segment], block_size: int) -> list[int]:
    """The cache row each new token's K/V is written to."""
    slots = []
    for seg in segments:
        for pos in range(seg.cached, seg.kv_len):
            slots.append(seg.block_ids[pos // block_size] * block_size + pos % block_size)
    return slots


def context_slots(block_ids: tuple[int, ...], kv_len: int, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(block_ids, dtype=torch.long)
    return (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:kv_len]


class TorchAttention:
    """SDPA per question for prompt chunks; all single-token decodes in one padded, masked call.

    The decode mask hides each row's padding keys: masked keys add exact zeros, so a question's
    decode does not depend on its neighbours' lengths. `per_segment=True` (deterministic mode) gives
    every question its own call with exactly its own keys.
    """

    name = "torch-sdpa"

    def __init__(self, kv: KVCache, per_segment: bool = False):
        self.kv = kv
        self.per_segment = per_segment

    def prepare(self, segments: list[Segment]) -> "TorchStep":
        return TorchStep(self, segments)


class TorchStep:
    def __init__(self, backend: TorchAttention, segments: list[Segment]):
        kv = backend.kv
        self.kv = kv
        device = kv.k.device
        self.slots = torch.tensor(slot_mapping(segments, kv.block_size), dtype=torch.long, device=device)
        decodes = [] if backend.per_segment else [s for s in segments if s.q_len == 1]
        self.decode = _DecodeGroup(decodes, kv.block_size, device) if decodes else None
        self.prompts = [
            (seg, context_slots(seg.block_ids, seg.kv_len, kv.block_size).to(device) if seg.cached else None)
            for seg in segments if self.decode is None or seg.q_len > 1
        ]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        k_cache.index_copy_(0, self.slots, k)
        v_cache.index_copy_(0, self.slots, v)
        if self.decode is not None and not self.prompts:  # decodes only: rows are already in order
            return self.decode.attend(q, k_cache, v_cache)
        out = q.new_empty(q.shape)
        if self.decode is not None:
            out[self.decode.rows] = self.decode.attend(q[self.decode.rows], k_cache, v_cache)
        for seg, ctx in self.prompts:
            rows = slice(seg.q_start, seg.q_start + seg.q_len)
            out[rows] = _attend_segment(q[rows], k[rows], v[rows], k_cache, v_cache, ctx, seg)
        return out


def _attend_segment(q, k, v, k_cache, v_cache, ctx: torch.Tensor | None, seg: Segment) -> torch.Tensor:
    """q: [L, H, D]. With no cached prefix the fresh keys suffice; otherwise read the question's slots."""
    if ctx is None:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(0, 1)
    keys, values = k_cache.index_select(0, ctx).transpose(0, 1), v_cache.index_select(0, ctx).transpose(0, 1)
    # Row i sits at position cached + i and sees keys 0..cached + i: causal, offset by the cache.
    visible = torch.arange(seg.kv_len, device=q.device)[None, :] <= (
        torch.arange(seg.q_len, device=q.device)[:, None] + seg.cached)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=visible, enable_gqa=True)
    return out.transpose(0, 1)


class _DecodeGroup:
    """Single-token decodes of several questions, padded to the longest context and masked per row."""

    def __init__(self, segments: list[Segment], block_size: int, device: torch.device):
        longest = max(s.kv_len for s in segments)
        slots = torch.zeros(len(segments), longest, dtype=torch.long)
        for i, seg in enumerate(segments):
            slots[i, : seg.kv_len] = context_slots(seg.block_ids, seg.kv_len, block_size)
        lengths = torch.tensor([s.kv_len for s in segments])
        self.rows = torch.tensor([s.q_start for s in segments], device=device)
        self.slots = slots.flatten().to(device)  # index_select on a flat index is far faster than 2-D indexing
        self.batch, self.longest = len(segments), longest
        self.mask = (torch.arange(longest)[None, :] < lengths[:, None])[:, None, None, :].to(device)

    def attend(self, q, k_cache, v_cache) -> torch.Tensor:
        """q: [B, H, D], the decode rows only."""
        query = q[:, :, None, :]  # [B, H, 1, D]
        shape = (self.batch, self.longest) + k_cache.shape[1:]
        keys = k_cache.index_select(0, self.slots).view(shape).transpose(1, 2)  # [B, KVH, L, D]
        values = v_cache.index_select(0, self.slots).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=self.mask, enable_gqa=True)
        return out[:, :, 0, :]
