"""speculative.method draft_model: drafts from a small model (or the target's first layers), verified by
the target exactly as prompt-lookup drafts are: answers unchanged, each question's drafts from its own
tokens only, rejected drafts gone from the drafter's cache."""

import random

import pytest
import torch

from engine.speculate.draft_model import DraftModel, DraftModelRefused

KIND = "llama"
ALWAYS = dict(speculative="draft_model", speculative_policy="always")


@pytest.fixture(scope="module")
def twin_dir(tiny_models, tmp_path_factory):
    """The tiny target saved as a model directory: as a draft model it agrees with the target."""
    path = tmp_path_factory.mktemp("twin")
    tiny_models[KIND].hf.save_pretrained(path)
    tiny_models[KIND].kev.tokenizer.save_pretrained(path)
    return str(path)


def _looping(harness, count, seed):
    from test_speculative import looping_prompts

    return looping_prompts(harness, count, seed)


def _same(off, on, questions):
    for q in questions:
        a, b = off.answers[q.qid], on.answers[q.qid]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), q.qid


def _accepted(outcome) -> int:
    return sum(a.usage.accepted_draft_tokens for a in outcome.answers.values())


@pytest.mark.parametrize("count", [1, 8])
def test_greedy_answers_unchanged_with_a_draft_model(tiny_models, harness, twin_dir, count):
    model = tiny_models[KIND].kev
    questions = _looping(harness, count, seed=200 + count)
    off = harness.run_core(model, questions, harness.tiny_options())
    twin = harness.run_core(model, questions, harness.tiny_options(draft_model=twin_dir, **ALWAYS))
    _same(off, twin, questions)
    # The twin drafts what the target draws: nearly every draft kept, far fewer forwards.
    assert _accepted(twin) >= 0.9 * twin.core.scheduler.speculation.num_draft_tokens > 0
    assert len(twin.plans) < len(off.plans)
    skipped = harness.run_core(model, questions, harness.tiny_options(draft_layers=1, **ALWAYS))
    _same(off, skipped, questions)
    assert skipped.core.scheduler.speculation.num_draft_tokens > 0
    for outcome in (twin, skipped):  # every question ended: the drafter holds nothing
        drafter = outcome.core.scheduler.speculation.drafter
        assert drafter.held == {} and drafter.num_used_blocks == 0


def test_a_layer_view_shares_the_targets_weights(tiny_models, harness):
    from engine import EngineCore

    core = EngineCore(tiny_models[KIND].kev, harness.tiny_options(draft_layers=1, **ALWAYS))
    drafter = core.scheduler.speculation.drafter
    assert drafter.weights.layers[0] is core.runner.weights.layers[0]
    assert drafter.weights.lm_head is core.runner.weights.lm_head and len(drafter.weights.layers) == 1
    assert drafter.kv.k.shape[0] == 1  # a cache for its one layer only


def test_over_an_fp16_cache_the_draft_caches_fp16_too_and_answers_are_unchanged(tiny_models, harness):
    model = tiny_models[KIND].kev
    questions = _looping(harness, 4, seed=207)
    off = harness.run_core(model, questions, harness.tiny_options(kv_dtype="fp16"))
    on = harness.run_core(model, questions, harness.tiny_options(kv_dtype="fp16", draft_layers=1, **ALWAYS))
    _same(off, on, questions)
    drafter = on.core.scheduler.speculation.drafter
    assert drafter.kv.k.dtype == on.core.kv.k.dtype == torch.float16
    assert on.core.scheduler.speculation.num_draft_tokens > 0


def test_preemption_chunked_prefill_and_seeded_sampling(tiny_models, harness, twin_dir):
    model = tiny_models[KIND].kev
    questions = _looping(harness, 8, seed=211)
    for i, q in enumerate(questions[::2]):
        q.params.update(temperature=0.7, seed=i, max_new_tokens=30)
    tight = dict(num_blocks=24, block_size=4, max_tokens_per_step=16)
    off = harness.run_core(model, questions, harness.tiny_options(**tight))
    on = harness.run_core(model, questions, harness.tiny_options(draft_model=twin_dir, **tight, **ALWAYS))
    _same(off, on, questions)
    assert on.core.scheduler.num_preemptions > 0 and _accepted(on) > 0
    assert on.core.pool.num_used == 0


def test_a_neighbour_holding_the_victims_answer_changes_none_of_its_drafts(tiny_models, harness):
    model = tiny_models[KIND].kev
    victim = _looping(harness, 1, seed=13)[0]
    victim.params["max_new_tokens"] = 40
    options = harness.tiny_options(draft_layers=1, **ALWAYS)
    solo = harness.run_core(model, [victim], options).answers["q0"]
    answer = list(solo.token_ids)
    bait = harness.Q("bait", victim.prompt_ids[-6:] + answer + victim.prompt_ids[-6:] + answer[:3],
                     dict(max_new_tokens=40, temperature=0.0))
    packed = harness.run_core(model, [bait, victim], options).answers["q0"]
    assert (packed.token_ids, packed.audit.drafted_tokens, packed.audit.accepted_draft_tokens) == (
        solo.token_ids, solo.audit.drafted_tokens, solo.audit.accepted_draft_tokens)


def _drafter(tiny_models, layers=None) -> DraftModel:
    from engine.speculate.draft_model import layer_view

    model = tiny_models[KIND].kev
    weights, spec = (model.weights, model.spec) if layers is None else layer_view(model.weights, model.spec, layers)
    return DraftModel(weights, spec, model.device, model.dtype, 4, capacity_tokens=256, block_size=4, name="t")


