"""params.logprobs: each answer token's logprob and its top alternatives, equal to transformers' on the same
weights, for greedy and seeded answers, alone and packed with others; the cost is nobody's who did not ask."""

import random

import pytest
import torch

NEW_TOKENS = 12
TOLERANCE = 1e-4  # fp32 on both sides; the packed forward sums in another order


def question(harness, qid="asker", seed_prompt=5, length=20, **params):
    prompt = harness.random_prompt(random.Random(seed_prompt), length)
    return harness.Q(qid, prompt, dict(max_new_tokens=NEW_TOKENS, **params))


def neighbours(harness, count: int = 5) -> list:
    rng = random.Random(23)
    settings = [dict(temperature=0.0), dict(temperature=1.1, seed=7), dict(temperature=0.6, top_k=5, seed=8),
                dict(temperature=0.0, repetition_penalty=1.4), dict(temperature=0.9, top_p=0.6, seed=9)]
    return [harness.Q(f"n{i}", harness.random_prompt(rng, rng.randint(3, 40)),
                      dict(max_new_tokens=rng.randint(4, NEW_TOKENS), **settings[i % len(settings)]))
            for i in range(count)]


def reference(hf, prompt_ids: list[int], output_ids: tuple[int, ...], temperature: float = 1.0) -> torch.Tensor:
    """transformers' log-distribution over the vocabulary at each answer token's place (one forward)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + list(output_ids)])).logits[0].float()
    places = logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(output_ids)]
    return torch.log_softmax(places / temperature, dim=-1)


def assert_matches(answer, expected: torch.Tensor, top: int) -> None:
    assert answer.logprobs is not None and len(answer.logprobs) == len(answer.token_ids) > 0
    for place, (entry, token) in enumerate(zip(answer.logprobs, answer.token_ids)):
        assert entry.id == token
        assert entry.logprob == pytest.approx(expected[place, token].item(), abs=TOLERANCE)
        assert len(entry.top) == top
        logprobs = [alt.logprob for alt in entry.top]
        assert logprobs == sorted(logprobs, reverse=True)
        best = torch.topk(expected[place], top).values.tolist() if top else []
        assert logprobs == pytest.approx(best, abs=TOLERANCE)
        for alt in entry.top:
            assert alt.logprob == pytest.approx(expected[place, alt.id].item(), abs=TOLERANCE)
        if top and entry.logprob > logprobs[-1] + TOLERANCE:  # as likely as the top ones: it is among them
            assert token in [alt.id for alt in entry.top]


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.9, seed=31)], ids=["greedy", "seeded"])
def test_logprobs_equal_transformers_alone_and_packed(tiny_models, harness, params):
    tiny = tiny_models["llama"]
    asker = question(harness, logprobs=True, top_logprobs=5, **params)
    solo = harness.run_core(tiny.kev, [asker]).answers["asker"]
    batch = neighbours(harness)
    batch.insert(2, asker)
    packed_run = harness.run_core(tiny.kev, batch)
    packed = packed_run.answers["asker"]
    assert packed.token_ids == solo.token_ids
    expected = reference(tiny.hf, asker.prompt_ids, solo.token_ids)
    assert_matches(solo, expected, 5)
    assert_matches(packed, expected, 5)
    if params["temperature"] == 0.0:  # greedy: the chosen token is the most likely one
        assert all(entry.top[0].id == entry.id for entry in solo.logprobs)
    alone = {q.qid: harness.run_core(tiny.kev, [q]).answers[q.qid] for q in batch if q.qid != "asker"}
    for qid, answer in alone.items():  # the neighbours did not ask: unchanged, and nothing extra on them
        assert packed_run.answers[qid].token_ids == answer.token_ids
        assert packed_run.answers[qid].logprobs is None


def test_processed_logprobs_are_of_the_distribution_drawn_from(tiny_models, harness):
    tiny = tiny_models["qwen2"]
    asker = question(harness, logprobs=True, top_logprobs=3, logprobs_mode="processed", temperature=0.7, seed=4)
    answer = harness.run_core(tiny.kev, [asker]).answers["asker"]
    assert_matches(answer, reference(tiny.hf, asker.prompt_ids, answer.token_ids, temperature=0.7), 3)
    raw = harness.run_core(tiny.kev, [question(harness, logprobs=True, temperature=0.7, seed=4)]).answers["asker"]
    assert raw.token_ids == answer.token_ids  # asking for logprobs never changes the draw
    assert [e.logprob for e in raw.logprobs] != pytest.approx([e.logprob for e in answer.logprobs])


def test_logprobs_without_top_and_with_a_stop_string_stay_aligned(tiny_models, harness):
    tiny = tiny_models["llama"]
    plain = harness.run_core(tiny.kev, [question(harness, temperature=0.0, logprobs=True)]).answers["asker"]
    assert all(entry.top == () for entry in plain.logprobs)
    middle = len(plain.text) // 2
    stop = plain.text[middle:middle + 3]
    cut = harness.run_core(tiny.kev, [question(harness, temperature=0.0, logprobs=True, stop=[stop])]).answers["asker"]
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(plain.token_ids)
    assert len(cut.logprobs) == len(cut.token_ids) and cut.logprobs == plain.logprobs[:len(cut.token_ids)]


def test_logprobs_of_accepted_drafts_are_their_rows(tiny_models, harness):
    """Speculative decoding emits several tokens a step; each gets the logprobs of the row that drew it."""
    tiny = tiny_models["llama"]
    repeating = [7, 8, 9, 10] * 6  # a prompt the n-gram drafter copies from
    asker = harness.Q("asker", repeating, dict(max_new_tokens=NEW_TOKENS, temperature=0.0, logprobs=True,
                                               top_logprobs=2))
    plain = harness.run_core(tiny.kev, [asker]).answers["asker"]
    drafted = harness.run_core(tiny.kev, [asker], harness.tiny_options(speculative="ngram",
                                                                       speculative_policy="always"))
    answer = drafted.answers["asker"]
    assert answer.audit.accepted_draft_tokens > 0 and answer.token_ids == plain.token_ids
    assert [(e.id, [t.id for t in e.top]) for e in answer.logprobs] == \
        [(e.id, [t.id for t in e.top]) for e in plain.logprobs]
    assert [e.logprob for e in answer.logprobs] == pytest.approx([e.logprob for e in plain.logprobs], abs=TOLERANCE)
