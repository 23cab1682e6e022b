"""The CUDA attention backend: flash-attn varlen kernels over the paged KV cache.

Import-guarded: on a machine without CUDA or flash-attn, `flash_available()` is False and Kev uses
TorchAttention (engine/kernels/backend.py chooses, and logs the choice). Same contract as TorchAttention: write the step's K/V through the slot mapping, then
attend with per-question cu_seqlens and block tables, so no question sees another's keys.
"""

from __future__ import annotations

import torch

from engine.kernels.attention import Segment, slot_mapping
from engine.kv.cache import KVCache

try:  # flash-attn is the opt-in `kev[flash-attn]` extra (KEV_FLASH_ATTN=1 make setup, from a matching wheel)
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = flash_attn_with_kvcache = None


def flash_installed() -> bool:
    return flash_attn_varlen_func is not None


def flash_available(device: torch.device) -> bool:
    """CUDA and flash-attn present; whether the engine uses it is engine/kernels/backend.py's decision
    (it also needs fp16/bf16 and a cache in the model's dtype)."""
    return device.type == "cuda" and flash_installed()


class FlashAttention:
    name = "flash-attn"
    block_size_multiple = 256  # flash-attn's paged kernels take pages of a multiple of 256 tokens

    def __init__(self, kv: KVCache):
        if flash_attn_varlen_func is None:
            raise RuntimeError("flash-attn is not installed: KEV_FLASH_ATTN=1 make setup (a wheel matching torch)")
        if kv.block_size % self.block_size_multiple:
            raise ValueError(f"flash-attn needs a KV block size that is a multiple of 256, not {kv.block_size}")
        self.kv = kv

    def prepare(self, segments: list[Segment]) -> "FlashStep":
        return FlashStep(self.kv, segments)


class FlashStep:
    def __init__(self, kv: KVCache, segments: list[Segment]):
        device = kv.k.device
        self.kv = kv
        self.slots = torch.tensor(slot_mapping(segments, kv.block_size), dtype=torch.long, device=device)
        self.decode_only = all(s.q_len == 1 for s in segments)
        q_lens = [s.q_len for s in segments]
        kv_lens = [s.kv_len for s in segments]
        self.kv_lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
        self.cu_q = _cumulative(q_lens, device)
        self.cu_k = _cumulative(kv_lens, device)
        self.max_q, self.max_k = max(q_lens), max(kv_lens)
        width = max(len(s.block_ids) for s in segments)
        table = torch.zeros(len(segments), width, dtype=torch.int32)
        for i, seg in enumerate(segments):
            table[i, : len(seg.block_ids)] = torch.tensor(seg.block_ids, dtype=torch.int32)
        self.block_table = table.to(device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        k_cache.index_copy_(0, self.slots, k)
        v_cache.index_copy_(0, self.slots, v)
        paged = (self.kv.num_blocks, self.kv.block_size, k.shape[1], k.shape[2])
        k_pages, v_pages = k_cache.view(paged), v_cache.view(paged)
        form = self.kv.layers[layer].form
        # The layer's form: flash-attn's window counts the keys before the row's own (-1: all of them).
        shape = dict(softmax_scale=form.scale, window_size=(-1 if form.window is None else form.window - 1, 0),
                     softcap=form.softcap or 0.0)
        if self.decode_only:
            out = flash_attn_with_kvcache(q[:, None], k_pages, v_pages, cache_seqlens=self.kv_lens,
                                          block_table=self.block_table, causal=True, **shape)
            return out[:, 0]
        # causal=True aligns each question's queries to the end of its keys: a chunk after a cached
        # prefix sees the prefix and its own earlier tokens, nothing else.
        return flash_attn_varlen_func(q, k_pages, v_pages, self.cu_q, self.cu_k, self.max_q, self.max_k,
                                      causal=True, block_table=self.block_table, **shape)


def _cumulative(lengths: list[int], device) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out.to(device)
