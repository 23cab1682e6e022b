"""Default mode's logits are bitwise a question's solo ones at every precision when a prompt is split by its
neighbours: on the CPU every row attends as a decode of its own position (engine/kernels/rowwise.py), so
the chunk does not matter; where prompts attend through SDPA instead (no paged kernel), prompt chunks lie
on a fixed grid (scheduler.prompt_chunk_tokens) so where a prompt is cut never depends on its neighbours."""

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


def bitwise(solo, packed) -> None:
    for step, (a, b) in enumerate(zip(solo.logits["victim"], packed.logits["victim"])):
        assert torch.equal(a, b), f"step {step}: differs by {(a - b).abs().max().item():.3e}"
    assert packed.tokens("victim") == solo.tokens("victim")


def neighbours(harness) -> list:
    rng = random.Random(3)
    return [harness.Q(f"n{i}", harness.random_prompt(rng, 40), dict(max_new_tokens=NEW_TOKENS)) for i in range(3)]


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_default_mode_is_bitwise_solo_with_rows_attending_as_decodes(tiny_models, harness, kind, kv_dtype):
    """Three 40-token neighbours take most of each 64-token step: the victim's prompt is cut where the
    budget runs out, differently alone and packed, and its logits do not move."""
    tiny = tiny_models[kind]
    model = harness.kev_model_from_hf(tiny.hf, tiny.kev.tokenizer, dtype=torch.bfloat16)
    options = harness.tiny_options(max_tokens_per_step=64, kv_dtype=kv_dtype)
    from engine.core import EngineCore

    assert type(EngineCore(model, options).runner.attention).__name__ == "RowwiseAttention"
    solo = harness.run_core(model, [victim(harness)], options)
    packed = harness.run_core(model, neighbours(harness) + [victim(harness)], options)
    assert victim_chunks(solo) == [(0, 37)] and victim_chunks(packed) != victim_chunks(solo)
    bitwise(solo, packed)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_sdpa_default_mode_is_bitwise_solo_on_the_grid(tiny_models, harness, kind, kv_dtype, monkeypatch):
    """Without the paged kernel prompts attend through SDPA, whose calls follow the chunk: on the grid the
    victim's prompt is cut at 16 and 32 alone and packed, and the prompt's logits (its first token's) are
    bitwise. (Its later decodes share padded SDPA calls with their neighbours there, which the grid does not
    cover: the promise on that path stays the greedy tokens.)"""
    monkeypatch.setenv("KEV_PAGED_DECODE", "0")
    tiny = tiny_models[kind]
    model = harness.kev_model_from_hf(tiny.hf, tiny.kev.tokenizer, dtype=torch.bfloat16)
    assert model.weights.matmul.kernel == "row_linear"
    options = harness.tiny_options(max_tokens_per_step=64, prompt_chunk_tokens=16, kv_dtype=kv_dtype)
    solo = harness.run_core(model, [victim(harness)], options)
    packed = harness.run_core(model, neighbours(harness) + [victim(harness)], options)
    assert victim_chunks(solo) == victim_chunks(packed) == [(0, 16), (16, 16), (32, 5)]
    assert max(len(plan) for plan in packed.plans) == 4
    assert torch.equal(solo.logits["victim"][0], packed.logits["victim"][0])
    assert packed.tokens("victim") == solo.tokens("victim")


def test_without_the_grid_a_busy_step_cuts_the_prompt_where_its_budget_ends(tiny_models, harness, monkeypatch):
    """prompt_chunk_tokens: 0 restores cutting anywhere (the victim's first chunk is whatever was left)."""
    monkeypatch.setenv("KEV_PAGED_DECODE", "0")
    model = tiny_models["llama"].kev
    options = harness.tiny_options(max_tokens_per_step=64, prompt_chunk_tokens=0)
    rng = random.Random(3)
    others = [harness.Q(f"n{i}", harness.random_prompt(rng, 40), dict(max_new_tokens=4)) for i in range(3)]
    packed = harness.run_core(model, others + [victim(harness)], options)
    assert victim_chunks(packed)[0][1] not in (16, 37)


def test_the_grid_only_where_prompts_attend_by_chunk(tiny_models, harness):
    """Deterministic mode and row-wise attention read every row's keys alike whatever the chunk: no grid;
    SDPA gets it, capped at the step's budget."""
    from engine.assembly import scheduler_limits as _limits
    from engine.kernels.attention import TorchAttention
    from engine.kernels.rowwise import RowwiseAttention

    options = harness.tiny_options(prompt_chunk_tokens=16)
    assert _limits(harness.tiny_options(deterministic=True, prompt_chunk_tokens=16), 512).chunk_grid == 0
    assert _limits(options, 512, RowwiseAttention.__new__(RowwiseAttention)).chunk_grid == 0
    assert _limits(options, 512, TorchAttention.__new__(TorchAttention)).chunk_grid == 16
    capped = harness.tiny_options(prompt_chunk_tokens=4096, max_tokens_per_step=64)
    assert _limits(capped, 512, TorchAttention.__new__(TorchAttention)).chunk_grid == 64
