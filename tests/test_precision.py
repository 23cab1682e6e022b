"""Reduced precision: bf16, weight-only int8, int8 KV, fp16 KV. Precision may change an answer; a neighbour may not.

Tolerances are fractions of the largest fp32 logit (the tiny models' logits reach about 3), each
about twice what was measured on these models, so they catch a broken path (errors of order 1) and
not rounding:
- bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2 %); weights, activations and every
  matmul output are rounded, a few dozen roundings deep: measured 1.6-2 %, tolerance 4 %.
- int8 weights round every weight (the embedding too) by up to max|row| / 254, 0.4 % of the row's
  largest, a systematic error per output channel, and the kernel runs its activations in bf16:
  measured 4-5 %, tolerance 8 %.
- int8 KV rounds each key/value by up to max|head| / 254, only inside attention: measured 1-2.3 %,
  tolerance 4 %.
- fp16 KV keeps 11 significant bits of each key/value (relative rounding 2^-12), only inside attention:
  measured 0.05-0.06 %, tolerance 0.2 %.
The real model's agreement (same greedy answers, logit difference) is `python -m benchmarks.precision`'s job.
"""

from __future__ import annotations

import random

import pytest
import torch
from structlog.testing import capture_logs

from engine import EngineCore, EngineOptions
from engine.kv.cache import KVCache, plan_num_blocks
from engine.kernels.quant import Int8Weight
from engine.kernels.row_linear import RowWeight

PRECISIONS = {  # name -> (model dtype, int8 weights, kv dtype)
    "bf16": (torch.bfloat16, False, "auto"),
    "int8-weights": (torch.float32, True, "auto"),
    "int8-kv": (torch.float32, False, "int8"),
    "fp16-kv": (torch.float32, False, "fp16"),
}
TOLERANCE = {"bf16": 0.04, "int8-weights": 0.08, "int8-kv": 0.04, "fp16-kv": 0.002}  # x the largest |fp32 logit|
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def models(tiny_models, harness, smollm2_tokenizer):
    """Per precision, a Kev model of the qwen3-tied tiny (q/k norms, tied head: the int8 head is the
    int8 embedding) and of the llama tiny (untied head, own int8 embedding)."""
    built = {}
    for kind in ("qwen3-tied", "llama"):
        hf = tiny_models[kind].hf
        for name, (dtype, int8, _kv) in PRECISIONS.items():
            model = harness.kev_model_from_hf(hf, smollm2_tokenizer, dtype=dtype, name=f"tiny-{kind}-{name}")
            if int8:
                model.weights.quantize_int8()
            built[kind, name] = model
        built[kind, "fp32"] = tiny_models[kind].kev
    return built


def victim(harness):
    return harness.Q("victim", harness.random_prompt(random.Random(99), 37),
                     dict(max_new_tokens=NEW_TOKENS, temperature=0.0))


def packed(harness, count=7, seed=3):
    rng = random.Random(seed)
    others = [harness.Q(f"n{i}", harness.random_prompt(rng, rng.randint(1, 90)),
                        dict(max_new_tokens=rng.randint(4, NEW_TOKENS + 4), temperature=0.0)) for i in range(count)]
    others.insert(rng.randint(0, count), victim(harness))
    return others


def options(harness, name, **overrides):
    return harness.tiny_options(kv_dtype=PRECISIONS[name][2], **overrides)


@pytest.mark.parametrize("kind", ["qwen3-tied", "llama"])
@pytest.mark.parametrize("name", list(PRECISIONS))
def test_first_logits_close_to_fp32(models, harness, kind, name):
    reference = harness.run_core(models[kind, "fp32"], [victim(harness)], harness.tiny_options())
    reduced = harness.run_core(models[kind, name], [victim(harness)], options(harness, name))
    first, ref = reduced.logits["victim"][0], reference.logits["victim"][0]
    difference = (first - ref).abs().max().item() / ref.abs().max().item()
    assert 0 < difference <= TOLERANCE[name], f"{name}: first-step logits differ from fp32 by {difference:.1%}"


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_greedy_solo_equals_packed(models, harness, name):
    model = models["qwen3-tied", name]
    solo = harness.run_core(model, [victim(harness)], options(harness, name))
    batch = harness.run_core(model, packed(harness), options(harness, name))
    assert solo.tokens("victim") == batch.tokens("victim")


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_deterministic_mode_bitwise_in_every_precision(models, harness, name):
    model = models["qwen3-tied", name]
    solo = harness.run_core(model, [victim(harness)], options(harness, name, deterministic=True))
    batch = harness.run_core(model, packed(harness, 11, 5), options(harness, name, deterministic=True))
    for step, (a, b) in enumerate(zip(solo.logits["victim"], batch.logits["victim"], strict=True)):
        assert torch.equal(a, b), f"{name}, step {step}: logits differ by {(a - b).abs().max().item():.3e}"


