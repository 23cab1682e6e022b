"""The small math pieces of a decoder layer, written to match transformers' results."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 16  # deterministic mode: every matmul sees exactly this many rows per tile


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A matmul whose rows do not depend on how many other rows share it (batch invariance).

    BLAS picks a different kernel for a different row count, which moves the last bits of a row's
    output. Padding to whole tiles of ROW_TILE rows and running them as a batched matmul keeps the
    kernel, and so every row's bits, the same whatever the batch.
    """
    rows = x.shape[0]
    pad = (-rows) % ROW_TILE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = torch.matmul(x.view(-1, ROW_TILE, x.shape[1]), weight.t()).view(-1, weight.shape[0])[:rows]
    return out + bias if bias is not None else out
