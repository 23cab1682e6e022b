"""The small math pieces of a decoder layer, written to match transformers' results."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import row_linear
from engine.kernels.block_weight import BlockWeight
from engine.kernels.quant import Int8Weight

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in fp32, rounded to x's dtype, then scaled. On a CPU, row_linear's
    extension does it in one call (torch takes 5-8, ~20 us for one row; a decode step makes 61), with
    transformers' roundings; its sum of squares runs in its own fixed order, so a value can differ from
    transformers' by one step of x's dtype. Elsewhere torch's ops: fp32 in one fused call, bf16 in several."""
    module = _row_kernels(x, weight)
    if module is not None:  # a strided view (Qwen3's q and k) is copied first: never a path that depends on T
        return module.rms_norm(x.contiguous(), weight, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _row_kernels(x: torch.Tensor, weight: torch.Tensor):
    """row_linear's compiled module where it can normalise x (fp32 or bf16 on the CPU), else None. Decided by
    dtype and device only: whether a view happens to be contiguous changes with the row count."""
    if x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype or x.device.type != "cpu":
        return None
    return row_linear.kernel()


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up], each rounded to the rows' dtype as transformers rounds. On a
    CPU in one call of Kev's own kernel, the one its layer stack uses (its exp is its own, so a value can
    differ from torch's silu in the last bit); elsewhere torch's ops."""
    module = _row_kernels(gate_up, gate_up)
    if module is not None:
        return module.silu_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up for rows [gate | up]: Gemma's MLP, with torch's ops."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def signed_sin(sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """sin with the sign rotate_half gives it, for apply_rope: rotate_half(x) * sin == roll(x) * signed_sin
    bit for bit, since a product's sign flips exactly. By halves, the first half negated; interleaved
    (GLM: pairs (0, 1), (2, 3)... rotate), every even entry."""
    if interleaved:
        signs = torch.tensor([-1.0, 1.0], dtype=sin.dtype, device=sin.device).repeat(sin.shape[-1] // 2)
        return sin * signs
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' x * cos + rotate_half(x) * sin in four calls instead of nine (a decode step makes
    one per layer). x: [tokens, heads, head_dim]; cos, sin_signed: [tokens, 1, head_dim] for each
    token's own position, sin_signed from signed_sin."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """apply_rope over the leading cos.shape[-1] dims of each head (all of them but for GLM's and some
    Phi-3's partial rotary), by halves or, interleaved, by pairs; the other dims pass unchanged."""
    width = cos.shape[-1]
    if width == x.shape[-1] and not interleaved:
        return apply_rope(x, cos, sin_signed)
    part = x[..., :width]
    turned = part.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) if interleaved else part.roll(width // 2, -1)
    return torch.cat((part * cos + turned * sin_signed, x[..., width:]), dim=-1)


def embed(table, ids: torch.Tensor) -> torch.Tensor:
    """Rows of an embedding table, a tensor, an Int8Weight or a GGUF's BlockWeight (dequantised on lookup)."""
    return table.rows(ids) if isinstance(table, (Int8Weight, BlockWeight)) else table[ids]