def test_int8_weights_hold_int8_and_a_quarter_of_the_bytes(models):
    full, quantized = models["llama", "fp32"].weights, models["llama", "int8-weights"].weights
    # row_linear's int8 panels where it multiplies (core.matmul), torch's int8 kernel's matrices elsewhere
    held = [m.packed if isinstance(m, RowWeight) else m.qweight for m in quantized.matrices()]
    assert all(isinstance(m, (RowWeight, Int8Weight)) for m in quantized.matrices())
    assert all(t.dtype == torch.int8 for t in held)
    assert quantized.nbytes < 0.3 * full.nbytes


def test_int8_kv_pool_holds_over_3_5x_the_tokens(tiny):
    spec, budget = tiny.kev.spec, 64 << 20
    fp32 = plan_num_blocks(spec, torch.float32, torch.device("cpu"), 16, budget_bytes=budget)
    int8 = plan_num_blocks(spec, torch.int8, torch.device("cpu"), 16, budget_bytes=budget)
    assert int8 >= 3.5 * fp32
    cache = KVCache(spec, int8, 16, torch.int8, torch.device("cpu"), torch.float32)
    assert cache.nbytes <= budget  # scales included


def test_fp16_kv_pool_holds_twice_fp32_s_tokens_and_the_engine_stores_fp16(models, harness, tiny):
    spec, budget = tiny.kev.spec, 64 << 20
    fp32 = plan_num_blocks(spec, torch.float32, torch.device("cpu"), 16, budget_bytes=budget)
    assert plan_num_blocks(spec, torch.float16, torch.device("cpu"), 16, budget_bytes=budget) == 2 * fp32
    core = EngineCore(models["llama", "fp32"], harness.tiny_options(kv_dtype="fp16"))
    assert core.kv.k.dtype == core.kv.v.dtype == torch.float16 and core.kv.compute_dtype == torch.float32


def test_an_fp16_cache_under_bf16_compute_is_refused_in_words(models, harness):
    with pytest.raises(ValueError, match="fp16 under bf16 compute would save nothing.*kv_cache.dtype auto"):
        EngineCore(models["llama", "bf16"], harness.tiny_options(kv_dtype="fp16"))


def test_int8_kv_engine_stores_int8(models, harness):
    core = EngineCore(models["llama", "fp32"], harness.tiny_options(kv_dtype="int8"))
    assert core.kv.k.dtype == torch.int8 and core.kv.k_scale.shape == core.kv.k.shape[:3]


def test_int8_kv_subtracts_the_models_key_means(models, harness):
    model = models["llama", "fp32"]
    core = EngineCore(model, harness.tiny_options(kv_dtype="int8"))
    means = model.key_means()
    assert means.shape == (model.spec.num_layers, model.spec.num_kv_heads, model.spec.head_dim)
    assert torch.equal(core.kv.k_center, means) and model.key_means() is means  # computed once per model
    assert means.abs().max() > 0


