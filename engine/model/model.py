"""`load_model`: a model's shape (ModelSpec), its weights (Transformer) and its tokenizer, on one device."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.deterministic.mode import math_mode
from engine.attention_form import AttentionForm
from engine.kernels.backend import check_deterministic_device
from engine.kernels.cpu_features import compute_dtype
from engine.kernels.heap import give_back_freed_pages
from engine.model.rotary import FIRST_REACH, RotaryTables, rows
from engine.kernels.omp_pool import release_thread_pool
from engine.kernels.paged_decode import kernel
from engine.kv.cache import kv_bytes_per_token
from engine.model.key_means import key_means
from engine.model.gguf_weights import GgufState, load_name_map, runs_as_stored
from engine.model.loader import UnsupportedModel, gguf_file, resolve_model_dir
from engine.model.transformer import Transformer

# What each supported architecture adds to the Llama layer (engine/model/transformer.py reads the spec).
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # a sliding window on every layer
    "Qwen2ForCausalLM": "llama",  # q/k/v biases
    "Qwen3ForCausalLM": "llama",  # q/k norms
    "Phi3ForCausalLM": "llama",  # q/k/v and gate/up stored fused
    "GlmForCausalLM": "llama",  # partial, interleaved rotary; gate/up fused
    "Gemma2ForCausalLM": "gemma",  # (1 + w) norms around attention and MLP, gelu-tanh, soft caps
    "Gemma3ForCausalLM": "gemma",  # Gemma 2's layer with q/k norms and a local rotary base
    "Gemma3ForConditionalGeneration": "gemma",  # Gemma 3 4B and up: its text model (images are not read)
}
MULTIMODAL = ("Gemma3ForConditionalGeneration",)  # the language model's config is their text_config
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # position-independent tables (not dynamic or longrope)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# auto: a GGUF's block formats kept as stored where Kev runs them all (engine/model/gguf_weights.py), else
# full; full: stored in the compute dtype; int8: weight-only int8
WEIGHT_FORMATS = ("auto", "full", "int8")


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3, Gemma 3
    eos_token_ids: tuple[int, ...]
    family: str = "llama"  # gemma: (1 + w) norms, an embedding scaled by sqrt(hidden), norms after attention and MLP
    activation: str = "silu"  # of the MLP's gate: silu | gelu_tanh
    final_softcap: float | None = None  # logits become softcap * tanh(logits / softcap) (Gemma 2)
    rotary_dim: int = 0  # leading dims of a head that rotate (GLM, partial Phi-3: fewer than head_dim)
    rope_interleaved: bool = False  # pairs (0, 1), (2, 3)... rotate (GLM), not halves
    # Per layer: how queries meet keys, and which rotary table (a key of rope_tables) positions it.
    attention: tuple[AttentionForm, ...] = ()
    layer_rope: tuple[str, ...] = ()

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes per token for a storage dtype (int8 includes its per-head scales)."""
        return kv_bytes_per_token(self, dtype)


@dataclass
class Model:
    spec: ModelSpec
    weights: Transformer
    tokenizer: object  # a transformers tokenizer
    device: torch.device
    dtype: torch.dtype
    path: Path
    hf_config: object
    weight_format: str = "full"  # full | int8 | gguf (a GGUF's block formats, multiplied as stored)
    _key_means: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def kv_dtype(self) -> torch.dtype:
        """What `kv_cache.dtype: auto` stores: the compute dtype, but fp16 under fp32 for a GGUF whose
        weights run as stored (on the CPU), the cache a llama.cpp user's file gets there: half of fp32's
        bytes, and decodes over long contexts read half as much."""
        return torch.float16 if self.weight_format == "gguf" and self.dtype == torch.float32 else self.dtype

    def key_means(self) -> torch.Tensor:
        """Each layer's mean key per KV head, which an int8 KV cache subtracts; computed at first use."""
        if self._key_means is None:
            self._key_means = key_means(self)
        return self._key_means


