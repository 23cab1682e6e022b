"""The small math pieces of a decoder layer, written to match transformers' results."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.quant import Int8Weight

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] for each token's own position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias); `weight` is a tensor, an Int8Weight (weight-only int8) or a PackedWeight."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    return weight.linear(x, bias)


def embed(table, ids: torch.Tensor) -> torch.Tensor:
    """Rows of an embedding table, a tensor or an Int8Weight (dequantised on lookup)."""
    return table.rows(ids) if isinstance(table, Int8Weight) else table[ids]
