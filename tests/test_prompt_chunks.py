"""Prompt chunks on a fixed grid (scheduler.prompt_chunk_tokens): where a prompt is cut never depends on
what shares its steps, so in default mode a question's logits are bitwise its solo ones at every precision
(row_linear matmuls, the same attention calls), not only in deterministic mode."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.kernels import row_linear
from engine.schedule.prompt_grid import on_grid

NEW_TOKENS = 12


@given(start=st.integers(0, 3000), size=st.integers(1, 3000), grid=st.integers(1, 600),
       budgets=st.lists(st.integers(1, 2048), min_size=1, max_size=40))
def test_a_prompt_is_cut_at_the_same_places_whatever_budgets_its_steps_have(start, size, grid, budgets):
    def cuts(step_budgets):
        done, out = start, []
        for budget in step_budgets:
            if done == start + size:
                break
            length = on_grid(done, start + size, budget, grid)
            assert length >= 0 and done + length <= start + size
            if length:
                done += length
                out.append(done)
        return out

    alone = cuts([10**6] * (size // grid + 2))  # a step with room for anything
    cut = cuts(budgets)
    assert cut == alone[: len(cut)]  # a busier run makes the same cuts, only later
    assert all(c % grid == 0 or c == start + size for c in alone)


def test_a_chunk_never_crosses_a_grid_line_and_waits_rather_than_end_off_it():
    assert on_grid(0, 1000, 2048, 512) == 512  # alone: still cut at 512
    assert on_grid(512, 1000, 2048, 512) == 488
    assert on_grid(0, 1000, 300, 512) == 0  # a busy step: no chunk ending at 300
    assert on_grid(96, 1000, 2048, 512) == 416  # after a cached prefix of 96 tokens: up to the next line
    assert on_grid(0, 40, 40, 512) == 40


def victim(harness, length=37):
    return harness.Q("victim", harness.random_prompt(random.Random(99), length),
                     dict(max_new_tokens=NEW_TOKENS, temperature=0.0))


def victim_chunks(outcome) -> list[tuple[int, int]]:
    return [(start, length) for plan in outcome.plans for qid, start, length, _ in plan
            if qid == "victim" and length > 1]


needs_kernel = pytest.mark.skipif(row_linear.kernel() is None, reason="no C++ compiler: row_linear is not built")


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_default_mode_is_bitwise_solo_when_neighbours_fill_the_budget(tiny_models, harness, kind, kv_dtype):
    """Three 40-token neighbours take most of each 64-token step. Without the grid the victim's prompt
    would be cut where the budget ran out; on it, alone or packed, it is cut at 16 and 32."""
    tiny = tiny_models[kind]
    model = harness.kev_model_from_hf(tiny.hf, tiny.kev.tokenizer, dtype=torch.bfloat16)
    assert model.weights.matmul.kernel == "row_linear"
    options = harness.tiny_options(max_tokens_per_step=64, prompt_chunk_tokens=16, kv_dtype=kv_dtype)
    solo = harness.run_core(model, [victim(harness)], options)
    rng = random.Random(3)
    others = [harness.Q(f"n{i}", harness.random_prompt(rng, 40), dict(max_new_tokens=NEW_TOKENS)) for i in range(3)]
    packed = harness.run_core(model, others + [victim(harness)], options)
    assert victim_chunks(solo) == victim_chunks(packed) == [(0, 16), (16, 16), (32, 5)]
    assert max(len(plan) for plan in packed.plans) == 4
    for step, (a, b) in enumerate(zip(solo.logits["victim"], packed.logits["victim"])):
        assert torch.equal(a, b), f"step {step}: differs by {(a - b).abs().max().item():.3e}"
    assert packed.tokens("victim") == solo.tokens("victim")


def test_without_the_grid_a_busy_step_cuts_the_prompt_where_its_budget_ends(tiny_models, harness):
    """prompt_chunk_tokens: 0 restores cutting anywhere (the victim's first chunk is whatever was left)."""
    model = tiny_models["llama"].kev
    options = harness.tiny_options(max_tokens_per_step=64, prompt_chunk_tokens=0)
    rng = random.Random(3)
    others = [harness.Q(f"n{i}", harness.random_prompt(rng, 40), dict(max_new_tokens=4)) for i in range(3)]
    packed = harness.run_core(model, others + [victim(harness)], options)
    assert victim_chunks(packed)[0][1] not in (16, 37)


def test_deterministic_mode_keeps_cutting_anywhere(tiny_models, harness):
    """Its fixed tiles read every chunk from the cache, so it needs no grid and fills every step."""
    from engine.core import _limits

    options = harness.tiny_options(deterministic=True, prompt_chunk_tokens=16)
    assert _limits(options, 512).prompt_chunk == 0
    assert _limits(harness.tiny_options(prompt_chunk_tokens=4096, max_tokens_per_step=64), 512).prompt_chunk == 64
