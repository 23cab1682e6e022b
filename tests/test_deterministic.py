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


def decline_row_linear(monkeypatch) -> None:
    """As if row_linear had failed its start-up check on this CPU: every matmul takes the tiles."""
    from engine.deterministic import rows

    monkeypatch.setattr(rows, "row_invariant", lambda row: False)
    monkeypatch.setattr(rows, "_COPIES", {})
    monkeypatch.setattr(rows, "_CHECKED", {})


def decline_one_call(monkeypatch) -> None:
    """As if row_linear and then packed fp32 weights' one call had failed their checks on this CPU."""
    from engine.deterministic import tiles

    decline_row_linear(monkeypatch)
    monkeypatch.setattr(tiles, "_one_call_invariant", lambda weight, row_counts: False)
    monkeypatch.setattr(tiles, "_ONE_CALL", {})
    monkeypatch.setattr(tiles.TileCheck, "_done", set())


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


@pytest.mark.parametrize("strict", [True, False], ids=["deterministic", "default-mode"])
def test_bitwise_identical_when_neighbours_force_a_preemption(tiny_models, harness, strict):
    """A pool of 8 blocks for 5 questions needing 3 each: the ones preempted because of their
    neighbours recompute their cache, and must still draw from bitwise their solo logits. Default mode
    too: its rows attend as decodes (the paged kernel, built here) and its matmuls are row_linear's."""
    from engine.kernels import paged_decode, row_linear

    if not strict and (paged_decode.kernel() is None or row_linear.kernel() is None):
        pytest.skip("default mode is bitwise only on Kev's own kernels, which this machine did not build")
    model = tiny_models["qwen2"].kev
    rng = random.Random(61)
    batch = [harness.Q(f"n{i}", harness.random_prompt(rng, rng.randint(1, 24)), dict(max_new_tokens=24))
             for i in range(5)]
    mode = deterministic if strict else (lambda h, **o: h.tiny_options(**o))
    packed = harness.run_core(model, batch, mode(harness, num_blocks=8))
    assert packed.core.scheduler.num_preemptions > 0
    for q in batch:
        solo = harness.run_core(model, [q], mode(harness)).logits[q.qid]
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


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Run the test body at this torch thread count, then restore the suite's (conftest sets 2)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_bitwise_at_each_thread_count(tiny_models, harness, threads):
    """Kernels split work by thread count; at any fixed count a row's bits must still ignore its
    neighbours, its chunking and a recompute (step budget small enough to split prompts)."""
    model = tiny_models["qwen3-tied"].kev
    options = deterministic(harness, max_tokens_per_step=48)
    solo = harness.run_core(model, [victim(harness)], options).logits["victim"]
    packed = harness.run_core(model, batch_with_victim(harness, 9, 17), options).logits["victim"]
    assert_bitwise(solo, packed)


def test_one_call_per_tile_fallback_is_bitwise_too(tiny_models, harness, monkeypatch):
    """Where the start-up check finds batched tiles not invariant, each tile gets its own call."""
    from engine.deterministic import tiles

    model = tiny_models["llama"].kev
    monkeypatch.setattr(tiles, "_key", lambda right: ("every shape",))
    monkeypatch.setattr(tiles, "_LOOPED", {("every shape",)})
    decline_one_call(monkeypatch)  # packed fp32 weights too
    solo = harness.run_core(model, [victim(harness)], deterministic(harness)).logits["victim"]
    packed = harness.run_core(model, batch_with_victim(harness, 5, 23), deterministic(harness)).logits["victim"]
    assert_bitwise(solo, packed)


def test_generated_tokens_are_recomputed_one_per_chunk(tiny_models, harness):
    """After a preemption, a question's generated tokens are replayed as decodes, one per chunk, so
    their rows take the same attention path as when they were first computed."""
    model = tiny_models["qwen2"].kev
    rng = random.Random(61)
    batch = [harness.Q(f"n{i}", harness.random_prompt(rng, rng.randint(1, 24)), dict(max_new_tokens=24))
             for i in range(5)]
    packed = harness.run_core(model, batch, deterministic(harness, num_blocks=8))
    assert packed.core.scheduler.num_preemptions > 0
    prompt_len = {q.qid: len(q.prompt_ids) for q in batch}
    for plan in packed.plans:
        for qid, start, length, _sample in plan:
            crosses = start < prompt_len[qid] < start + length
            assert not crosses, f"{qid}: a chunk mixes prompt and generated tokens"
            assert start < prompt_len[qid] or length == 1, f"{qid}: generated tokens computed {length} at once"


