"""Small Llama GGUF files in block formats, written as llama.cpp's converter writes them (q/k rows permuted
for its rotary layout), with the first tokens of SmolLM2's tokenizer and the merges among them (a full
49k vocabulary takes gguf-py and transformers tens of seconds to parse on each load): the files
`weights: auto` keeps as stored.

Q8_0, Q4_0 and Q5_0 are quantized by gguf-py; Q4_K, Q5_K and Q6_K (which gguf-py only dequantizes) by
the plain round-to-nearest below, ggml's layouts without its search for the best scales.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per super-block -> the 12 bytes Q4_K and Q5_K store."""
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 15) | ((m[..., 4:8] & 15) << 4)
    return out


def _half(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def quantize_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (bits 5): [rows, k] float -> [rows, k / 256 * bytes] uint8."""
    top = (1 << bits) - 1
    rows = x.shape[0]
    sub = x.astype(np.float32).reshape(rows, -1, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - low) / top
    d = np.maximum(scale.max(-1), 1e-12) / 63
    dmin = np.maximum((-low).max(-1), 1e-12) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d[..., None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(-low / dmin[..., None]), 0, 63).astype(np.uint8)
    step = (d[..., None] * sc)[..., None]
    q = np.clip(np.rint((sub + (dmin[..., None] * m)[..., None]) / step), 0, top).astype(np.uint8)
    nibbles = (q & 15).reshape(rows, -1, 4, 2, 32)
    qs = (nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 4)).reshape(rows, -1, 128)
    parts = [_half(d), _half(dmin), _pack_k_scales(sc, m)]
    if bits == 5:
        high = (q >> 4).reshape(rows, -1, 8, 32)
        parts.append(sum(high[:, :, j] << j for j in range(8)).astype(np.uint8))
    return np.concatenate(parts + [qs], axis=-1).reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    rows = x.shape[0]
    sub = x.astype(np.float32).reshape(rows, -1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (np.maximum(scale.max(-1), 1e-12) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d[..., None]), 1, 127).astype(np.int8)
    step = (d[..., None] * sc)[..., None]
    q = (np.clip(np.rint(sub / step), -32, 31) + 32).astype(np.uint8).reshape(rows, -1, 2, 4, 32)
    ql = ((q[:, :, :, 0:2] & 15) | ((q[:, :, :, 2:4] & 15) << 4)).reshape(rows, -1, 128)
    qh = sum((q[:, :, :, i] >> 4) << (2 * i) for i in range(4)).astype(np.uint8).reshape(rows, -1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _half(d)], axis=-1).reshape(rows, -1)


def quantize(x: np.ndarray, name: str) -> np.ndarray:
    if name == "Q4_K":
        return quantize_k(x, 4)
    if name == "Q5_K":
        return quantize_k(x, 5)
    if name == "Q6_K":
        return quantize_q6_k(x)
    return quants.quantize(x.astype(np.float32), GGMLQuantizationType[name])


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (its rotary pairs adjacent)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(writer: GGUFWriter, tokenizer, size: int) -> None:
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])][:size]
    kept = set(tokens)
    merges = [f"{a} {b}" for a, b in (m if isinstance(m, list) else m.split(" ", 1) for m in model["merges"])
              if a in kept and b in kept and a + b in kept]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token.startswith("<") and token.endswith(">") else 1 for token in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_llama_gguf(hf_model, path: Path, formats: dict[str, str], tokenizer) -> Path:
    """`hf_model` (a transformers Llama of vocab_size V) as a GGUF: matrix GGUF name suffix (attn_q,
    ffn_down, output, token_embd ...) -> its block format, per `formats` (missing: F32); its tokenizer the
    first V tokens of `tokenizer` (a transformers BPE tokenizer)."""
    config = hf_model.config
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    _add_tokenizer(writer, tokenizer, config.vocab_size)
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}

    def add(name: str, value: np.ndarray, suffix: str) -> None:
        fmt = formats.get(suffix)
        if fmt is None or value.ndim == 1:
            writer.add_tensor(name, value.astype(np.float32))
        else:
            writer.add_tensor(name, quantize(value, fmt), raw_dtype=GGMLQuantizationType[fmt])

    add("token_embd.weight", state["model.embed_tokens.weight"], "token_embd")
    for i in range(config.num_hidden_layers):
        for hf, short in GGUF_NAMES.items():
            value = state[f"model.layers.{i}.{hf}.weight"]
            if short == "attn_q":
                value = _llama_permute(value, config.num_attention_heads)
            elif short == "attn_k":
                value = _llama_permute(value, config.num_key_value_heads)
            add(f"blk.{i}.{short}.weight", value, short)
    add("output_norm.weight", state["model.norm.weight"], "output_norm")
    if not config.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"], "output")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
