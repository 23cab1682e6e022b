"""Deterministic mode: a question's logits are bitwise the same whatever shares its forward."""

import random

import pytest
import torch

from engine import EngineCore

NEW_TOKENS = 16
COMPOSITIONS = [(1, 1), (3, 2), (7, 3), (16, 4)]  # (neighbours, seed)


def victim(harness):
    return harness.Q("victim", harness.random_prompt(random.Random(99), 37),
                     dict(max_new_tokens=NEW_TOKENS, temperature=0.0))


def batch_with_victim(harness, count: int, seed: int) -> list:
    rng = random.Random(seed)
    others = [harness.Q(f"n{i}", harness.random_prompt(rng, rng.randint(1, 90)),
                        dict(max_new_tokens=rng.randint(4, NEW_TOKENS + 4), temperature=0.0))
              for i in range(count)]
    others.insert(rng.randint(0, count), victim(harness))
    return others


def deterministic(harness, **overrides):
    return harness.tiny_options(deterministic=True, **overrides)


def assert_bitwise(solo: list[torch.Tensor], packed: list[torch.Tensor]) -> None:
    assert len(solo) == len(packed) == NEW_TOKENS
    for step, (a, b) in enumerate(zip(solo, packed)):
        where = "prefill" if step == 0 else f"decode step {step}"
        assert torch.equal(a, b), f"{where}: logits differ by up to {(a - b).abs().max().item():.3e}"


@pytest.fixture
def solo_logits(tiny, harness):
    return harness.run_core(tiny.kev, [victim(harness)], deterministic(harness)).logits["victim"]


@pytest.mark.parametrize("count,seed", COMPOSITIONS, ids=[f"{n}-neighbours" for n, _ in COMPOSITIONS])
def test_logits_bitwise_identical_solo_and_packed(tiny, harness, solo_logits, count, seed):
    batch = batch_with_victim(harness, count, seed)
    outcome = harness.run_core(tiny.kev, batch, deterministic(harness))
    # Neighbours of other lengths come and go, so the victim meets several batch sizes.
    sizes = {len(plan) for plan in outcome.plans if any(qid == "victim" for qid, *_ in plan)}
    assert max(sizes) == count + 1 and (count == 1 or len(sizes) > 1)
    assert_bitwise(solo_logits, outcome.logits["victim"])


def test_bitwise_identical_when_admitted_mid_decode(tiny_models, harness):
    model = tiny_models["qwen2"].kev
    solo = harness.run_core(model, [victim(harness)], deterministic(harness)).logits["victim"]
    others = batch_with_victim(harness, 6, 5)
    others = [q for q in others if q.qid != "victim"]
    outcome = harness.run_core(model, others, deterministic(harness), later={3: [victim(harness)]})
    assert_bitwise(solo, outcome.logits["victim"])


def test_bitwise_identical_when_neighbours_fill_the_step_budget(tiny_models, harness):
    """Three 40-token neighbours ahead of the victim use most of a 64-token step, so the victim's
    prompt is split into chunks only when packed; its logits must still be bitwise its solo ones."""
    model = tiny_models["llama"].kev
    options = deterministic(harness, max_tokens_per_step=64)
    solo = harness.run_core(model, [victim(harness)], options)
    rng = random.Random(3)
    others = [harness.Q(f"n{i}", harness.random_prompt(rng, 40), dict(max_new_tokens=NEW_TOKENS)) for i in range(3)]
    packed = harness.run_core(model, others + [victim(harness)], options)
    victim_chunks = [length for plan in packed.plans for qid, _s, length, _ in plan if qid == "victim"]
    assert victim_chunks[0] < 37  # really split by the neighbours (alone it is one 37-token chunk)
    assert_bitwise(solo.logits["victim"], packed.logits["victim"])


def test_bitwise_identical_when_neighbours_force_a_preemption(tiny_models, harness):
    """A pool of 8 blocks for 5 questions needing 3 each: the ones preempted because of their
    neighbours recompute their cache, and must still draw from bitwise their solo logits."""
    model = tiny_models["qwen2"].kev
    rng = random.Random(61)
    batch = [harness.Q(f"n{i}", harness.random_prompt(rng, rng.randint(1, 24)), dict(max_new_tokens=24))
             for i in range(5)]
    packed = harness.run_core(model, batch, deterministic(harness, num_blocks=8))
    assert packed.core.scheduler.num_preemptions > 0
    for q in batch:
        solo = harness.run_core(model, [q], deterministic(harness)).logits[q.qid]
        for step, (a, b) in enumerate(zip(solo, packed.logits[q.qid])):
            assert torch.equal(a, b), f"{q.qid} step {step}: differs by {(a - b).abs().max().item():.3e}"


def test_deterministic_logits_still_match_the_default_math(tiny_models, harness):
    """Tiling changes which kernel runs, not the result: default and deterministic agree to 1e-5."""
    model = tiny_models["llama3-rope-tied"].kev
    plain = harness.run_core(model, [victim(harness)]).logits["victim"]
    tiled = harness.run_core(model, [victim(harness)], deterministic(harness)).logits["victim"]
    for a, b in zip(plain, tiled):
        assert (a - b).abs().max().item() < 1e-5


def test_default_mode_is_greedy_identical_and_numerically_close(tiny, harness):
    """Without deterministic mode the bits may move a little with the batch, the greedy answer does not."""
    solo = harness.run_core(tiny.kev, [victim(harness)])
    for count, seed in COMPOSITIONS[1::2]:
        packed = harness.run_core(tiny.kev, batch_with_victim(harness, count, seed))
        assert packed.tokens("victim") == solo.tokens("victim"), f"{count} neighbours"
        for a, b in zip(solo.logits["victim"], packed.logits["victim"]):
            assert (a - b).abs().max().item() < 1e-4


def test_a_second_engine_on_the_same_model_keeps_deterministic_mode(tiny_models, harness):
    """Two engines over one loaded model, one deterministic: creating the other must not switch the
    first one's guarantee off (EngineCore.__init__ sets the mode on the shared weights)."""
    model = tiny_models["llama"].kev
    strict = EngineCore(model, deterministic(harness))
    solo = harness.run_core(model, [victim(harness)], core=strict).logits["victim"]
    EngineCore(model, harness.tiny_options(deterministic=False))  # e.g. a default engine for other traffic
    packed = harness.run_core(model, batch_with_victim(harness, 7, 3), core=strict).logits["victim"]
    assert_bitwise(solo, packed)
