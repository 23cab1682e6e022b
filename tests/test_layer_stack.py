"""The layer stack in one C++ call (engine/kernels/layer_stack.py) gives every row the Python forward's bits.

Which of the two runs a step can depend on a neighbour (an adapter in the step sends it to Python), so
the promise that a question's answer does not depend on its neighbours needs them bitwise equal.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import native

pytestmark = pytest.mark.skipif(native.module() is None, reason="no C++ compiler: Kev's CPU kernels are not built")


def _questions(harness, seed: int):
    rng = random.Random(seed)
    return [harness.Q(f"q{i}", harness.random_prompt(rng, rng.randrange(5, 90)),
                      dict(max_new_tokens=rng.randrange(4, 14), temperature=0.0 if i % 2 else 0.8, seed=i))
            for i in range(6)]


def _run(harness, model, questions, *, stack: bool, **options):
    from engine import EngineCore

    core = EngineCore(model, harness.tiny_options(**options))
    calls = []
    if stack:
        assert core.runner.weights.stack is not None, "the stack should take this model"
        real = core.runner.weights.stack.forward
        core.runner.weights.stack.forward = lambda *a: calls.append(1) or real(*a)
    else:
        core.runner.weights.stack = None
    return harness.run_core(model, questions, core=core), calls


@pytest.mark.parametrize("dtype,int8,kv_dtype", [(torch.float32, False, "auto"), (torch.bfloat16, False, "auto"),
                                                 (torch.float32, True, "auto"), (torch.bfloat16, True, "auto"),
                                                 (torch.float32, False, "fp16")],
                         ids=["fp32", "bf16", "int8-fp32", "int8-bf16", "fp32-fp16-kv"])
def test_the_stack_gives_every_row_the_python_forwards_bits(tiny_models, harness, dtype, int8, kv_dtype):
    """Packed questions, prompts cut into chunks beside decodes, greedy and seeded: the same logits bit for
    bit through the stack and through the Python forward, on every tiny architecture (biases, q/k norms),
    with full and int8 weights, and fp32 rows over an fp16 cache (both round each key and value once)."""
    for kind, tiny in tiny_models.items():
        model = harness.kev_model_from_hf(tiny.hf, tiny.kev.tokenizer, dtype=dtype)
        if int8:
            model.weights.quantize_int8()
        questions = _questions(harness, seed=len(kind))
        fused, calls = _run(harness, model, questions, stack=True, max_tokens_per_step=48, kv_dtype=kv_dtype)
        python, _ = _run(harness, model, questions, stack=False, max_tokens_per_step=48, kv_dtype=kv_dtype)
        assert calls, f"{kind}: the stack never ran"
        for q in questions:
            assert fused.tokens(q.qid) == python.tokens(q.qid), (kind, q.qid)
            assert len(fused.logits[q.qid]) == len(python.logits[q.qid])
            for a, b in zip(fused.logits[q.qid], python.logits[q.qid]):
                assert torch.equal(a, b), (kind, q.qid, (a - b).abs().max().item())


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(14, 2, 64), (12, 2, 128)], ids=["qwen2.5-0.5b", "qwen2.5-1.5b"])
def test_qwen_s_head_groups_take_the_stack_with_the_python_forwards_bits(harness, smollm2_tokenizer, heads,
                                                                         kv_heads, head_dim):
    """7 and 6 query heads per KV head (Qwen2.5 0.5B and 1.5B, 7B: 7): the paged kernel is built for them,
    so such a model's steps run in the stack rather than in Python, and give the same bits."""
    from conftest import build_hf_tiny

    hf = build_hf_tiny("qwen2", seed=7, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       hidden_size=64)
    model = harness.kev_model_from_hf(hf, smollm2_tokenizer, dtype=torch.float32)
    questions = _questions(harness, seed=3)
    fused, calls = _run(harness, model, questions, stack=True, max_tokens_per_step=48)
    python, _ = _run(harness, model, questions, stack=False, max_tokens_per_step=48)
    assert calls, "the stack never ran"
    for q in questions:
        assert fused.tokens(q.qid) == python.tokens(q.qid), q.qid
        for a, b in zip(fused.logits[q.qid], python.logits[q.qid]):
            assert torch.equal(a, b), (q.qid, (a - b).abs().max().item())


def test_the_stack_answers_as_transformers_does(tiny_models, harness):
    """fp32 greedy through the stack: transformers' tokens and logits within rounding."""
    tiny = tiny_models["qwen3-tied"]
    prompt = harness.random_prompt(random.Random(3), 50)
    out, calls = _run(harness, tiny.kev, [harness.Q("q", prompt, dict(max_new_tokens=10))], stack=True)
    assert calls
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for i, token in enumerate(out.tokens("q")):
            theirs = tiny.hf(ids).logits[0, -1]
            assert (out.logits["q"][i] - theirs).abs().max().item() < 1e-4
            assert int(theirs.argmax()) == token
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)


def test_where_the_stack_declines_the_python_forward_runs_and_the_log_says_why(tiny_models, harness, logs):
    from engine import EngineCore

    tiny = tiny_models["llama"]
    library = harness.kev_model_from_hf(tiny.hf, tiny.kev.tokenizer, matmul="library")
    assert EngineCore(library, harness.tiny_options()).runner.weights.stack is None  # oneDNN's matrices
    line = [e for e in logs if e["event"] == "layer_stack"][-1]
    assert line["enabled"] is False and "library" in line["reason"]
    int8_kv = EngineCore(tiny.kev, harness.tiny_options(kv_dtype="int8"))
    assert not int8_kv.runner.weights.stack.runs(int8_kv.runner.attention.prepare([_one_row()]))
    q = harness.Q("q", harness.random_prompt(random.Random(1), 20), dict(max_new_tokens=5))
    assert len(harness.run_core(tiny.kev, [q], core=int8_kv).tokens("q")) == 5  # through Python, int8 KV
    assert EngineCore(tiny.kev, harness.tiny_options(deterministic=True)).runner.weights.stack is not None


def _one_row():
    from engine.kernels.attention import Segment

    return Segment(q_start=0, q_len=1, kv_len=1, block_ids=(0,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_swiglu(dtype):
    gate_up = (torch.randn(7, 2 * 300, generator=torch.Generator().manual_seed(2)) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, -88.0, 0.0, 200.0]).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    ours = native.module().silu_mul(gate_up).float()
    expected = (F.silu(gate).to(dtype).float() * up).to(dtype).float()
    tolerance = dict(rtol=2e-6, atol=1e-30) if dtype is torch.float32 else dict(rtol=8e-3, atol=1e-30)
    torch.testing.assert_close(ours, expected, **tolerance)
    assert torch.isfinite(ours).all()


def test_the_stack_refuses_rows_outside_its_tables(tiny_models, harness):
    """A position past the rotary table or a slot past the cache is an error, not a stray read."""
    from engine import EngineCore

    core = EngineCore(tiny_models["llama"].kev, harness.tiny_options())
    weights = core.runner.weights
    step = core.runner.attention.prepare([_one_row()])
    hidden = torch.zeros(1, weights.spec.hidden_size)
    with pytest.raises(RuntimeError, match="position"):
        weights.stack.forward(hidden, torch.tensor([10**6]), step)
    step.slots = torch.tensor([10**9])
    with pytest.raises(RuntimeError, match="slot"):
        weights.stack.forward(hidden, torch.tensor([0]), step)
