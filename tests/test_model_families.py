"""Gemma 2, Gemma 3, Mistral, Phi-3 and GLM: Kev's forward against transformers' on tiny random weights of
each family's shape, and a question's answer the same alone or packed, through every CPU attention path.

Windows are 8 keys and prompts up to 120 tokens, so every sliding layer hides most of a row's keys; soft
caps are small enough to bend the scores they cap.
"""

import random

import pytest
import torch

from engine.model.model import UnsupportedModel, spec_from_config

TOLERANCE = 1e-4  # fp32, max abs logit difference
NEW_TOKENS = 16
WINDOW = 8

GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
TINY_SHAPE_GEMMA3 = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6,
                         sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                         rope_parameters=GEMMA3_ROPE, query_pre_attn_scalar=32)
FAMILIES = {
    "mistral": ("MistralForCausalLM", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    # Gemma 2: layer 0 slides, layer 1 sees every key; query_pre_attn_scalar is not head_dim (16).
    "gemma2": ("Gemma2ForCausalLM", dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                         attn_implementation="eager")),
    "gemma3": ("Gemma3ForCausalLM", dict(sliding_window=WINDOW, query_pre_attn_scalar=32,
                                         layer_types=["sliding_attention", "full_attention"],
                                         rope_parameters=GEMMA3_ROPE, attn_implementation="eager")),
    # Phi-3: q/k/v and gate/up stored fused, half of each head rotating, a window on every layer.
    "phi3": ("Phi3ForCausalLM", dict(sliding_window=WINDOW, partial_rotary_factor=0.5, tie_word_embeddings=False)),
    # GLM: a quarter of each head rotating by interleaved pairs, q/k/v biases, gate/up fused.
    "glm": ("GlmForCausalLM", dict(partial_rotary_factor=0.25, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module")
def families(harness, smollm2_tokenizer):
    models = {}
    for i, kind in enumerate(FAMILIES):
        hf = harness.build_hf_tiny(kind, seed=300 + i, kinds=FAMILIES)
        models[kind] = (hf, harness.kev_model_from_hf(hf, smollm2_tokenizer, name=f"tiny-{kind}"))
    return models


@pytest.fixture(params=list(FAMILIES))
def family(request, families):
    return families[request.param]


def test_each_family_reads_its_config(families):
    specs = {kind: kev.spec for kind, (_hf, kev) in families.items()}
    assert {form.window for form in specs["mistral"].attention} == {WINDOW}
    assert [form.window for form in specs["gemma2"].attention] == [WINDOW, None]
    assert {(form.scale, form.softcap) for form in specs["gemma2"].attention} == {(24 ** -0.5, 2.0)}
    assert specs["gemma2"].final_softcap == 3.0 and specs["gemma2"].activation == "gelu_tanh"
    assert specs["gemma3"].layer_rope == ("sliding_attention", "full_attention") and specs["gemma3"].qk_norm
    assert specs["phi3"].rotary_dim == 8 and specs["glm"].rotary_dim == 4 and specs["glm"].rope_interleaved
    # The C++ stack runs Llama's layer with a window (Mistral); the others take the Python forward.
    assert {kind for kind, (_hf, kev) in families.items() if kev.weights.stack is not None} == {"mistral"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_stack_gives_mistral_s_windowed_rows_the_python_forward_s_bits(families, harness, smollm2_tokenizer,
                                                                          dtype):
    from engine import EngineCore

    hf, _kev = families["mistral"]
    model = harness.kev_model_from_hf(hf, smollm2_tokenizer, dtype=dtype, name="tiny-mistral-stack")
    batch = questions(harness, [70, 12, 41], seed=5)
    outcomes, calls = [], []
    for stack in (True, False):
        core = EngineCore(model, harness.tiny_options(max_tokens_per_step=32))
        if stack:
            real = core.runner.weights.stack.forward
            core.runner.weights.stack.forward = lambda *a: calls.append(1) or real(*a)
        else:
            core.runner.weights.stack = None
        outcomes.append(harness.run_core(model, batch, core=core))
    assert calls, "the stack never ran"
    for q in batch:
        for a, b in zip(outcomes[0].logits[q.qid], outcomes[1].logits[q.qid], strict=True):
            assert torch.equal(a, b), (q.qid, (a - b).abs().max().item())


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def assert_matches_hf(hf_model, prompt, tokens, kev_logits):
    reference = hf_logits(hf_model, prompt + tokens[:-1])
    assert len(kev_logits) == len(tokens) == NEW_TOKENS
    for step, row in enumerate(kev_logits):
        expected = reference[len(prompt) - 1 + step]
        diff = (row - expected).abs().max().item()
        assert diff <= TOLERANCE, f"step {step}: max |kev - transformers| = {diff:.2e}"
        assert tokens[step] == int(row.argmax())


def questions(harness, lengths, seed=7):
    rng = random.Random(seed)
    return [harness.Q(f"q{i}", harness.random_prompt(rng, n), dict(max_new_tokens=NEW_TOKENS, temperature=0.0))
            for i, n in enumerate(lengths)]


@pytest.mark.parametrize("paged", ["1", "0"], ids=["paged-rows", "torch-sdpa"])
def test_logits_match_transformers_packed(family, harness, monkeypatch, paged):
    """Three questions in one engine, prompts cut into 23-token chunks, through the paged kernel (every row
    a decode of its own position) or, without it, torch SDPA per prompt and padded decode groups."""
    monkeypatch.setenv("KEV_PAGED_DECODE", paged)
    hf, kev = family
    batch = questions(harness, [60, 13, 35])
    outcome = harness.run_core(kev, batch, harness.tiny_options(max_tokens_per_step=23))
    assert max(len(plan) for plan in outcome.plans) > 1
    for q in batch:
        assert_matches_hf(hf, q.prompt_ids, outcome.tokens(q.qid), outcome.logits[q.qid])


@pytest.mark.parametrize("paged", ["1", "0"], ids=["every-row-as-a-decode", "fixed-tiles"])
def test_deterministic_mode_is_bitwise_solo_or_packed_and_matches_transformers(family, harness, monkeypatch, paged):
    monkeypatch.setenv("KEV_PAGED_DECODE", paged)
    hf, kev = family
    options = harness.tiny_options(deterministic=True, max_tokens_per_step=64)
    victim, *others = questions(harness, [40, 25, 30, 5], seed=11)
    solo = harness.run_core(kev, [victim], options)
    packed = harness.run_core(kev, others + [victim], options)
    assert max(len(plan) for plan in packed.plans) > 1
    for step, (a, b) in enumerate(zip(solo.logits["q0"], packed.logits["q0"], strict=True)):
        assert torch.equal(a, b), f"step {step}: logits differ by {(a - b).abs().max().item():.3e}"
    assert_matches_hf(hf, victim.prompt_ids, solo.tokens("q0"), solo.logits["q0"])


def test_greedy_tokens_solo_equal_packed(family, harness, count=7, seed=3):
    _hf, kev = family
    victim = questions(harness, [30], seed=1234)[0]
    solo = harness.run_core(kev, [victim]).tokens("q0")
    rng = random.Random(seed)
    others = [harness.Q(f"n{i}", harness.random_prompt(rng, rng.randint(1, 120)),
                        dict(max_new_tokens=rng.randint(4, NEW_TOKENS), temperature=0.0)) for i in range(count)]
    packed = harness.run_core(kev, others[: count // 2] + [victim] + others[count // 2:])
    assert max(len(plan) for plan in packed.plans) == count + 1
    assert packed.tokens("q0") == solo


def test_int8_weights_follow_fp32(families, harness, smollm2_tokenizer):
    """Gemma 2 with weight-only int8 runs its own (1 + w) norms, caps and windows: near fp32's logits."""
    hf, kev = families["gemma2"]
    int8 = harness.kev_model_from_hf(hf, smollm2_tokenizer, name="tiny-gemma2-int8")
    int8.weights.quantize_int8()
    prompt = harness.random_prompt(random.Random(5), 40)
    outcome = harness.run_core(int8, [harness.Q("q", prompt, dict(max_new_tokens=4))])
    reference = hf_logits(hf, prompt + outcome.tokens("q")[:-1])[len(prompt) - 1:]
    for row, expected in zip(outcome.logits["q"], reference):  # test_precision.py's bound for int8 weights
        assert (row - expected).abs().max().item() < 0.08 * expected.abs().max().item()


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "glm"])
def test_bf16_follows_fp32(families, harness, smollm2_tokenizer, kind):
    """bf16 is a smoke test, as for the Llama kinds: finite logits near fp32 transformers' on bf16's own
    sequence, each pick fp32's or a near-tie there."""
    hf, _kev = families[kind]
    bf16 = harness.kev_model_from_hf(hf, smollm2_tokenizer, dtype=torch.bfloat16, name=f"tiny-{kind}-bf16")
    prompt = harness.random_prompt(random.Random(9), 40)
    outcome = harness.run_core(bf16, [harness.Q("q", prompt, dict(max_new_tokens=NEW_TOKENS))])
    tokens = outcome.tokens("q")
    reference = hf_logits(hf, prompt + tokens[:-1])[len(prompt) - 1:]
    for step, (row, expected) in enumerate(zip(outcome.logits["q"], reference, strict=True)):
        assert torch.isfinite(row).all()
        assert (row - expected).abs().max().item() < 0.25, f"step {step}: bf16 logits far from fp32"
        assert expected.max() - expected[tokens[step]] < 0.1, f"step {step}: bf16 picked far below fp32's best"


def test_an_unsupported_rope_type_is_named(harness):
    hf = harness.build_hf_tiny("mistral", kinds=FAMILIES)
    config = hf.config
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    from engine.model.model import rope_tables

    with pytest.raises(UnsupportedModel, match="rope_type 'dynamic'.*default, linear, llama3, yarn"):
        rope_tables(config, spec_from_config(config))


def test_a_gguf_of_another_architecture_is_one_line_naming_it(tmp_path, capsys):
    """Refused before any conversion, from load_model and from the command line."""
    import gguf

    from engine import load_model
    from engine.model.loader import GGUF_ARCHITECTURES
    from kev_async.cli import main

    path = tmp_path / "tiny-rwkv.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv6")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel, match="GGUF architecture 'rwkv6' is not supported") as error:
        load_model(path, device="cpu")
    assert all(name in str(error.value) for name in GGUF_ARCHITECTURES)
    assert main(["model", "prepare", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kev model prepare: tiny-rwkv.gguf: GGUF architecture 'rwkv6'") and err.count("\n") == 1


def test_gemma3_multimodal_checkpoint_runs_its_language_model(harness, smollm2_tokenizer):
    """Gemma 3 4B and up (Gemma3ForConditionalGeneration): the text model under model.language_model.,
    its text_config's layer types and rotary tables; text prompts give transformers' logits."""
    import transformers

    text = dict(TINY_SHAPE_GEMMA3, vocab_size=harness.VOCAB)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_id=harness.VOCAB - 1, boi_token_index=harness.VOCAB - 2,
                                       eoi_token_index=harness.VOCAB - 3)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(9)
    hf = harness.randomize(transformers.Gemma3ForConditionalGeneration(config).eval())
    kev = harness.kev_model_from_hf(hf, smollm2_tokenizer, name="tiny-gemma3-multimodal")
    assert kev.spec.layer_rope == ("sliding_attention", "full_attention") and kev.spec.tie_embeddings
    batch = questions(harness, [60, 9], seed=21)
    outcome = harness.run_core(kev, batch)
    for q in batch:
        assert_matches_hf(hf, q.prompt_ids, outcome.tokens(q.qid), outcome.logits[q.qid])


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}], ids=["yarn", "linear"])
def test_scaled_rotary_tables_match_transformers(harness, smollm2_tokenizer, rope):
    """Rope scaling beyond llama3's (conftest's llama3-rope-tied kind): yarn (Qwen2.5's long-context
    configs) and linear, on prompts longer than the original 64 positions."""
    hf = harness.build_hf_tiny("qwen2", seed=41, rope_parameters=rope)
    kev = harness.kev_model_from_hf(hf, smollm2_tokenizer, name=f"tiny-qwen2-{rope['rope_type']}")
    batch = questions(harness, [90, 20], seed=13)
    outcome = harness.run_core(kev, batch)
    for q in batch:
        assert_matches_hf(hf, q.prompt_ids, outcome.tokens(q.qid), outcome.logits[q.qid])