def load_model(source: str | os.PathLike, *, device: str = "auto", dtype: str | torch.dtype | None = None,
               weights: str | None = None, deterministic: bool = False, pack_fp32: bool = True,
               matmul: str = "auto") -> Model:
    """Load an HF directory, a .gguf file or a built-in name (e.g. "smollm2-135m-instruct").

    `dtype`: auto (None) | fp32 | bf16 | fp16 compute and storage dtype; auto is bf16 on CUDA, fp32
    elsewhere (bf16 on a CPU without bf16 instructions falls back to fp32, logged).
    `weights`: "auto" (default: a GGUF whose matrices are all in block formats Kev multiplies as stored
    keeps them, engine/kernels/block_weight.py; anything else is "full"), "full" (the compute dtype) or
    "int8" (weight-only int8 matmuls).
    `matmul`: auto | row_linear | library, the CPU kernel for weight matmuls (engine/kernels/matmul.py):
    row_linear keeps each row's bits whatever shares its step; auto takes it unless the library is
    clearly faster here. Logged as `matmul.kernel`.
    `pack_fp32`: with the library, fp32 matrices also get a oneDNN-packed copy for decode-sized products
    (engine/kernels/packed_weight.py); bf16 ones are always packed, in place of the plain copy.
    """
    from transformers import AutoConfig  # seconds to import: only when a model is loaded

    weight_format = weights or "auto"
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weights {weight_format!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    device_ = pick_device(device)
    gguf = gguf_file(source)
    stored = weight_format == "auto" and gguf is not None and device_.type == "cpu" and runs_as_stored(gguf)
    path = resolve_model_dir(source, weights=not stored)
    config = AutoConfig.from_pretrained(path)
    spec = spec_from_config(config)
    if deterministic:  # its start-up check would multiply CPU probes by CUDA weights: refused before loading
        check_deterministic_device(device_.type)
    dtype_ = compute_dtype(pick_dtype(dtype, device_), device_)
    weight_format = "gguf" if stored else "full" if weight_format == "auto" else weight_format
    # The tokenizer before the weights: its parse's temporaries (~60 MiB for a 151k vocabulary) are freed
    # before the weights arrive, not on top of them at the load's peak.
    tokenizer = load_tokenizer(path, from_gguf=gguf is not None)
    give_back_freed_pages()
    rotary = rotary_tables(config, spec, dtype_, device_)
    if stored:
        state = GgufState(gguf, config, dtype_, load_name_map(path))
        matrices = Transformer.from_state_dict(spec, state, rotary, device_, dtype_, mode=math_mode(deterministic))
    else:
        matrices = Transformer.from_safetensors(spec, path, rotary, device_, dtype_,
                                                mode=math_mode(deterministic), int8=weight_format == "int8",
                                                pack_fp32=pack_fp32, matmul_kernel=matmul)
    if device_.type == "cpu":  # build or load the decode kernel now, with the model, not at the first decode
        kernel()
    release_thread_pool()  # steps run on another thread (the engine's device thread): engine/kernels/omp_pool.py
    give_back_freed_pages()  # the load's temporaries: engine/kernels/heap.py
    return Model(spec, matrices, tokenizer, device_, dtype_, path, config, weight_format)


def load_tokenizer(path: Path, *, from_gguf: bool):
    """The model's tokenizer. A GGUF's (its tokenizer.json written by Kev's loader) as the generic fast
    class: the same ids, texts, special tokens and chat template as the model's own class (Qwen2Tokenizer,
    GemmaTokenizer), which also keeps its vocabulary and merges as Python objects: 102 against 50 MiB
    resident for Qwen2.5's 151k tokens, 265 against 108 for Gemma 3's 262k (tests/test_gguf_blocks.py)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    return (PreTrainedTokenizerFast if from_gguf else AutoTokenizer).from_pretrained(path)


def spec_from_config(config) -> ModelSpec:
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    if arch not in FAMILIES:
        raise UnsupportedModel(f"architecture {arch!r} is not supported; Kev runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    outer, config = config, text_config(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    eos = config.eos_token_id if config.eos_token_id is not None else outer.eos_token_id
    family = FAMILIES[arch]
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedModel(f"{arch} with activation {act!r}: Kev's MLPs use {', '.join(ACTIVATIONS)}")
    rope_params = _rope_parameters(config)
    partial = next(iter(rope_params.values())).get("partial_rotary_factor",
                                                   getattr(config, "partial_rotary_factor", 1.0))
    return ModelSpec(
        architecture=arch,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps,
        max_position=config.max_position_embeddings,
        tie_embeddings=bool(getattr(outer, "tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
        eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,)),
        family=family,
        activation=ACTIVATIONS[act],
        final_softcap=getattr(config, "final_logit_softcapping", None),
        rotary_dim=int(head_dim * partial),
        rope_interleaved=arch == "GlmForCausalLM",
        attention=tuple(_attention_form(config, head_dim, i) for i in range(config.num_hidden_layers)),
        layer_rope=tuple(_layer_type(config, i) if len(rope_params) > 1 else "all"
                         for i in range(config.num_hidden_layers)),
    )


def text_config(config):
    """The language model's config: a multimodal model's text_config, else the config itself."""
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    return config.text_config if arch in MULTIMODAL else config


def _layer_type(config, layer: int) -> str:
    types = getattr(config, "layer_types", None)
    return types[layer] if types else "full_attention"


def _attention_form(config, head_dim: int, layer: int) -> AttentionForm:
    """transformers' attention for this layer: Gemma's query_pre_attn_scalar, attention soft cap and
    sliding layers (layer_types); Mistral's and Phi-3's window on every layer (no layer_types)."""
    scalar = getattr(config, "query_pre_attn_scalar", None)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "layer_types", None):
        window = window if config.layer_types[layer] == "sliding_attention" else None
    return AttentionForm(scale=(scalar or head_dim) ** -0.5, window=window,
                         softcap=getattr(config, "attn_logit_softcapping", None))


def _rope_parameters(config) -> dict[str, dict]:
    """Rotary parameters per layer type ("all" where every layer shares them; Gemma 3 has one set for its
    sliding layers and one for its full ones)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return dict(params)
    return {"all": params}


def rope_tables(config, spec: ModelSpec) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """cos/sin [max_position, rotary_dim] in float32 per rotary table, whole (tests build models from them)."""
    return {key: rows(inv_freq, scaling, 0, spec.max_position, spec.rope_interleaved)
            for key, (inv_freq, scaling) in rope_frequencies(config, spec).items()}


def rotary_tables(config, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> RotaryTables:
    """The model's rotary tables, their first rows computed (engine/model/rotary.py)."""
    rotary = RotaryTables(rope_frequencies(config, spec), spec.max_position, spec.rope_interleaved, dtype, device)
    rotary.reach(FIRST_REACH)
    return rotary


def rope_frequencies(config, spec: ModelSpec) -> dict[str, tuple[torch.Tensor, float]]:
    """Per rotary table (spec.layer_rope names each layer's): inverse frequencies and attention scaling,
    exactly as transformers computes them (llama3, linear and yarn scaling too)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # seconds to import: only at model load

    tables, config = {}, text_config(config)
    for key, params in _rope_parameters(config).items():
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModel(f"{spec.architecture} with rope_type {rope_type!r}: Kev runs rotary "
                                   f"embeddings of types {', '.join(ROPE_TYPES)}")
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = spec.rotary_dim
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scaling = 1.0
        else:
            layer_type = None if key == "all" else key
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), layer_type=layer_type)
        tables[key] = (inv_freq, scaling)
    return tables


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """core.precision as a dtype; auto (or None): bf16 on CUDA, where flash-attn needs it and fp32 matmuls
    are many times slower, fp32 elsewhere."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"precision {dtype!r} is not one of auto, fp32, bf16, fp16")
    return DTYPES[dtype]
