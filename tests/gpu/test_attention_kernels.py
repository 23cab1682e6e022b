"""Each attention backend this machine can run (sdpa always, flash-attn where installed), one layer at a
time over a paged bf16 cache of 256-token blocks scattered through the pool, against attention written
out by hand in fp32: each question's rows see its own cached and fresh keys, causally, nothing else."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels.attention import Segment, TorchAttention
from engine.kernels.flash import FlashAttention
from engine.kv.cache import KVCache
from engine.model.model import spec_from_config
from gpu.gpu_models import CUDA_ONLY, DEVICE, attention_backends, tiny_llama

pytestmark = CUDA_ONLY

BACKENDS = {"sdpa": TorchAttention, "flash-attn": FlashAttention}
BLOCK = 256
# (rows this step, keys cached before it) per question: decodes only (flash-attn's kvcache kernel, sdpa's
# padded decode groups); prompt chunks after a cached prefix beside a decode; two fresh prompts.
CASES = {"decodes": ([1, 1, 1], [300, 17, 600]), "chunks-and-a-decode": ([40, 1, 7], [0, 33, 260]),
         "fresh-prompts": ([100, 300], [0, 0])}


def by_hand(q, keys, values, cached: int) -> torch.Tensor:
    """fp32 attention of q [L, H, D] over keys/values [K, KVH, D]: row i sees keys 0..cached + i."""
    group = q.shape[1] // keys.shape[1]
    keys, values = (t.float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (keys, values))
    scores = q.float().transpose(0, 1) @ keys.transpose(1, 2) / q.shape[-1] ** 0.5  # [H, L, K]
    visible = torch.arange(keys.shape[1], device=q.device)[None] <= torch.arange(q.shape[0], device=q.device)[:, None] + cached
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values).transpose(0, 1)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", attention_backends())
def test_a_layer_attends_each_question_to_its_own_keys(backend, case):
    spec = spec_from_config(tiny_llama().config)
    kv = KVCache(spec, num_blocks=16, block_size=BLOCK, dtype=torch.bfloat16, device=DEVICE)
    free = random.Random(1).sample(range(16), 16)  # scattered: the block table, not the order, finds a key
    segments, row = [], 0
    for q_len, cached in zip(*CASES[case]):
        blocks = tuple(free.pop() for _ in range(-(-(cached + q_len) // BLOCK)))
        segments.append(Segment(row, q_len, cached + q_len, blocks))
        row += q_len
    kv.k.normal_(), kv.v.normal_()
    q = torch.randn(row, spec.num_heads, spec.head_dim, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(row, spec.num_kv_heads, spec.head_dim, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = BACKENDS[backend](kv).prepare(segments)(0, q, k, v)
    for seg in segments:
        slots = torch.tensor([b * BLOCK + i for b in seg.block_ids for i in range(BLOCK)][: seg.kv_len], device=DEVICE)
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        assert torch.equal(kv.k[0, slots[seg.cached:]], k[rows]), "the step's keys are not in the question's slots"
        expected = by_hand(q[rows], kv.k[0, slots], kv.v[0, slots], seg.cached)
        diff = (out[rows].float() - expected).abs().max().item()
        assert diff < 2e-2, f"{backend}, {case}: rows {rows} differ from attention by hand by {diff:.3g}"
