"""semantic_hash (engine/routing_embedding.py): what holds by construction. Whether paraphrases share a
bucket on this small model is a measurement, not a test: `python -m benchmarks.routing --semantic`."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from consumers.publish.partitioner import Partitioner
from engine.routing_embedding import BITS, EmbeddingHash, embedding_table
from schemas import Message, Params, QuestionEvent

pytest_plugins = ["serve_fixtures"]

TEXTS = ["How do I get a refund?", "How can I get my money back?", "怎么退款", "如何退款", "Why is the sky blue?",
         "Write a poem about the sea.", "x", "?", "一二三四五六七八九十" * 30, "def f(x):\n  return x + 1"]


@pytest.fixture(scope="module")
def semantic(tiny_model_dir) -> EmbeddingHash:
    """From serve_fixtures' tiny random Llama with SmolLM2's vocabulary and tokenizer, saved as safetensors."""
    return EmbeddingHash.from_model_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def q(qid: str, prompt: str | None = None, **fields) -> QuestionEvent:
    return QuestionEvent(question_id=qid, prompt=prompt, **fields)


def test_buckets_are_in_range_and_a_power_of_two_takes_the_first_hyperplanes(semantic):
    for n in range(1, 18):
        assert all(0 <= semantic(q("a", text), n) < n for text in TEXTS)
    for text in TEXTS:
        signature = semantic.signature(text)
        assert 0 <= signature < 1 << BITS
        assert semantic(q("a", text), 16) == signature >> (BITS - 4)


def test_the_same_files_give_the_same_buckets(tiny_model_dir, semantic):
    again = EmbeddingHash.from_model_dir(tiny_model_dir)
    assert [again.signature(t) for t in TEXTS] == [semantic.signature(t) for t in TEXTS]
    assert [semantic.signature(t) for t in TEXTS] == [semantic.signature(t) for t in TEXTS]
    assert len({semantic.signature(t) for t in TEXTS}) > 3  # a hash, not a constant


def test_it_routes_on_the_normalised_user_text(semantic):
    plain = q("a", "How do I get a refund?")
    same = [q("b", "Um,   how do I get a refund???"), q("c", "How do I get a refund?", system="You are terse."),
            q("d", messages=(Message("system", "Be kind."), Message("user", "How do I get a refund?"))),
            q("e", "How do I get a refund?", params=Params(temperature=1.5), tenant="acme")]
    assert {semantic(question, 1 << 16) for question in same} == {semantic(plain, 1 << 16)}
    turns = q("f", messages=(Message("user", "first"), Message("assistant", "ok"), Message("user", "second")))
    assert semantic.signature("first\nsecond") == semantic(turns, 1 << 16)


def test_a_text_without_tokens_has_signature_zero(semantic):
    assert semantic.signature("") == 0
    assert semantic.signature("<|im_start|><|im_end|>") == 0  # special tokens are dropped
    assert semantic.signature("嗯，") == 0  # filler alone normalises to nothing


def test_the_table_is_read_from_bf16_and_sharded_files(tmp_path, tiny_model_dir, tiny_hf):
    want = tiny_hf.model.embed_tokens.weight.detach()
    assert np.array_equal(embedding_table(tiny_model_dir), want.numpy())
    copy.deepcopy(tiny_hf).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="2MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert np.array_equal(embedding_table(tmp_path), want.to(torch.bfloat16).float().numpy())


def test_a_workers_audit_bucket_is_the_partition_kev_route_picks(tiny_hf, semantic, smollm2_tokenizer, harness):
    from engine import EngineCore

    model = harness.kev_model_from_hf(tiny_hf, smollm2_tokenizer)  # no directory: the table is its weights' own
    core = EngineCore(model, harness.tiny_options(routing_strategy="semantic_hash", routing_buckets=8))
    partitioner = Partitioner("semantic_hash", 8, semantic=semantic)
    questions = [q(f"q{i}", text, params=Params(max_new_tokens=1)) for i, text in enumerate(TEXTS[:6])]
    for question in questions:
        core.add(question)
    answers = {}
    while core.has_work:
        answers.update((a.question_id, a) for a in core.step().answers)
    assert [answers[x.question_id].audit.routing_bucket for x in questions] == [
        partitioner.partition(x) for x in questions]


@pytest.mark.slow
def test_the_same_text_gets_the_same_bucket_in_another_process():
    # SmolLM2's own files: the table, its mean and principal direction, and the hyperplanes are rebuilt there.
    from engine.model.loader import resolve_model_dir
    from schemas import DEFAULT_MODEL

    path = resolve_model_dir(DEFAULT_MODEL)
    code = ("import json, sys\nfrom engine.routing_embedding import EmbeddingHash\n"
            f"semantic = EmbeddingHash.from_model_dir({str(path)!r})\n"
            "print(json.dumps([semantic.signature(t) for t in json.loads(sys.stdin.read())]))\n")
    there = subprocess.run([sys.executable, "-c", code], input=json.dumps(TEXTS), capture_output=True, text=True,
                           check=True, timeout=120)
    here = EmbeddingHash.from_model_dir(path)
    assert json.loads(there.stdout) == [here.signature(t) for t in TEXTS]


def test_a_gguf_kept_in_blocks_routes_as_its_conversion_would(tmp_path, harness, smollm2_tokenizer):
    """A worker serving a GGUF as stored has no safetensors to read the table from: it reads the rows from
    the file (and `kev route` on that file does too, without converting it). Both see the float32 values a
    conversion writes, so they pick the partition `kev route` would on the converted directory."""
    from engine import EngineCore, load_model
    from engine.model.loader import resolve_model_dir
    from gguf_writer import write_llama_gguf

    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 vocab_size=1024, num_hidden_layers=1)
    formats = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0", "ffn_gate": "Q4_0",
               "ffn_up": "Q4_0", "ffn_down": "Q8_0", "output": "Q4_0", "token_embd": "Q4_K"}
    gguf = write_llama_gguf(harness.build_hf_tiny("llama", seed=3, **shape), tmp_path / "tiny.gguf", formats,
                            smollm2_tokenizer)
    model = load_model(str(gguf), device="cpu", dtype="bf16")  # rows handed over in float32 all the same
    assert model.weight_format == "gguf"
    converted = EmbeddingHash.from_model_dir(resolve_model_dir(str(gguf)))
    for semantic in (EmbeddingHash.for_model(model), EmbeddingHash.from_source(str(gguf))):
        assert np.array_equal(semantic.center, converted.center) and np.array_equal(semantic.top, converted.top)
        assert [semantic.signature(t) for t in TEXTS] == [converted.signature(t) for t in TEXTS]
    core = EngineCore(model, harness.tiny_options(routing_strategy="semantic_hash", routing_buckets=8))
    partitioner = Partitioner("semantic_hash", 8, semantic=converted)
    question = q("g1", TEXTS[0], params=Params(max_new_tokens=1))
    core.add(question)
    answers = [a for _ in range(8) if core.has_work for a in core.step().answers]
    assert answers[0].audit.routing_bucket == partitioner.partition(question)
