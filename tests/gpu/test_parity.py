"""Kev's engine on the GPU gives transformers' answers on the same weights and device, and each question's
packed answer is its answer alone: a 4-layer random Llama, prompts past 256-token KV blocks (flash-attn's
page), chunked prefills beside decodes, every attention backend this machine can run.

The reference is always transformers in fp32 (TF32 off), never a second rounded run. Kev in fp32: logits
within 0.1 % of the largest (rounding is ~1e-6 relative; a wrong mask or position is off by tens of
percent). Kev in bf16 (8 significant bits): logits within 5 % (measured 1.6-2.4 % on this model in a
CPU dry run, as tests/test_precision.py on smaller ones), each greedy token transformers' best or a
near-tie there (0.1; largest seen 0.04), three in four exactly its best (this random model's logits are
flat, about 3 at most over 320 tokens: a dry run saw 12 of 15 after a flip).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineCore
from gpu.gpu_models import CUDA_ONLY, DEVICE, attention_backends
from gpu.reference import (assert_follows_greedy, assert_logits_close, assert_same_or_near_tie, first_difference, hf_greedy,
                       teacher_forced)

pytestmark = CUDA_ONLY

NEW_TOKENS = 24
# 255 + 24 decodes cross a 256-token page while decoding; 300 and 600 hold two and three pages; 1 is a
# prompt of one token; 600 at 256 tokens a step is prefilled in three chunks beside the others' decodes.
LENGTHS = [300, 13, 255, 1, 600, 40]


def questions(harness, lengths=LENGTHS, seed=0, new_tokens=NEW_TOKENS):
    rng = random.Random(seed)
    return [harness.Q(f"q{i}", harness.random_prompt(rng, n), dict(max_new_tokens=new_tokens, temperature=0.0))
            for i, n in enumerate(lengths)]


def options(harness, attention="auto", **overrides):
    """GPU-sized options: 2,048 positions, 256 tokens a step (chunked prefill), the default block size
    (the engine raises it to 256 for flash-attn)."""
    base = dict(max_context=2048, num_blocks=1024, max_tokens_per_step=256, attention=attention)
    return harness.tiny_options(**{**base, **overrides})


@pytest.mark.parametrize("packed", [False, True], ids=["solo", "packed"])
def test_fp32_greedy_answers_equal_transformers(tiny_gpu, harness, packed):
    asked = questions(harness, seed=1) if packed else questions(harness, [300], seed=1)
    outcome = harness.run_core(tiny_gpu.fp32, asked, options(harness, "sdpa"))
    for q in asked:
        tokens, expected = outcome.tokens(q.qid), hf_greedy(tiny_gpu.hf, q.prompt_ids, NEW_TOKENS)
        assert tokens == expected, (f"{q.qid} ({len(q.prompt_ids)} prompt tokens): Kev's greedy answer is not "
                                    f"transformers' ({first_difference(tokens, expected)})")
        reference = teacher_forced(tiny_gpu.hf, q.prompt_ids, tokens)
        assert_logits_close(outcome.logits[q.qid], reference, 1e-3, f"fp32 {q.qid}")


@pytest.mark.parametrize("attention", ["auto"] + attention_backends())
def test_bf16_answers_follow_transformers(tiny_gpu, harness, attention):
    kev, exact = tiny_gpu.bf16, tiny_gpu.hf
    asked = questions(harness, seed=2)
    outcome = harness.run_core(kev, asked, options(harness, attention))
    for q in asked:
        tokens = outcome.tokens(q.qid)
        reference = teacher_forced(exact, q.prompt_ids, tokens)
        what = f"bf16 {attention} {q.qid} ({len(q.prompt_ids)} prompt tokens)"
        assert_logits_close(outcome.logits[q.qid], reference, 0.05, what)
        assert_follows_greedy(tokens, reference, gap=0.1, agree=0.75, what=what)


@pytest.mark.parametrize("precision,attention", [("fp32", "sdpa")] + [("bf16", a) for a in ["auto"] + attention_backends()])
def test_greedy_solo_equals_packed(tiny_gpu, harness, precision, attention):
    """fp32: token for token. bf16: the same, or parted at a near-tie (reference.assert_same_or_near_tie)."""
    model = getattr(tiny_gpu, precision)
    asked = questions(harness, seed=3)
    packed = harness.run_core(model, asked, options(harness, attention))
    assert any(len(plan) > 1 and any(length > 1 for _q, _s, length, _d in plan) for plan in packed.plans), \
        "no forward packed a prompt chunk beside other questions"
    for q in asked:
        alone = harness.run_core(model, [q], options(harness, attention)).tokens(q.qid)
        what = f"{precision} {attention}: {q.qid} ({len(q.prompt_ids)} prompt tokens) packed vs alone"
        if precision == "fp32":
            assert packed.tokens(q.qid) == alone, f"{what}: {first_difference(packed.tokens(q.qid), alone)}"
        else:
            assert_same_or_near_tie(tiny_gpu.hf, q.prompt_ids, packed.tokens(q.qid), alone, 0.1, what)


def test_the_backend_choice_is_logged_once_with_its_slow_paths(tiny_gpu, harness, logs):
    """What an operator reads at start: the backend, device and dtype, and every slow path by name."""
    flash = "flash-attn" in attention_backends()
    core = EngineCore(tiny_gpu.bf16, options(harness))
    lines = [e for e in logs if e["event"] == "attention.backend"]
    assert len(lines) == 1, f"expected one attention.backend line, got {lines}"
    line = lines[0]
    assert (line["device"].split(":")[0], line["dtype"], line["kv_dtype"], line["mode"]) == \
        (DEVICE.type, "bf16", "auto", "fast")
    slow = {e["name"] for e in logs if e["event"] == "slow_path"}
    if DEVICE.type == "cuda" and flash:
        assert line["backend"] == "flash-attn" and core.block_size % 256 == 0 and not slow
    elif DEVICE.type == "cuda":
        assert line["backend"] == "sdpa" and slow == {"flash_attn_missing"}, (line, slow)

    logs.clear()
    EngineCore(tiny_gpu.fp32, options(harness))  # fp32 on CUDA runs, on SDPA, and says it is slow
    line = next(e for e in logs if e["event"] == "attention.backend")
    assert (line["backend"], line["dtype"]) == ("sdpa", "fp32")
    if DEVICE.type == "cuda":
        assert "fp32_without_tf32" in {e["name"] for e in logs if e["event"] == "slow_path"}
