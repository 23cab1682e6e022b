"""params.n: n answers for one question, each its own seeded sample, each what the question asked alone with
that sample's seed draws; the samples read one copy of the prompt's KV blocks; packed neighbours unchanged."""

import random

import pytest

from engine import EngineCore
from engine.intake import QuestionRejected
from schemas import Params, QuestionEvent, sample_seed

NEW_TOKENS = 10
pytest_plugins = ["serve_fixtures"]


def event(qid: str, prompt_ids_len: int = 40, **params) -> tuple[QuestionEvent, list[int]]:
    prompt = [random.Random(3).randrange(256) for _ in range(prompt_ids_len)]
    return QuestionEvent(question_id=qid, prompt="(token ids)",
                         params=Params(**{"max_new_tokens": NEW_TOKENS, **params})), prompt


def answer_all(core, questions) -> dict:
    """(question id, index) -> answer, and the forwards' plans."""
    for q, prompt in questions:
        core.add(q, prompt_ids=prompt)
    answers, forwards = {}, 0
    while core.has_work:
        forwards += 1
        for answer in core.step().answers:
            key = (answer.question_id, answer.index)
            assert key not in answers
            answers[key] = answer
    return answers


def test_n_seeded_samples_differ_and_each_is_its_seed_asked_alone(tiny_models, harness):
    model = tiny_models["llama"].kev
    core = EngineCore(model, harness.tiny_options())
    answers = answer_all(core, [event("q", n=4, temperature=0.9, seed=11, logprobs=True)])
    samples = [answers["q", i] for i in range(4)]
    assert len({a.token_ids for a in samples}) == 4
    for i, sample in enumerate(samples):
        assert sample.index == i and sample.question_id == "q"
        alone = answer_all(core, [event("alone", temperature=0.9, seed=sample_seed(11, i), logprobs=True)])["alone", 0]
        assert sample.token_ids == alone.token_ids and sample.text == alone.text
        assert [e.logprob for e in sample.logprobs] == pytest.approx([e.logprob for e in alone.logprobs], abs=1e-5)
    assert sample_seed(11, 0) == 11


def test_samples_share_the_prompt_blocks_and_neighbours_are_unchanged(tiny_models, harness):
    model = tiny_models["qwen2"].kev
    neighbours = [event(f"n{i}", 5 + 7 * i, temperature=0.8 if i % 2 else 0.0, seed=i) for i in range(3)]
    core = EngineCore(model, harness.tiny_options(block_size=8))
    alone = {q.question_id: answer_all(core, [(q, p)])[q.question_id, 0] for q, p in neighbours}
    asked = event("q", 40, n=3, temperature=1.0, seed=5)
    answers = answer_all(core, [neighbours[0], asked, *neighbours[1:]])
    for qid, answer in alone.items():
        assert answers[qid, 0].token_ids == answer.token_ids
    samples = [answers["q", i] for i in range(3)]
    # 40 prompt tokens are 5 full blocks; the first sample computes them, the others read 4 of them (the
    # last prompt token is always computed, for the first draw), each by reference
    assert sorted(a.usage.cached_prompt_tokens for a in samples) == [0, 32, 32]
    shared = set(samples[0].audit.blocks[:4])
    assert all(set(a.audit.blocks[:4]) == shared for a in samples)


def test_greedy_n_is_refused_unless_asked_for(tiny_models, harness):
    model = tiny_models["llama"].kev
    core = EngineCore(model, harness.tiny_options())  # the defaults are greedy
    with pytest.raises(QuestionRejected, match="identical answers"):
        core.add(*event("q", n=2)[:1], prompt_ids=[1, 2, 3])
    answers = answer_all(core, [event("q", n=2, allow_identical_samples=True)])
    assert answers["q", 0].token_ids == answers["q", 1].token_ids


def test_a_cancel_ends_every_sample(tiny_models, harness):
    model = tiny_models["llama"].kev
    core = EngineCore(model, harness.tiny_options())
    q, prompt = event("q", n=3, temperature=1.0, seed=2, max_new_tokens=200)
    core.add(q, prompt_ids=prompt)
    core.step()
    assert core.cancel("q")
    answers = []
    while core.has_work:
        answers += core.step().answers
    assert sorted((a.index, a.finish_reason) for a in answers) == [(0, "cancelled"), (1, "cancelled"),
                                                                   (2, "cancelled")]


def test_the_async_engine_and_the_pipeline_hand_back_every_sample(tiny_model, harness):
    import anyio

    from engine import Engine, IsolatedBatchPipeline

    model = tiny_model  # SmolLM2's vocabulary: a text prompt tokenizes within it
    question = {"prompt": "waves", "params": {"n": 3, "temperature": 1.0, "seed": 8, "max_new_tokens": 6,
                                              "logprobs": True}}

    async def ask():
        async with Engine(model, harness.tiny_options()) as engine:
            handle = await engine.submit(question)
            deltas = [delta async for delta in engine.stream(handle)]
            return await engine.wait(handle), await handle.wait_all(), deltas

    first, answers, deltas = anyio.run(ask)
    assert first is answers[0] and [a.index for a in answers] == [0, 1, 2]
    for answer in answers:
        mine = [d for d in deltas if d.index == answer.index]
        assert [d.seq for d in mine] == list(range(len(mine))) and mine[-1].done
        assert "".join(d.text for d in mine) == answer.text
        assert [e for d in mine for e in d.logprobs or ()] == list(answer.logprobs)
    piped = IsolatedBatchPipeline(model, options=harness.tiny_options()).run([question, "calm"], max_new_tokens=6)
    assert [(a.question_id, a.index) for a in piped] == [("q0", 0), ("q0", 1), ("q0", 2), ("q1", 0)]
    assert [a.token_ids for a in piped[:3]] == [a.token_ids for a in answers]


def test_the_isolation_audit_sees_the_shared_prompt_blocks_as_a_shared_prefix(tiny_models, harness, logs):
    model = tiny_models["llama"].kev
    core = EngineCore(model, harness.tiny_options(audit=True, block_size=8))
    answers = answer_all(core, [event("q", 40, n=3, temperature=1.0, seed=5), event("other", 30, temperature=0.0)])
    assert len(answers) == 4
    records = [e for e in logs if e["event"] in ("forward.mask", "forward.isolation_violation")]
    assert records and all(e["event"] == "forward.mask" for e in records)
    shared = [s for e in records for s in e["segments"] if s.get("prefix_chain")]
    assert shared  # the samples read the first one's prompt blocks, under their own chain
    assert core.pool.num_used == 0
