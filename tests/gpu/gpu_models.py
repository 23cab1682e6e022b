"""Models for the GPU tests that need no download: a byte-level tokenizer built in code, a random-weight
Llama of a GPU-friendly shape (head_dim 64, several layers, 2,048 positions), Kev's Model over exactly its
weights on any device, and the same model saved as an HF directory (for `load_model` and `kev ask`).

`python tests/gpu/gpu_models.py DIR` writes that directory: ops/gpu-check.sh's smoke test uses it when
the real SmolLM2 is not on the machine.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

# KEV_GPU_TEST_DEVICE=cpu runs the suite on the CPU: a dry run of the tests' own logic before a GPU is
# lent (slow, and it proves nothing about CUDA). Unset: CUDA.
DEVICE = torch.device(os.environ.get("KEV_GPU_TEST_DEVICE", "cuda"))
# Every GPU test module's pytestmark: the `gpu` marker, and a skip only where the device is missing
# (tests/gpu/conftest.py turns that skip into a failure on a machine that must run the suite).
CUDA_ONLY = [pytest.mark.gpu, pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(),
                                                 reason="needs an NVIDIA GPU: torch.cuda.is_available() is False")]
# Token i < 256 is byte i, so any id below 256 decodes.
SPECIALS = ("<|im_start|>", "<|im_end|>")  # ids 256 and 257
VOCAB = 320  # a few ids no text ever encodes to: the model may still draw them, and they decode to ""
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GPU_SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=512, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 eos_token_id=None, bos_token_id=None, pad_token_id=None)


def byte_tokenizer():
    """A byte-level BPE with no merges: every byte is one token, so any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    raw = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(list(SPECIALS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=SPECIALS[1],
                                        additional_special_tokens=[SPECIALS[0]])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _byte_of(char: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's printable mapping)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    if ord(char) in printable:
        return ord(char)
    others = [b for b in range(256) if b not in printable]
    return others[ord(char) - 256]


def tiny_llama(seed: int = 0, **overrides):
    """A transformers Llama with random weights everywhere, fp32 on CPU, eval.

    Weights are scaled by fan-in (as tests/conftest.py's tiny models) so logits spread over O(1) and
    greedy near-ties are rare: an answer that changes means the math changed, not a coin flip.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**GPU_SHAPE, "vocab_size": VOCAB, **overrides})
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:  # the embedding too: rows of norm ~1
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[1]))
    return model


def attention_backends() -> list[str]:
    """core.attention values to test on DEVICE: sdpa always, flash-attn where it can run. A parameter list,
    so a machine without flash-attn runs fewer cases instead of skipping one."""
    from engine.kernels.flash import flash_available

    return ["sdpa"] + (["flash-attn"] if flash_available(DEVICE) else [])


def keep_fp32_exact() -> None:
    """fp32 matmuls without TF32 (torch's default), or fp32 is no exact reference: TF32 keeps 10 bits of
    mantissa, about bf16's error. Set only when something turned TF32 on: torch refuses a mix of its two APIs."""
    from engine.kernels.backend import tf32_matmul

    if tf32_matmul():
        torch.backends.cuda.matmul.fp32_precision = "ieee"


def kev_model_on(hf_model, tokenizer, device: torch.device, dtype: torch.dtype, name: str = "tiny-gpu"):
    """Kev's Model over exactly the weights of `hf_model`, on `device` in `dtype`."""
    from engine.model.model import Model, rope_tables, spec_from_config
    from engine.model.transformer import Transformer

    config = hf_model.config
    spec = spec_from_config(config)
    weights = Transformer.from_state_dict(spec, hf_model.state_dict(), rope_tables(config, spec), device, dtype)
    return Model(spec, weights, tokenizer, device, dtype, Path(name), config)


def save_model_dir(path: str | os.PathLike, seed: int = 0) -> Path:
    """The tiny Llama and its tokenizer as an HF directory that `load_model` and `kev ask --model` read."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_tokenizer()
    model = tiny_llama(seed, eos_token_id=tokenizer.convert_tokens_to_ids(SPECIALS[1]))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/gpu/gpu_models.py DIR")
    print(save_model_dir(sys.argv[1]))