def test_key_means_are_the_mean_stored_key_of_the_calibration_prompt(models, harness):
    """What key_means returns is what an fp32 cache holds for the calibration prompt, averaged: each
    layer's keys after rotary, over the chat-templated prompt's tokens."""
    from engine.model.key_means import CALIBRATION_TEXT
    from engine.prompt import as_question, encode_prompt
    from schemas import Params, QuestionEvent

    model = models["llama", "fp32"]
    core = EngineCore(model, harness.tiny_options())
    core.stop_token_ids = ()  # the prompt's blocks stay held after its first token
    ids = [i for i in encode_prompt(model.tokenizer, as_question(CALIBRATION_TEXT)) if i < model.spec.vocab_size]
    seq = core.add(QuestionEvent(question_id="calibration", prompt="-", params=Params(max_new_tokens=4)), prompt_ids=ids)
    while not seq.output_ids:
        core.step()
    slots = torch.tensor([b * core.block_size + i for b in seq.block_ids for i in range(core.block_size)][: len(ids)])
    stored = core.kv.k[:, slots].float().mean(1)  # [layers, kv_heads, head_dim]
    torch.testing.assert_close(stored, model.key_means(), atol=1e-5, rtol=1e-4)


def _scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return torch.einsum("hd,thd->ht", q, keys).softmax(-1)


def test_a_common_key_offset_costs_int8_kv_no_precision(tiny):
    """Keys with a large shared offset on a few channels, as Llama keys have: with the offset as the
    cache's key centre the attention weights come out as exact as without any offset, where a cache
    that rounds the raw keys loses most of their resolution to it."""
    spec = tiny.kev.spec
    gen = torch.Generator().manual_seed(0)
    shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
    offset = torch.zeros(shape)
    offset[..., :4] = 20.0
    keys = torch.randn(48, spec.num_kv_heads, spec.head_dim, generator=gen)
    q = torch.randn(spec.num_kv_heads, spec.head_dim, generator=gen)
    exact = _scores(q, keys)
    slots = torch.arange(48)

    def weights_read_back(center):
        cache = KVCache(spec, 4, 16, torch.int8, torch.device("cpu"), torch.float32, key_center=center)
        stored, _ = cache.layers[0].write(slots, keys + offset[0], torch.zeros_like(keys))
        assert torch.equal(stored, cache.layers[0].gather(slots)[0])  # a later read sees the same keys
        return _scores(q, stored)

    centred = (weights_read_back(offset) - exact).abs().max()
    raw = (weights_read_back(None) - exact).abs().max()
    assert centred < 0.01 and raw > 10 * centred  # measured: 0.005 against 0.098


def test_config_switches_reach_the_engine(tmp_path):
    from engine import load_model
    from schemas.config_validation import config_from_dict
    from serve_fixtures import build_tiny_model_dir

    cfg = config_from_dict({"core": {"precision": "bf16", "weights": "int8"}, "kv_cache": {"dtype": "int8"}})
    assert (cfg.core.precision, cfg.core.weights, cfg.kv_cache.dtype) == ("bf16", "int8", "int8")
    assert EngineOptions.from_config(cfg).kv_dtype == "int8"
    model = load_model(build_tiny_model_dir(tmp_path), device="cpu", dtype=cfg.core.precision,
                       weights=cfg.core.weights)
    down = model.weights.layers[0].down
    assert model.weight_format == "int8" and (down.int8 if isinstance(down, RowWeight) else isinstance(down, Int8Weight))


def test_bf16_without_cpu_flags_falls_back_to_fp32_with_a_log_line(monkeypatch):
    from engine.kernels import cpu_features

    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    with capture_logs() as logs:
        dtype = cpu_features.compute_dtype(torch.bfloat16, torch.device("cpu"))
    assert dtype == torch.float32
    assert [entry["event"] for entry in logs] == ["precision.bf16_fallback"]
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert cpu_features.compute_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16


def test_deterministic_refuses_int8_weights_where_the_kernel_is_not_row_invariant(tiny_models, harness, monkeypatch):
    """torch's int8 kernel (core.matmul: library) takes the tile check; row_linear's int8 panels need none."""
    from engine.deterministic import tiles

    monkeypatch.setattr(tiles, "_per_call_invariant", lambda weight: False)
    monkeypatch.setattr(tiles.TileCheck, "_done", set())
    tiny = tiny_models["llama"]
    library = harness.kev_model_from_hf(tiny.hf, tiny.kev.tokenizer, matmul="library")
    library.weights.quantize_int8()
    with pytest.raises(tiles.NotDeterministic, match="isolation.deterministic .* core.weights: int8"):
        EngineCore(library, harness.tiny_options(deterministic=True))
