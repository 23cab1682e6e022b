"""Kev's own forward gives transformers' logits, for every supported architecture, solo and packed."""

import json
import random

import pytest
import torch

from engine import load_model
from engine.model.model import SUPPORTED_ARCHITECTURES, UnsupportedModel, spec_from_config

DECODE_STEPS = 20
TOLERANCE = 1e-4  # fp32, max abs logit difference


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def assert_matches_hf(hf_model, prompt: list[int], outcome_tokens: list[int], kev_logits: list[torch.Tensor]):
    """Row i of Kev's logits drew token i; transformers sees the same full sequence in one forward."""
    assert len(kev_logits) == len(outcome_tokens) == DECODE_STEPS + 1
    reference = hf_logits(hf_model, prompt + outcome_tokens[:-1])
    for step, row in enumerate(kev_logits):
        expected = reference[len(prompt) - 1 + step]
        diff = (row - expected).abs().max().item()
        where = "prefill's last row" if step == 0 else f"decode step {step}"
        assert diff <= TOLERANCE, f"{where}: max |kev - transformers| = {diff:.2e} > {TOLERANCE}"
        assert outcome_tokens[step] == int(row.argmax())


@pytest.mark.parametrize("packed", [False, True], ids=["solo", "packed"])
def test_logits_match_transformers(tiny, harness, packed):
    rng = random.Random(7)
    # Prompts longer than llama3's original 64 positions exercise the scaled frequencies.
    lengths = [100, 13, 71] if packed else [100]
    questions = [harness.Q(f"q{i}", harness.random_prompt(rng, n), dict(max_new_tokens=DECODE_STEPS + 1,
                                                                           temperature=0.0))
                 for i, n in enumerate(lengths)]
    outcome = harness.run_core(tiny.kev, questions)
    for q in questions:
        assert outcome.answers[q.qid].finish_reason == "length"
        assert_matches_hf(tiny.hf, q.prompt_ids, outcome.tokens(q.qid), outcome.logits[q.qid])


def test_chunked_prefill_logits_match_transformers(tiny, harness):
    """A prompt computed 9 tokens per forward reads its earlier chunks from the cache correctly."""
    prompt = harness.random_prompt(random.Random(8), 60)
    outcome = harness.run_core(tiny.kev, [harness.Q("q", prompt, dict(max_new_tokens=DECODE_STEPS + 1))],
                               harness.tiny_options(max_tokens_per_step=9))
    assert sum(1 for plan in outcome.plans if plan and plan[0][2] > 1) == 7  # ceil(60 / 9) prompt chunks
    assert_matches_hf(tiny.hf, prompt, outcome.tokens("q"), outcome.logits["q"])


def test_bf16_runs_and_follows_fp32(tiny_models, smollm2_tokenizer, harness):
    """bf16 is a smoke test: finite logits, and each bf16 greedy pick is fp32's pick or a near-tie there."""
    tiny = tiny_models["llama"]
    bf16 = harness.kev_model_from_hf(tiny.hf, smollm2_tokenizer, dtype=torch.bfloat16, name="tiny-llama-bf16")
    prompt = harness.random_prompt(random.Random(9), 40)
    outcome = harness.run_core(bf16, [harness.Q("q", prompt, dict(max_new_tokens=DECODE_STEPS + 1))])
    tokens = outcome.tokens("q")
    assert len(tokens) == DECODE_STEPS + 1
    # Teacher-forced: fp32 transformers on bf16's own sequence, so one early flip does not cascade.
    reference = hf_logits(tiny.hf, prompt + tokens[:-1])[len(prompt) - 1:]
    agree = 0
    for step, (row, expected) in enumerate(zip(outcome.logits["q"], reference)):
        assert torch.isfinite(row).all(), f"step {step}: non-finite bf16 logits"
        # bf16 keeps ~3 significant digits: logits of size ~5 may move by a few hundredths per layer.
        assert (row - expected).abs().max().item() < 0.25, f"step {step}: bf16 logits far from fp32"
        gap = expected.max() - expected[tokens[step]]
        assert gap < 0.1, f"step {step}: bf16 picked a token {gap:.3f} below fp32's best"
        agree += int(tokens[step] == int(expected.argmax()))
    assert agree >= 0.8 * len(tokens)


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(UnsupportedModel) as error:
        spec_from_config(config)
    message = str(error.value)
    assert "GPT2LMHeadModel" in message
    assert all(name in message for name in SUPPORTED_ARCHITECTURES)

    # The same clear error from load_model on a directory holding such a model.
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel") as error:
        load_model(tmp_path, device="cpu")
    assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)