def test_seeded_sampling_is_bitwise_and_same_text(tiny_models, harness):
    """Sampling at temperature 0.8 with a seed: the same draws alone or packed, from the same bits."""
    model = tiny_models["llama3-rope-tied"].kev
    sampled = harness.Q("victim", harness.random_prompt(random.Random(5), 29),
                        dict(max_new_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, seed=1234))
    solo = harness.run_core(model, [sampled], deterministic(harness))
    rng = random.Random(8)
    others = [harness.Q(f"n{i}", harness.random_prompt(rng, rng.randint(3, 60)),
                        dict(max_new_tokens=rng.randint(4, 20), temperature=1.0, seed=i)) for i in range(6)]
    packed = harness.run_core(model, others[:3] + [sampled] + others[3:], deterministic(harness))
    assert packed.tokens("victim") == solo.tokens("victim")
    assert_bitwise(solo.logits["victim"], packed.logits["victim"])


def test_a_row_of_a_packed_fp32_matmul_has_one_value_at_every_row_count(monkeypatch):
    """fp32 weights with a packed copy take a few oneDNN calls of checked row counts where the start-up
    check allows it (else batched tiles): either way a row's bits must not move with how many rows share it."""
    from engine.deterministic import tiles
    from engine.kernels.packed_weight import PackedWeight, can_pack

    if not can_pack(torch.float32, torch.device("cpu")):
        pytest.skip("no oneDNN packed kernels in this torch build")
    generator = torch.Generator().manual_seed(5)
    weight = PackedWeight(torch.randn(96, 64, generator=generator))
    one_call = tiles.TileCheck.one_call(weight)
    calls, packed_linear = [], weight.packed_linear
    monkeypatch.setattr(weight, "packed_linear", lambda x, bias=None: calls.append(x.shape[0]) or packed_linear(x, bias))
    rows = torch.randn(600, 64, generator=generator)
    alone = tiles.tiled_linear(rows[:1], weight)[0]
    for count in (1, 2, 15, 16, 17, 100, 257, 600):
        calls.clear()
        assert torch.equal(tiles.tiled_linear(rows[:count], weight)[0], alone), count
        padded = -(-count // 16) * 16
        assert calls == (tiles._parts(padded, tiles.ONE_CALL_ROWS) if one_call else []), count
    assert torch.equal(tiles.tiled_linear(rows[590:600], weight)[9], tiles.tiled_linear(rows, weight)[599])


def test_batched_tiles_where_one_call_is_declined_are_bitwise_too(tiny_models, harness, monkeypatch):
    """Where a packed fp32 weight's one call fails the check, deterministic mode uses batched tiles."""
    from engine.deterministic import tiles

    decline_one_call(monkeypatch)
    model = tiny_models["llama"].kev
    solo = harness.run_core(model, [victim(harness)], deterministic(harness)).logits["victim"]
    assert not tiles._ONE_CALL
    packed = harness.run_core(model, batch_with_victim(harness, 5, 23), deterministic(harness)).logits["victim"]
    assert_bitwise(solo, packed)


@pytest.mark.parametrize("paged", ["1", "0"], ids=["every-row-as-a-decode", "fixed-tiles"])
def test_both_attention_paths_keep_the_bits_of_a_prompt_split_by_its_neighbours(tiny_models, harness, monkeypatch,
                                                                                paged):
    """Where the paged decode kernel runs, every row attends as a decode of its own position
    (RowwiseAttention); without it (KEV_PAGED_DECODE=0) the fixed tiles do. Either way: bitwise."""
    monkeypatch.setenv("KEV_PAGED_DECODE", paged)
    model = tiny_models["qwen2"].kev
    options = deterministic(harness, max_tokens_per_step=64)
    backend = EngineCore(model, options).runner.attention
    assert type(backend).__name__ == ("RowwiseAttention" if paged == "1" else "FixedTileAttention")
    solo = harness.run_core(model, [victim(harness)], options)
    rng = random.Random(8)
    others = [harness.Q(f"n{i}", harness.random_prompt(rng, 40), dict(max_new_tokens=NEW_TOKENS)) for i in range(3)]
    packed = harness.run_core(model, others + [victim(harness)], options)
    assert [length for plan in packed.plans for qid, _s, length, _ in plan if qid == "victim"][0] < 37
    assert_bitwise(solo.logits["victim"], packed.logits["victim"])
