"""The small math pieces of a decoder layer, written to match transformers' results."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import row_linear
from engine.kernels.quant import Int8Weight

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in fp32, rounded to x's dtype, then scaled. In fp32 torch's fused
    op gives transformers' bits in one call. In bf16 on a CPU, row_linear's extension does it in one call
    too (torch takes ~8: to float, norm, back, multiply; a decode step makes 61), rounding twice as
    transformers does; its sum of squares runs in another order, so a value can differ by one bf16 step."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    module = _bf16_kernels(x, weight)
    if module is not None:
        return module.rms_norm_bf16(x, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _bf16_kernels(x: torch.Tensor, weight: torch.Tensor):
    """row_linear's compiled module where it can normalise x (bf16, contiguous, on the CPU), else None."""
    if x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or x.device.type != "cpu":
        return None
    if not x.is_contiguous():
        return None
    return row_linear.kernel()


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
