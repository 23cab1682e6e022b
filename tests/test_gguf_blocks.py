"""`weights: auto` on a GGUF in block formats: the matrices kept as stored and multiplied by block_linear.

A small random Llama (256 wide, so the K-quants fit) written as llama.cpp's converter writes it, its
matrices in six block formats at once (q/k/v fused from three), SmolLM2's first 1,024 tokens. Checked against
transformers on the same file (which dequantizes it), and solo == packed through the engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine import load_model
from engine.kernels.block_weight import BlockWeight
from engine.model.gguf_weights import unstored_matrices
from engine.model.loader import gguf_file, resolve_model_dir
from gguf_writer import quantize, write_llama_gguf
from schemas import DEFAULT_MODEL

FORMATS = {"attn_q": "Q5_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_gate": "Q5_K",
           "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q4_0", "token_embd": "Q8_0"}
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             vocab_size=1024, num_hidden_layers=2)
PROMPT = [1, 504, 329, 314, 761, 282, 649, 47, 216, 506, 529, 314]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory, harness, smollm2_tokenizer):
    hf = harness.build_hf_tiny("llama", seed=7, **SHAPE)
    path = tmp_path_factory.mktemp("gguf") / "tiny-blocks.gguf"
    return write_llama_gguf(hf, path, FORMATS, smollm2_tokenizer)


@pytest.fixture(scope="module")
def stored(gguf):
    return load_model(str(gguf), device="cpu", dtype="fp32")


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_test_quantizers_round_trip(name):
    """The writer's own K-quant packers: gguf-py reads back the values they meant."""
    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    back = quants.dequantize(quantize(x, name), GGMLQuantizationType[name])
    assert np.abs(back - x).max() < {"Q4_K": 0.5, "Q5_K": 0.25, "Q6_K": 0.12}[name] * np.abs(x).max() / 4


def test_auto_keeps_the_file_blocks(gguf, stored):
    assert stored.weight_format == "gguf" and not unstored_matrices(gguf)
    layer = stored.weights.layers[0]
    assert layer.qkv.formats == ("Q5_0", "Q4_0", "Q8_0") and layer.down.formats == ("Q6_K",)
    assert isinstance(stored.weights.lm_head, BlockWeight) and isinstance(stored.weights.embed, BlockWeight)
    assert stored.weights.stack is not None  # the whole layer stack in one C++ call, as for fp32 weights
    matrices = sum(m.nbytes for m in stored.weights.matrices()) + stored.weights.embed.nbytes
    assert matrices < 0.3 * sum(m.shape.numel() * 4 for m in stored.weights.matrices() + [stored.weights.embed])
    assert not any(p.name.endswith(".safetensors") for p in resolve_model_dir(str(gguf), weights=False).iterdir())


def test_logits_agree_with_transformers_on_the_same_file(gguf, stored):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        expected = hf(ids).logits[0]
    got = model_logits(stored, ids[0])  # each matmul's rows rounded to int8 codes: 2% here (random weights)
    relative = ((got - expected).norm() / expected.norm()).item()
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert relative < 0.04 and agree >= 0.8, (relative, agree)


