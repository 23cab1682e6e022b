"""The small math pieces of a decoder layer, written to match transformers' results."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.quant import Int8Weight

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm, bit for bit: normalised in fp32, rounded to x's dtype, then scaled. torch's
    fused op does the fp32 part in one call instead of five (the same bits); in fp32 it scales too, but
    in bf16 it would round once where transformers rounds twice."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, for apply_rope: rotate_half(x) * sin == roll(x) * signed_sin
    bit for bit, since a product's sign flips exactly."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' x * cos + rotate_half(x) * sin in four calls instead of nine (a decode step makes
    one per layer). x: [tokens, heads, head_dim]; cos, sin_signed: [tokens, 1, head_dim] for each
    token's own position, sin_signed from signed_sin."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def embed(table, ids: torch.Tensor) -> torch.Tensor:
    """Rows of an embedding table, a tensor or an Int8Weight (dequantised on lookup)."""
    return table.rows(ids) if isinstance(table, Int8Weight) else table[ids]
