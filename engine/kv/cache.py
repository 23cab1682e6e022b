"""The KV cache tensors: allocated once at start from a budget, never resized.

fp16 KV: keys and values rounded to fp16 as they are written, read back widened (exactly) to the model's
dtype: half of fp32's bytes, as llama.cpp's default cache keeps them. A value's rounding depends on that
value alone, so a row's bits stay its own.

int8 KV: each token's key (and value) per KV head is stored as int8 with one fp16 scale
(max |x| / 127 over head_dim). The scale depends on that token and head alone, so a token's stored
bits never depend on what else was written in the same step: isolation (and deterministic mode's
bitwise promise) hold unchanged. Keys are stored less a fixed per-layer, per-head vector (their mean
over a calibration text, engine/model/key_means.py): attention scores shift by the same amount for every key
of a query, which softmax ignores, and the rounding step shrinks. Backends read through
`LayerKV.gather`, which dequantises (the keys stay centred: nothing downstream needs them whole).
"""

from __future__ import annotations

from typing import get_args

import torch

from engine.attention_form import AttentionForm
from schemas import DEFAULT_CONFIG, KvDtype

MIB = 1 << 20
KV_DTYPES = get_args(KvDtype)  # auto: the model's kv_dtype; compute; fp16; int8: quantised per token and head
# fp16 scales: 11 significant bits (far finer than the int8 step they scale) in 2 bytes, so a head of
# 16 values still fits 3.5x the tokens of fp32 per byte (64 values: 3.9x).
SCALE_DTYPE = torch.float16


