"""Attention over a packed batch, each question seeing only its own keys.

One interface, three backends: `TorchAttention` (any device; torch SDPA per segment; decodes read the
block pool in place with engine/kernels/paged_decode.py's kernel on CPU, else grouped and padded for SDPA),
`FlashAttention` in engine/kernels/flash.py (CUDA + flash-attn varlen with block tables) and, for
deterministic mode, `FixedTileAttention` in engine/deterministic/attention.py. Each first writes the
step's new K/V into the question's own cache slots, then attends. No backend ever builds a mask over
the whole packed batch: masks are per question, or per group of single-token decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels import paged_decode
from engine.attention_form import AttentionForm
from engine.kv.cache import KVCache, LayerKV, padded_slots


@dataclass(frozen=True)
class Segment:
    """One question's rows in the packed batch."""

    q_start: int  # first row of this question in the flat batch
    q_len: int  # rows (new tokens) this step
    kv_len: int  # keys visible to the last row: cached tokens + this step's
    block_ids: tuple[int, ...]  # the question's KV blocks, in order
    generated: bool = False  # a generated token (not the prompt): FixedTileAttention attends it as a decode

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
    decode does not depend on its neighbours' lengths. A step asks its backend four things (which
    rows decode, how they attend, which cache slots a prompt chunk reads, how it attends them);
    FixedTileAttention answers them with fixed-tile kernels.
    """

    name = "torch-sdpa"

    def __init__(self, kv: KVCache):
        self.kv = kv
        # Decided (and the kernel built or loaded) here, when the engine starts, not at its first decode.
        self.paged = paged_decode.usable(kv)

    def prepare(self, segments: list[Segment]) -> "TorchStep":
        return TorchStep(self, segments)

    def is_decode(self, seg: Segment) -> bool:
        """Single-token rows attend together, whatever their role."""
        return seg.q_len == 1

    def decode_group(self, decodes: list[Segment], device):
        if self.paged:  # reads the pool in place: no gather, no padding
            return paged_decode.PagedDecodes(decodes, self.kv.block_size, device)
        return _DecodeGroups(decodes, self.kv.block_size, device)

    def context(self, seg: Segment, device) -> torch.Tensor | None:
        """The cache slots a prompt chunk reads; None when it has no cached prefix (its fresh keys suffice)."""
        if not seg.cached:
            return None
        return context_slots(seg.block_ids, seg.kv_len, self.kv.block_size).to(device)

    def attend_prompt(self, q, k, v, cache: LayerKV, ctx: torch.Tensor | None, seg: Segment) -> torch.Tensor:
        return _attend_segment(q, k, v, cache, ctx, seg)


class TorchStep:
    def __init__(self, backend: TorchAttention, segments: list[Segment]):
        kv, device = backend.kv, backend.kv.k.device
        self.kv, self.backend = kv, backend
        self.slots = torch.tensor(slot_mapping(segments, kv.block_size), dtype=torch.long, device=device)
        is_decode = [backend.is_decode(s) for s in segments]
        decodes = [s for s, d in zip(segments, is_decode) if d]
        self.decode = backend.decode_group(decodes, device) if decodes else None
        self.prompts = [(s, backend.context(s, device)) for s, d in zip(segments, is_decode) if not d]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.kv.layers[layer]
        # With an int8 cache the fresh keys come back as stored (quantised), so a prompt attending its
        # fresh keys sees what a later chunk reading the cache would.
        k, v = cache.write(self.slots, k, v)
        if self.decode is not None and not self.prompts:  # decodes only: rows are already in order
            return self.decode.attend(q, cache)
        out = q.new_empty(q.shape)
        if self.decode is not None:
            out[self.decode.rows] = self.decode.attend(q[self.decode.rows], cache)
        for seg, ctx in self.prompts:
            rows = slice(seg.q_start, seg.q_start + seg.q_len)
            out[rows] = self.backend.attend_prompt(q[rows], k[rows], v[rows], cache, ctx, seg)
        return out


def _attend_segment(q, k, v, cache: LayerKV, ctx: torch.Tensor | None, seg: Segment) -> torch.Tensor:
    """q: [L, H, D]. With no cached prefix the fresh keys suffice; otherwise read the question's slots.

    SDPA gets 4-D [1, heads, L, D] tensors: on CPU only those reach the fused flash kernel; 3-D ones
    fall back to the unfused math path, several times slower on a long prompt."""
    query, form = q.transpose(0, 1)[None], cache.form
    plain = form == AttentionForm.plain(q.shape[-1])
    if ctx is None and plain:
        out = F.scaled_dot_product_attention(query, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1)
    keys, values = (t.transpose(0, 1)[None] for t in (cache.gather(ctx) if ctx is not None else (k, v)))
    # Row i sits at position cached + i and sees keys 0..cached + i: causal, offset by the cache; with a
    # window, only its last `window` of them.
    key_pos = torch.arange(seg.kv_len, device=q.device)[None, :]
    row_pos = torch.arange(seg.q_len, device=q.device)[:, None] + seg.cached
    visible = key_pos <= row_pos
    if form.window is not None:
        visible &= key_pos > row_pos - form.window
    return attend_masked(query, keys, values, visible, form)[0].transpose(0, 1)


def attend_masked(query, keys, values, visible, form: AttentionForm) -> torch.Tensor:
    """query [B, H, L, D] over keys/values [B, KVH, S, D], `visible` a mask broadcast to [B, H, L, S], in
    the layer's form: SDPA where it has no soft cap, else the scores, cap and softmax written out."""
    if form.softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=form.scale,
                                              enable_gqa=True)
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * form.scale
    scores = torch.tanh(scores / form.softcap) * form.softcap
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.matmul(weights, values)


