"""Per-question sampling: its own temperature, top-k/top-p, penalty and seed, whatever shares the batch."""

import random

import pytest
import torch

from engine import EngineOptions
from engine.sampling_defaults import Defaults

NEW_TOKENS = 24


def question(harness, qid="victim", seed_prompt=5, length=25, **params):
    prompt = harness.random_prompt(random.Random(seed_prompt), length)
    return harness.Q(qid, prompt, dict(max_new_tokens=NEW_TOKENS, **params))


def mixed_neighbours(harness, count: int = 9) -> list:
    """Neighbours with every kind of sampling setting."""
    rng = random.Random(17)
    settings = [dict(temperature=0.0), dict(temperature=1.3, seed=1), dict(temperature=0.5, top_k=3, seed=2),
                dict(temperature=0.9, top_p=0.5, seed=3), dict(temperature=0.0, repetition_penalty=1.8),
                dict(temperature=2.0, seed=4, repetition_penalty=1.2)]
    return [harness.Q(f"n{i}", harness.random_prompt(rng, rng.randint(1, 80)),
                      dict(max_new_tokens=rng.randint(8, NEW_TOKENS), **settings[i % len(settings)]))
            for i in range(count)]


def tokens_of(harness, model, q, options=None) -> list[int]:
    return harness.run_core(model, [q], options).tokens(q.qid)


def test_seeded_sample_is_the_same_solo_and_packed(tiny, harness):
    victim = question(harness, temperature=0.8, seed=1234)
    solo = harness.run_core(tiny.kev, [victim]).answers["victim"]
    batch = mixed_neighbours(harness)
    batch.insert(4, victim)
    packed = harness.run_core(tiny.kev, batch).answers["victim"]
    assert packed.token_ids == solo.token_ids
    assert packed.text == solo.text
    assert solo.token_ids != tuple(tokens_of(harness, tiny.kev, question(harness, temperature=0.0)))  # it sampled


def test_different_seeds_give_different_samples(tiny_models, harness):
    model = tiny_models["qwen2"].kev
    first = tokens_of(harness, model, question(harness, temperature=0.8, seed=1))
    second = tokens_of(harness, model, question(harness, temperature=0.8, seed=2))
    again = tokens_of(harness, model, question(harness, temperature=0.8, seed=1))
    assert first != second
    assert first == again


def test_top_k_1_and_tiny_top_p_are_greedy(tiny, harness):
    greedy = tokens_of(harness, tiny.kev, question(harness, temperature=0.0))
    assert tokens_of(harness, tiny.kev, question(harness, temperature=0.8, top_k=1, seed=9)) == greedy
    assert tokens_of(harness, tiny.kev, question(harness, temperature=1.5, top_p=1e-6, seed=9)) == greedy


def test_repetition_penalty_matches_transformers(tiny, harness):
    """Greedy with a repetition penalty: a different answer than without, and the one transformers gives."""
    q = question(harness, length=12, temperature=0.0)
    penalised = question(harness, length=12, temperature=0.0, repetition_penalty=1.5)
    plain, with_penalty = tokens_of(harness, tiny.kev, q), tokens_of(harness, tiny.kev, penalised)
    assert with_penalty != plain
    assert len(set(with_penalty)) >= len(set(plain))

    for params, ours in ((dict(), plain), (dict(repetition_penalty=1.5), with_penalty)):
        with torch.no_grad():
            out = tiny.hf.generate(torch.tensor([q.prompt_ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                   pad_token_id=0, eos_token_id=None, **params)
        assert out[0, len(q.prompt_ids):].tolist() == ours, params


def test_defaults_update_during_a_run_keeps_each_questions_version(tiny_models, harness):
    model = tiny_models["llama"].kev
    options = harness.tiny_options(defaults=Defaults(temperature=0.0))
    before = question(harness, "before", seed_prompt=1, seed=77)  # no temperature: takes the default
    after = question(harness, "after", seed_prompt=2, seed=78)
    outcome = harness.run_core(model, [before], options,
                               later={4: [lambda core: core.defaults.update(temperature=1.5), after]})
    assert outcome.core.defaults.current.version == 2

    old, new = outcome.answers["before"], outcome.answers["after"]
    assert old.audit.defaults_version == 1 and new.audit.defaults_version == 2
    # `before` was mid-answer when the default changed: it stays greedy to the end.
    assert list(old.token_ids) == tokens_of(harness, model, question(harness, "before", seed_prompt=1,
                                                                     temperature=0.0))
    # `after` samples at the new default temperature with its own seed.
    hot = question(harness, "after", seed_prompt=2, seed=78, temperature=1.5)
    assert list(new.token_ids) == tokens_of(harness, model, hot)
    assert list(new.token_ids) != tokens_of(harness, model, question(harness, "after", seed_prompt=2,
                                                                     temperature=0.0))


def test_defaults_update_rejects_unknown_names(tiny_models, harness):
    outcome = harness.run_core(tiny_models["llama"].kev, [])
    with pytest.raises(ValueError, match="temprature"):
        outcome.core.defaults.update(temprature=0.5)
    assert outcome.core.defaults.current.version == 1


def test_kev_temperature_sets_the_default(tiny_models, harness, monkeypatch):
    # The config loader is the one reader of KEV_TEMPERATURE; the engine takes it from the config.
    from kev_async.settings import load_config

    assert EngineOptions.from_config(load_config(env={"KEV_TEMPERATURE": "0.7"})).defaults.temperature == 0.7
    assert EngineOptions.from_config(load_config(env={})).defaults.temperature == 0.0
    monkeypatch.setenv("KEV_TEMPERATURE", "0.7")
    assert EngineOptions().defaults.temperature == 0.0  # a library caller's options: the schema's default
    model = tiny_models["llama"].kev
    env_options = harness.tiny_options(defaults=EngineOptions.from_config(load_config()).defaults)
    unset = tokens_of(harness, model, question(harness, seed=3), env_options)
    assert unset == tokens_of(harness, model, question(harness, seed=3, temperature=0.7))
    assert unset != tokens_of(harness, model, question(harness, temperature=0.0))
    # A question's own temperature still wins over the environment's default.
    explicit = tokens_of(harness, model, question(harness, seed=3, temperature=0.0), env_options)
    assert explicit == tokens_of(harness, model, question(harness, temperature=0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_takes_the_first_of_equal_maxima_as_argmax_does(dtype):
    from engine.model.sampler import greedy

    logits = torch.randn(8, 49152, generator=torch.Generator().manual_seed(0)).to(dtype)
    top = logits.max() + 1  # above every random logit
    logits[:, 4000] = top  # ties: row i also has the maximum at 40000 + i, after 4000 ...
    logits[torch.arange(8), 40000 + torch.arange(8)] = top
    logits[3, 17] = top  # ... and row 3 once more, before it
    assert greedy(logits) == logits.argmax(dim=-1).tolist() == [4000] * 3 + [17] + [4000] * 4