def cache_dtype(kv_dtype: str, model) -> torch.dtype:
    """The storage dtype `kv_cache.dtype` names for `model`: auto its `kv_dtype` (the compute dtype, but fp16
    under a GGUF kept as stored), compute its compute dtype, fp16, int8."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache.dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "fp16" and model.dtype == torch.bfloat16:
        raise ValueError("kv_cache.dtype fp16 under bf16 compute would save nothing (bf16's own cache takes the "
                         "same bytes) and lose the fast attention paths: use kv_cache.dtype auto")
    return {"int8": torch.int8, "fp16": torch.float16, "compute": model.dtype}.get(kv_dtype, model.kv_dtype)


def kv_bytes_per_token(spec, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take in every layer, scales included."""
    per_head = spec.head_dim * dtype.itemsize + (SCALE_DTYPE.itemsize if dtype == torch.int8 else 0)
    return 2 * spec.num_layers * spec.num_kv_heads * per_head


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, KVH, D] -> int8 [T, KVH, D] and fp16 scales [T, KVH]; symmetric, per token and head."""
    x = x.float()
    # Rounded to the stored dtype first, so quantising and dequantising use the same scale.
    scale = (x.abs().amax(-1) / 127).clamp(min=1e-6).to(SCALE_DTYPE)
    return torch.round(x / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float()[..., None]).to(dtype)


def padded_slots(segments: list, block_size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each segment's (kv_len, block_ids) cache slots padded to `width`: [rows, width] slots and visible.

    Built with a handful of tensor ops whatever the row count (a decode step's fixed cost). Padding
    reads the row's own first slot, never another question's: a masked key weighs 0, but 0 * inf is
    NaN, so a neighbour's overflowed value must not even be read.
    """
    blocks = -(-width // block_size)
    table = torch.tensor([s.block_ids[:blocks] + (s.block_ids[0],) * (blocks - len(s.block_ids[:blocks]))
                          for s in segments], dtype=torch.long)
    slots = (table[:, :, None] * block_size + torch.arange(block_size)).flatten(1)[:, :width]
    visible = torch.arange(width)[None, :] < torch.tensor([s.kv_len for s in segments])[:, None]
    return torch.where(visible, slots, slots[:, :1]), visible


class LayerKV:
    """One layer's cache as the attention backends see it: write new tokens, gather slots."""

    def __init__(self, cache: "KVCache", layer: int, form: AttentionForm):
        self.k, self.v = cache.k[layer], cache.v[layer]
        self.form = form  # how this layer's queries read these keys (scale, window, soft cap)
        self.quantized = cache.quantized
        if self.quantized:
            self.k_scale, self.v_scale = cache.k_scale[layer], cache.v_scale[layer]
            self.k_center = cache.k_center[layer]
        self.dtype = cache.compute_dtype
        self.kv_heads = self.k.shape[1]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's new keys/values; returns them as a later read will see them."""
        if not self.quantized:
            stored_k, stored_v = k.to(self.k.dtype), v.to(self.v.dtype)  # fp16 under fp32: rounded once, here
            self.k.index_copy_(0, slots, stored_k)
            self.v.index_copy_(0, slots, stored_v)
            return stored_k.to(k.dtype), stored_v.to(v.dtype)
        (qk, sk), (qv, sv) = quantize(k.float() - self.k_center), quantize(v)
        self.k.index_copy_(0, slots, qk)
        self.k_scale.index_copy_(0, slots, sk)
        self.v.index_copy_(0, slots, qv)
        self.v_scale.index_copy_(0, slots, sv)
        return dequantize(qk, sk, k.dtype), dequantize(qv, sv, v.dtype)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [len(slots), KVH, D] of the given cache rows, in the compute dtype."""
        if not self.quantized:
            return self.k.index_select(0, slots).to(self.dtype), self.v.index_select(0, slots).to(self.dtype)
        return (dequantize(self.k.index_select(0, slots), self.k_scale.index_select(0, slots), self.dtype),
                dequantize(self.v.index_select(0, slots), self.v_scale.index_select(0, slots), self.dtype))


class KVCache:
    """Per layer, keys and values for every slot: [layers, num_blocks * block_size, kv_heads, head_dim].

    Slot s of block b is row b * block_size + s, so a block is `block_size` consecutive rows and a
    flash-attn paged view ([num_blocks, block_size, kv_heads, head_dim]) is a free reshape.
    `dtype` int8 stores quantised rows plus per-token-per-head scales [layers, slots, kv_heads];
    `compute_dtype` is what reads return (the model's dtype); `key_center` [layers, kv_heads, head_dim]
    is what an int8 cache subtracts from every key before rounding (zeros when not given).
    """

    def __init__(self, spec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 compute_dtype: torch.dtype | None = None, key_center: torch.Tensor | None = None):
        shape = (spec.num_layers, num_blocks * block_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.quantized = dtype == torch.int8
        self.compute_dtype = compute_dtype or (torch.float32 if self.quantized else dtype)
        # Rows a kernel may read as they lie: the compute dtype's own values, or fp16 widened exactly to fp32.
        self.reads_plain = dtype == self.compute_dtype or (dtype, self.compute_dtype) == (torch.float16, torch.float32)
        if self.quantized:
            self.k_scale = torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device)
            self.v_scale = torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device)
            center_shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
            self.k_center = (torch.zeros(center_shape) if key_center is None else key_center.float()).to(device)
        # A spec without per-layer forms (a test's shape) attends plainly.
        forms = getattr(spec, "attention", ()) or (AttentionForm.plain(spec.head_dim),) * spec.num_layers
        self.layers = [LayerKV(self, i, forms[i]) for i in range(spec.num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.group = spec.num_heads // spec.num_kv_heads  # query heads per KV head

    @property
    def nbytes(self) -> int:
        scales = self.k_scale.nbytes + self.v_scale.nbytes if self.quantized else 0
        return self.k.nbytes + self.v.nbytes + scales


def plan_num_blocks(spec, dtype: torch.dtype, device: torch.device, block_size: int, *,
                    num_blocks: int | None = None, budget_bytes: int | None = None,
                    memory_fraction: float = DEFAULT_CONFIG.kv_cache.memory_fraction,
                    cpu_default_bytes: int = 512 * MIB) -> int:
    """How many blocks the pool gets: as configured, from a byte budget, or from free device memory.

    `dtype` is the cache's storage dtype (int8 counts its scales too)."""
    if num_blocks:
        return num_blocks
    per_block = kv_bytes_per_token(spec, dtype) * block_size
    if budget_bytes is None:
        # On a CPU host memory is shared with everything else: a fixed default beats a fraction of "free".
        budget_bytes = _free_cuda_bytes(device) * memory_fraction if device.type == "cuda" else cpu_default_bytes
    blocks = int(budget_bytes // per_block)
    if blocks < 1:
        raise ValueError(f"a KV budget of {budget_bytes / MIB:.1f} MiB is below one block ({per_block} bytes)")
    return blocks


def _free_cuda_bytes(device: torch.device) -> int:
    free, _total = torch.cuda.mem_get_info(device)
    return free