class _DecodeGroups:
    """Single-token decodes split by context length, so short contexts are not padded to the longest.

    Every decode reads its whole padded width of keys (gathered from the cache, then attended), so one
    group of a 1,000-token and thirty 100-token contexts costs as much as 31 long ones. Contexts are
    grouped by powers of two of their length: in a group the longest is at most twice the shortest
    (above MIN_WIDTH), and a step has at most a handful of groups. A row's result does not depend on
    its group (masked keys add exact zeros), only the work does.
    """

    MIN_WIDTH = 128  # shorter contexts share one group: below this a call's fixed cost dominates

    def __init__(self, segments: list[Segment], block_size: int, device: torch.device):
        by_bucket: dict[int, list[int]] = {}
        for i, seg in enumerate(segments):
            by_bucket.setdefault(max(seg.kv_len - 1, self.MIN_WIDTH - 1).bit_length(), []).append(i)
        self.rows = torch.tensor([s.q_start for s in segments], device=device)
        # Each group with its places among the decode rows.
        self.groups = [(torch.tensor(places, device=device),
                        _DecodeGroup([segments[i] for i in places], block_size, device))
                       for places in by_bucket.values()]

    def attend(self, q, cache: LayerKV) -> torch.Tensor:
        """q: [B, H, D], the decode rows only, in segment order; the result in the same order."""
        if len(self.groups) == 1:
            return self.groups[0][1].attend(q, cache)
        out = q.new_empty(q.shape)
        for places, group in self.groups:
            out[places] = group.attend(q[places], cache)
        return out


class _DecodeGroup:
    """Single-token decodes of several questions, padded to the longest context and masked per row."""

    def __init__(self, segments: list[Segment], block_size: int, device: torch.device):
        longest = max(s.kv_len for s in segments)
        slots, visible = padded_slots(segments, block_size, longest)
        self.slots = slots.flatten().to(device)  # index_select on a flat index is far faster than 2-D indexing
        self.batch, self.longest = len(segments), longest
        self.mask = visible[:, None, None, :].to(device)
        self.lengths = torch.tensor([s.kv_len for s in segments], device=device)
        self.windowed: dict[int, torch.Tensor] = {}  # the mask of a sliding window, per window

    def visible(self, window: int | None) -> torch.Tensor:
        """Each row's keys, [B, 1, 1, longest]: all up to its length, or its last `window` of them."""
        if window is None:
            return self.mask
        if window not in self.windowed:
            first = (self.lengths - window).clamp(min=0)
            keys = torch.arange(self.longest, device=self.mask.device)
            self.windowed[window] = self.mask & (keys[None, :] >= first[:, None])[:, None, None, :]
        return self.windowed[window]

    def attend(self, q, cache: LayerKV) -> torch.Tensor:
        """q: [B, H, D], the decode rows only."""
        keys, values = cache.gather(self.slots)
        batch, heads, dim = q.shape
        kv_heads = keys.shape[1]
        shape = (batch, self.longest, kv_heads, dim)
        keys = keys.view(shape).transpose(1, 2)  # [B, KVH, L, D]
        values = values.view(shape).transpose(1, 2)
        # The query heads sharing a KV head are folded into the query length ([B, KVH, group, D]): one
        # token's queries see the same keys, no causal mask applies, and SDPA multiplies taller tiles
        # than with enable_gqa over [B, H, 1, D], which is faster.
        query = q.view(batch, kv_heads, heads // kv_heads, dim)
        form = cache.form
        if form == AttentionForm.plain(dim):
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=self.mask)
        else:
            out = attend_masked(query, keys, values, self.visible(form.window), form)
        return out.reshape(batch, heads, dim)
