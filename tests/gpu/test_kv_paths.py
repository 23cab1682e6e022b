"""The KV paths on the GPU: the prefix cache (reused 256-token pages) and the int8 cache change no answer
beyond their own rounding, each checked against transformers on the same weights and device. In bf16 a
chunk after a cached prefix is a product of another shape, rounded differently: answers with the cache on
and off are equal or part at a near-tie (a CPU dry run saw one, 0.009 apart in fp32).

The reference is transformers in fp32 (TF32 off). bf16 logits within 5 % of the largest (as
test_parity.py); int8 KV rounds each key and value by up to 1/254 of its head's largest, inside attention
only (the CPU suite measured 1-2.3 % on its logits, tests/test_precision.py): on top of bf16, within 8 %.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineCore
from gpu.gpu_models import CUDA_ONLY, DEVICE, attention_backends
from gpu.reference import assert_follows_greedy, assert_logits_close, assert_same_or_near_tie, teacher_forced

pytestmark = CUDA_ONLY

SYSTEM_LEN = 600  # two full 256-token pages (flash-attn's) and a partial third; 37 blocks of 16 (sdpa's)


def options(harness, **overrides):
    base = dict(max_context=2048, num_blocks=1024, max_tokens_per_step=512)
    return harness.tiny_options(**{**base, **overrides})


def traffic(harness, shared: int, unrelated: int, seed: int):
    """`shared` questions on one 600-token system prompt, each with its own question, among others."""
    rng = random.Random(seed)
    system = harness.random_prompt(random.Random(600), SYSTEM_LEN)
    asked = [harness.Q(f"s{i}", system + harness.random_prompt(rng, rng.randint(1, 40)),
                       dict(max_new_tokens=rng.randint(8, 20), temperature=0.0)) for i in range(shared)]
    asked += [harness.Q(f"u{i}", harness.random_prompt(rng, rng.randint(5, 300)),
                        dict(max_new_tokens=rng.randint(8, 20), temperature=0.0)) for i in range(unrelated)]
    rng.shuffle(asked)
    return asked


@pytest.mark.parametrize("attention", attention_backends())
def test_the_prefix_cache_changes_no_answer(tiny_gpu, harness, attention):
    kev, exact = tiny_gpu.bf16, tiny_gpu.hf
    asked = traffic(harness, shared=8, unrelated=3, seed=4)
    off = harness.run_core(kev, asked, options(harness, attention=attention))
    on = harness.run_core(kev, asked, options(harness, attention=attention, prefix_caching=True))
    cached = sum(a.usage.cached_prompt_tokens for a in on.answers.values())
    assert cached >= 4 * 512, f"{attention}: only {cached} prompt tokens were read from the cache"
    for q in asked:
        what = f"prefix cache {attention} {q.qid}"
        assert_same_or_near_tie(exact, q.prompt_ids, on.tokens(q.qid), off.tokens(q.qid), 0.1, what + ", on vs off")
        reference = teacher_forced(exact, q.prompt_ids, on.tokens(q.qid))
        assert_logits_close(on.logits[q.qid], reference, 0.05, what)
        assert_follows_greedy(on.tokens(q.qid), reference, gap=0.1, agree=0.75, what=what)


def test_int8_kv_runs_on_sdpa_stores_int8_and_follows_transformers(tiny_gpu, harness, logs):
    kev, exact = tiny_gpu.bf16, tiny_gpu.hf
    int8 = options(harness, kv_dtype="int8")
    core = EngineCore(kev, int8)
    assert core.kv.k.dtype == torch.int8 and core.kv.k.device.type == DEVICE.type
    line = next(e for e in logs if e["event"] == "attention.backend")
    assert (line["backend"], line["kv_dtype"]) == ("sdpa", "int8")  # flash-attn reads pages raw: not int8
    if DEVICE.type == "cuda":
        assert "int8_kv_on_cuda" in {e["name"] for e in logs if e["event"] == "slow_path"}

    asked = traffic(harness, shared=2, unrelated=4, seed=5)
    packed = harness.run_core(kev, asked, int8)
    for q in asked:
        tokens = packed.tokens(q.qid)
        alone = harness.run_core(kev, [q], int8).tokens(q.qid)
        assert_same_or_near_tie(exact, q.prompt_ids, tokens, alone, 0.2, f"int8 KV {q.qid}, packed vs alone")
        reference = teacher_forced(exact, q.prompt_ids, tokens)
        assert_logits_close(packed.logits[q.qid], reference, 0.08, f"int8 KV {q.qid}")
        assert_follows_greedy(tokens, reference, gap=0.2, agree=0.75, what=f"int8 KV {q.qid}")