def test_rolled_back_drafts_leave_nothing_a_later_draft_reads(tiny_models):
    """Random accept/reject histories: after each, the drafter drafts exactly what a fresh drafter
    drafts from the same tokens, and holds only tokens of the question (verified or its last drafts)."""
    rng = random.Random(7)
    for trial in range(4):
        used, fresh = _drafter(tiny_models), None
        tokens = [rng.randrange(256) for _ in range(rng.randint(3, 12))]
        for _ in range(10):
            k = rng.randint(1, 4)
            (draft,) = used.draft_batch([("q", list(tokens), k)])
            fresh = _drafter(tiny_models)
            assert fresh.draft_batch([("q", list(tokens), k)]) == [draft]
            held = used.held["q"].tokens
            assert held[: len(tokens)] == tokens and held[len(tokens):] == list(draft[:-1])
            kept = rng.randint(0, len(draft))  # the target keeps `kept` drafts, then draws its own token
            tokens += list(draft[:kept]) + [rng.randrange(256)]
        used.forget("q")
        assert used.num_used_blocks == 0 and len(used.free) == used.kv.num_blocks


def test_questions_drafting_together_draft_what_they_draft_alone(tiny_models):
    rng = random.Random(3)
    asks = [(f"q{i}", [rng.randrange(256) for _ in range(rng.randint(2, 20))], rng.randint(1, 4)) for i in range(6)]
    together = _drafter(tiny_models, layers=1).draft_batch(asks)
    alone = [_drafter(tiny_models, layers=1).draft_batch([ask])[0] for ask in asks]
    assert together == alone and all(len(d) == k for d, (_, _, k) in zip(together, asks))


def test_a_full_drafter_cache_gives_up_idle_questions_then_drafts_nothing(tiny_models):
    drafter = _drafter(tiny_models)
    drafter.free = drafter.free[-3:]  # three 4-token blocks left
    assert drafter.draft_batch([("a", [1, 2, 3, 4, 5], 2)])[0]  # 6 positions: 2 blocks
    (draft,) = drafter.draft_batch([("b", [1, 2, 3, 4, 5, 6, 7], 2)])  # 8: needs a's blocks, a is idle
    assert draft and "a" not in drafter.held
    assert drafter.draft_batch([("b", list(range(9)), 1), ("c", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4)]) == [(
        drafter.draft_batch([("b", list(range(9)), 1)])[0]), ()]


def test_refusals_name_what_is_wrong(tiny_models, harness, tmp_path):
    from engine import EngineCore

    model = tiny_models[KIND].kev
    with pytest.raises(DraftModelRefused, match="needs speculative.draft_model"):
        EngineCore(model, harness.tiny_options(**ALWAYS))
    with pytest.raises(DraftModelRefused, match="draft_layers must be 1..1"):
        EngineCore(model, harness.tiny_options(draft_layers=2, **ALWAYS))
    other = tmp_path / "other-tokenizer"
    tiny_models[KIND].hf.save_pretrained(other)
    tokenizer = type(model.tokenizer).from_pretrained(model.tokenizer.name_or_path)
    tokenizer.add_tokens(["<kev-not-in-the-target>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(DraftModelRefused, match="does not share the target's tokenizer"):
        EngineCore(model, harness.tiny_options(draft_model=str(other), **ALWAYS))


def test_auto_times_the_drafter_too_and_keeps_answers(tiny_models, harness, twin_dir, logs):
    model = tiny_models[KIND].kev
    questions = _looping(harness, 4, seed=220)
    off = harness.run_core(model, questions, harness.tiny_options())
    auto = harness.run_core(model, questions, harness.tiny_options(speculative="draft_model", draft_model=twin_dir))
    _same(off, auto, questions)
    (table,) = [r for r in logs if r["event"] == "speculative.cost_model"]
    assert table["drafter"]["rows"][0] == 1 and auto.core.scheduler.speculation.drafter.costs is not None


def test_config_keys_reach_the_engine():
    import msgspec

    from engine import EngineOptions
    from schemas import DEFAULT_CONFIG

    cfg = msgspec.convert({"speculative": {"method": "draft_model", "draft_layers": 8}}, type(DEFAULT_CONFIG))
    options = EngineOptions.from_config(cfg)
    assert (options.speculative, options.draft_layers, options.draft_model) == ("draft_model", 8, None)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"speculative": {"draft_layers": 0}}, type(DEFAULT_CONFIG))


def test_the_audit_is_clean_and_deterministic_mode_bitwise(tiny_models, harness, twin_dir, logs):
    """Model drafts go through the same verify rows: every forward.mask passes the isolation check, and
    in deterministic mode each emitted token's logits have the bits they have without drafts."""
    from engine.audit import violations

    model = tiny_models[KIND].kev
    questions = _looping(harness, 6, seed=230)
    fixed = dict(deterministic=True, max_tokens_per_step=32, block_size=4)
    off = harness.run_core(model, questions, harness.tiny_options(**fixed))
    on = harness.run_core(model, questions, harness.tiny_options(audit=True, draft_model=twin_dir, **fixed, **ALWAYS))
    _same(off, on, questions)
    assert _accepted(on) > 0
    masks = [r for r in logs if r["event"] in ("forward.mask", "forward.isolation_violation")]
    assert masks and all(r["event"] == "forward.mask" and not violations(r) for r in masks)
    assert any(seg.get("draft_rows") for r in masks for seg in r["segments"])
    for q in questions:
        for j in range(len(on.answers[q.qid].token_ids)):
            index = len(q.prompt_ids) + j
            assert bool((on.draws[q.qid][index] == off.draws[q.qid][index]).all()), (q.qid, j)
