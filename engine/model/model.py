"""`load_model`: a model's shape (ModelSpec), its weights (Transformer) and its tokenizer, on one device."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.deterministic.mode import math_mode
from engine.kernels.backend import check_deterministic_device
from engine.kernels.cpu_features import compute_dtype
from engine.kernels.omp_pool import release_thread_pool
from engine.kernels.paged_decode import kernel
from engine.kv.cache import kv_bytes_per_token
from engine.model.key_means import key_means
from engine.model.loader import resolve_model_dir
from engine.model.transformer import Transformer

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHT_FORMATS = ("full", "int8")  # full: stored in the compute dtype; int8: weight-only int8


class UnsupportedModel(ValueError):
    pass


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
    qk_norm: bool  # Qwen3
    eos_token_ids: tuple[int, ...]

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
    weight_format: str = "full"  # full | int8
    _key_means: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def name(self) -> str:
        return self.path.name

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
    `weights`: "full" (default) or "int8" (weight-only int8 matmuls).
    `matmul`: auto | row_linear | library, the CPU kernel for weight matmuls (engine/kernels/matmul.py):
    row_linear keeps each row's bits whatever shares its step; auto takes it unless the library is
    clearly faster here. Logged as `matmul.kernel`.
    `pack_fp32`: with the library, fp32 matrices also get a oneDNN-packed copy for decode-sized products
    (engine/kernels/packed_weight.py); bf16 ones are always packed, in place of the plain copy.
    """
    from transformers import AutoConfig, AutoTokenizer  # seconds to import: only when a model is loaded

    path = resolve_model_dir(source)
    config = AutoConfig.from_pretrained(path)
    spec = spec_from_config(config)
    device_ = pick_device(device)
    if deterministic:  # its start-up check would multiply CPU probes by CUDA weights: refused before loading
        check_deterministic_device(device_.type)
    dtype_ = compute_dtype(pick_dtype(dtype, device_), device_)
    weight_format = weights or "full"
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weights {weight_format!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    matrices = Transformer.from_safetensors(spec, path, rope_tables(config, spec), device_, dtype_,
                                            mode=math_mode(deterministic), int8=weight_format == "int8",
                                            pack_fp32=pack_fp32, matmul_kernel=matmul)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if device_.type == "cpu":  # build or load the decode kernel now, with the model, not at the first decode
        kernel()
    release_thread_pool()  # steps run on another thread (the engine's device thread): engine/kernels/omp_pool.py
    return Model(spec, matrices, tokenizer, device_, dtype_, path, config, weight_format)


def spec_from_config(config) -> ModelSpec:
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(f"architecture {arch!r} is not supported; Kev runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    heads = config.num_attention_heads
    eos = config.eos_token_id
    return ModelSpec(
        architecture=arch,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate_size=config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps,
        max_position=config.max_position_embeddings,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,)),
    )


def rope_tables(config, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, in float32, computed exactly as transformers does (llama3 scaling too)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # seconds to import: only at model load

    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    positions = torch.arange(spec.max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


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
