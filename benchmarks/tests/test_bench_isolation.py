"""`kev bench isolation` stays runnable and counts what it says (tiny model, tiny sizes)."""

from kev_async.cli import main

pytest_plugins = ["serve_fixtures"]


def test_bench_isolation_counts_answers_identical_alone_and_packed(tiny_model_dir, capsys):
    assert main(["bench", "isolation", "--model", str(tiny_model_dir), "--questions", "3", "--seeded", "1",
                 "--max-new-tokens", "4", "--variants", "fp32,bf16", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert '"event"' not in out and "[info" not in out and "[debug" not in out  # stdout is the table; logs: stderr
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in out.splitlines() if line.startswith("| fp32") or line.startswith("| bf16")}
    assert set(rows) == {"fp32", "bf16"}
    for name, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        variant, got_dtype, kv, weights, kernel, greedy, seeded, _seconds = rows[name]
        assert (got_dtype, kv, weights, kernel) == (dtype, "auto", "full", "row_linear")
        assert (greedy, seeded) == ("3/3", "1/1")  # row_linear and the prompt grid: nothing moves


def test_bench_isolation_keeps_a_gguf_s_blocks_in_its_gguf_variant(tmp_path, harness, smollm2_tokenizer, capsys):
    from gguf_writer import write_llama_gguf

    hf = harness.build_hf_tiny("llama", seed=5, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64, vocab_size=1024, num_hidden_layers=1)
    formats = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_gate": "Q5_0",
               "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q8_0", "token_embd": "Q8_0"}
    gguf = write_llama_gguf(hf, tmp_path / "tiny.gguf", formats, smollm2_tokenizer)
    assert main(["bench", "isolation", "--model", str(gguf), "--questions", "3", "--seeded", "1",
                 "--max-new-tokens", "4", "--variants", "gguf", "--threads", "2"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| gguf"))
    assert [c.strip() for c in row.split("|")[1:-2]] == ["gguf", "float32", "auto", "gguf", "row_linear", "3/3", "1/1"]


def test_bench_isolation_refuses_an_unknown_variant(capsys):
    assert main(["bench", "isolation", "--variants", "fp32,fp8"]) == 2
    assert "unknown variant(s) fp8" in capsys.readouterr().out
