"""Loading a GGUF as stored streams it a tensor at a time into its block layout: the process's high-water
mark grows by about the file's bytes, never by the full-precision model a dequantizing load passes through
(the Qwen2.5 0.5B Q4_K_M file once peaked at 5.6 GiB that way, for 0.4 GiB of blocks)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gguf_writer import write_llama_gguf
from kev_async.bench.process_memory import resident_mib

pytestmark = pytest.mark.skipif(resident_mib() is None, reason="needs /proc/self/status")

SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
             vocab_size=1024, num_hidden_layers=2)
FORMATS = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0", "ffn_gate": "Q4_0",
           "ffn_up": "Q4_0", "ffn_down": "Q8_0", "output": "Q8_0", "token_embd": "Q8_0"}
# In a fresh process: a narrow file of the same formats first (what the loader imports and builds once), then
# what loading the wide file adds to the high-water mark.
PROBE = """
import sys
from engine import load_model
from kev_async.bench.process_memory import resident_mib
load_model(sys.argv[1], device="cpu", dtype="fp32")
before = resident_mib()["peak"]
model = load_model(sys.argv[2], device="cpu", dtype="fp32")
print(model.weight_format, before, resident_mib()["peak"])
"""


def test_a_stored_load_peaks_near_the_file_size_not_the_full_precision_size(tmp_path, harness, smollm2_tokenizer):
    hf = harness.build_hf_tiny("llama", seed=2, **SHAPE)
    full_mib = sum(p.numel() for p in hf.parameters()) * 4 / 2**20  # 136 MiB in fp32
    gguf = write_llama_gguf(hf, tmp_path / "wide.gguf", FORMATS, smollm2_tokenizer)
    narrow = dict(SHAPE, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=1)
    small = write_llama_gguf(harness.build_hf_tiny("llama", seed=3, **narrow), tmp_path / "narrow.gguf", FORMATS,
                             smollm2_tokenizer)
    del hf
    file_mib = gguf.stat().st_size / 2**20  # 28 MiB of blocks
    env = dict(os.environ, KEV_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", PROBE, str(small), str(gguf)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    weight_format, before, after = done.stdout.split()[-3:]
    grown = float(after) - float(before)
    assert weight_format == "gguf"
    assert grown < file_mib + 0.25 * (full_mib - file_mib), (
        f"loading {file_mib:.0f} MiB of blocks raised the high-water mark by {grown:.0f} MiB "
        f"({full_mib:.0f} MiB in fp32)")