def model_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits from Kev's forward of one sequence (torch attention over its own keys)."""
    import torch.nn.functional as F

    spec = model.spec

    def attend(_layer, q, k, v):  # causal attention of one question's rows
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        k = k.repeat_interleave(spec.num_heads // spec.num_kv_heads, 0)
        v = v.repeat_interleave(spec.num_heads // spec.num_kv_heads, 0)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)

    with torch.no_grad():
        hidden = model.weights.forward(ids, torch.arange(len(ids)), attend)
        return model.weights.logits(hidden)


def test_greedy_answers_solo_equal_packed(stored, harness):
    victim = harness.Q("victim", PROMPT[:6], {"max_new_tokens": 12, "temperature": 0.0})
    rng = np.random.default_rng(3)
    others = [harness.Q(f"n{i}", rng.integers(2, SHAPE["vocab_size"], size=int(rng.integers(3, 40))).tolist(),
                        {"max_new_tokens": int(rng.integers(4, 16)), "temperature": 0.0}) for i in range(6)]
    solo = harness.run_core(stored, [victim])
    packed = harness.run_core(stored, others[:3] + [victim] + others[3:])
    assert max(len(plan) for plan in packed.plans) > 1
    assert packed.tokens("victim") == solo.tokens("victim")
    assert all(torch.equal(a, b) for a, b in zip(packed.logits["victim"], solo.logits["victim"]))


def test_a_gguf_s_tokenizer_loads_as_the_generic_fast_class(stored, tmp_path):
    """engine/model/model.py's load_tokenizer: the model class's tokenizer (Qwen2Tokenizer, GemmaTokenizer)
    would add its vocabulary as Python objects; the ids are the same (tests/test_real_gemma.py checks a real
    one). The tiny file's own class is already the generic one, so a copy of its description names Qwen's."""
    import json
    import shutil

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from engine.model.model import load_tokenizer

    own = AutoTokenizer.from_pretrained(stored.path)
    assert type(stored.tokenizer) is PreTrainedTokenizerFast
    for text in ("The capital of France is", "  two spaces\tand a tab", "def f(x):\n    return x"):
        assert stored.tokenizer(text)["input_ids"] == own(text)["input_ids"]
    qwen = shutil.copytree(stored.path, tmp_path / "described")
    config = json.loads((qwen / "tokenizer_config.json").read_text())
    (qwen / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    assert type(AutoTokenizer.from_pretrained(qwen)).__name__ == "Qwen2Tokenizer"
    assert type(load_tokenizer(qwen, from_gguf=True)) is PreTrainedTokenizerFast


def test_a_gguf_kept_as_stored_caches_fp16_by_default_and_its_compute_dtype_when_asked(stored, harness):
    """kv_cache.dtype auto: fp16 under fp32 compute, as llama.cpp keeps a file's cache (half the bytes);
    compute: the model's fp32. Either way a question's greedy answer is its own alone or packed."""
    from structlog.testing import capture_logs

    from engine import EngineCore

    with capture_logs() as logs:
        assert EngineCore(stored, harness.tiny_options()).kv.k.dtype == torch.float16
    assert [e["kv_stored"] for e in logs if e["event"] == "attention.backend"] == ["fp16"]
    assert EngineCore(stored, harness.tiny_options(kv_dtype="compute")).kv.k.dtype == torch.float32
    question = harness.Q("q", PROMPT, dict(max_new_tokens=8, temperature=0.0))
    others = [harness.Q(f"n{i}", PROMPT[i:] * 3, dict(max_new_tokens=6, temperature=0.0)) for i in range(1, 4)]
    for kv in ("auto", "compute"):
        solo = harness.run_core(stored, [question], harness.tiny_options(kv_dtype=kv))
        packed = harness.run_core(stored, others + [question], harness.tiny_options(kv_dtype=kv))
        assert solo.tokens("q") == packed.tokens("q"), kv


def test_full_and_int8_still_load_the_file(gguf):
    ids = torch.tensor(PROMPT[:4])
    for weights in ("full", "int8"):
        model = load_model(str(gguf), device="cpu", dtype="fp32", weights=weights)
        assert model.weight_format == weights
        assert not isinstance(model.weights.layers[0].qkv, BlockWeight)
        assert torch.isfinite(model_logits(model, ids)).all()


def test_a_file_with_other_formats_runs_full(harness):
    """The built-in SmolLM2 file is Q4_1, not a format Kev runs as stored: auto loads it in full."""
    assert set(unstored_matrices(gguf_file(DEFAULT_MODEL)).values()) == {"Q4_1"}


def test_a_stored_load_keeps_transformers_modeling_code_out_of_the_process(gguf, tmp_path):
    """The name map is made once, in the child that describes the file, and kept beside its config: loading
    a GGUF as stored no longer builds the model on the meta device in the serving process (~85 MiB that
    stayed resident), on the first start or any later one."""
    import os
    import subprocess
    import sys

    probe = ("import sys; from engine import load_model; m = load_model(sys.argv[1], device='cpu', dtype='fp32'); "
             "print(m.weight_format, 'transformers.modeling_utils' in sys.modules)")
    env = dict(os.environ, KEV_CACHE_DIR=str(tmp_path / "cache"))
    for start in ("first", "later"):
        done = subprocess.run([sys.executable, "-c", probe, str(gguf)], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split()[-2:] == ["gguf", "False"], (start, done.stdout)
    described = resolve_model_dir(str(gguf), weights=False)
    assert (described / "gguf_names.json").is_file()


def test_the_embedding_table_stays_in_the_file_and_its_rows_are_the_file_s(gguf, stored):
    """A table only ever looked up by rows (the file has its own output head) is not read into the process:
    each step reads the rows its tokens use (89 of Qwen2.5 0.5B's 463 MiB of weights never held). The rows
    are the file's values, repeated and unsorted ids included, and an id past the table is refused."""
    from gguf import GGUFReader

    from engine.model.gguf_weights import FileTable

    embed = stored.weights.embed
    assert isinstance(embed, FileTable) and embed.nbytes == 0
    assert stored.weights.nbytes < sum(m.nbytes for m in stored.weights.matrices()) + 4 * SHAPE["hidden_size"] * 9
    table = next(t for t in GGUFReader(gguf).tensors if t.name == "token_embd.weight")
    expected = torch.from_numpy(np.ascontiguousarray(
        quants.dequantize(np.asarray(table.data), GGMLQuantizationType.Q8_0).reshape(SHAPE["vocab_size"], -1)))
    ids = torch.tensor([[5, 1023, 5], [0, 77, 76]])
    assert torch.equal(embed.rows(ids), expected[ids])
    assert torch.equal(embed.matrix(), expected) and embed.nbytes == 0  # every row read, none kept
    with pytest.raises(ValueError, match="1024"):
        embed.rows(torch.tensor([3, 1024]))


def test_a_matrix_read_into_place_becomes_its_weight_without_a_copy():
    """A file's matrix is read where the packed weight keeps it (BlockTensor.blank), so the largest one (a
    big vocabulary's embedding table) never takes twice its bytes; it multiplies as a copied one does."""
    from engine.kernels.block_weight import FORMATS, BlockTensor

    fmt, rows, k = FORMATS["Q8_0"], 48, 256
    codes = torch.from_numpy(quantize(np.random.default_rng(3).standard_normal((rows, k)).astype(np.float32), "Q8_0"))
    placed = BlockTensor.blank(fmt, rows, k)
    placed.data.copy_(codes.reshape(rows, -1))
    copied = BlockTensor(fmt, codes.reshape(rows, -1).clone(), k)
    in_place, packed_copy = BlockWeight([placed], torch.float32), BlockWeight([copied], torch.float32)
    assert in_place.packed.data_ptr() == placed.buffer.data_ptr()
    assert torch.equal(in_place.packed, packed_copy.packed)
    x = torch.randn(5, k)
    assert torch.equal(in_place.linear(x), packed_copy.linear(x))


def test_a_file_transformers_cannot_describe_is_refused_in_one_line(harness, smollm2_tokenizer, tmp_path, monkeypatch):
    """The child that reads a stored GGUF's config and tokenizer fails: load_model names the file and the
    cause in one line, and leaves no half-described directory in the cache."""
    import gguf_writer

    from engine.model.loader import UnsupportedModel

    def unknown_tokenizer(writer, tokenizer, size):
        writer.add_tokenizer_model("no-such-tokenizer")
        writer.add_token_list([f"t{i}" for i in range(size)])

    monkeypatch.setattr(gguf_writer, "_add_tokenizer", unknown_tokenizer)
    path = write_llama_gguf(harness.build_hf_tiny("llama", seed=7, **SHAPE), tmp_path / "odd-tokenizer.gguf",
                            FORMATS, smollm2_tokenizer)
    monkeypatch.setenv("KEV_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(UnsupportedModel, match=r"^odd-tokenizer\.gguf: reading its config and tokenizer failed: .*no-such-tokenizer"):
        load_model(str(path), device="cpu", dtype="fp32")
    assert list((tmp_path / "cache").iterdir()) == []
