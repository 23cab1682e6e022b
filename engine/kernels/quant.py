"""Weight-only int8: per-output-channel scales, multiplied by torch's own kernel.

`torch.ops.aten._weight_int8pack_mm(x, w_int8 [N, K], scales [N])` computes x @ (w * scales).T with
int8 weights read from memory (a quarter of fp32's bytes) and the activations in bf16: on this
torch's CPU kernel fp32 activations are many times slower than bf16 ones, so the matmul always runs
in bf16 whatever the model's dtype, and its result is cast back. Symmetric quantisation:
scale = max |w| of the row / 127, so 0 stays exact and no zero point is needed.
"""

from __future__ import annotations

import torch

KERNEL_DTYPE = torch.bfloat16  # the activation dtype the int8 kernel is fast with


class Int8Weight:
    """A weight matrix [out, in] stored as int8 rows and one scale per row (output channel)."""

    def __init__(self, weight: torch.Tensor):
        rows = weight.float()
        scales = rows.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.qweight = torch.round(rows / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scales.to(KERNEL_DTYPE)
        self.dtype = weight.dtype  # the model's compute dtype: what callers get back
        self.shape = weight.shape

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.qweight, self.scales).to(x.dtype)
        return out + bias if bias is not None else out

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantised rows, for an embedding table stored as int8 (tied to the output head)."""
        return (self.qweight[ids].to(torch.float32) * self.scales[ids, None].float()).to(dtype or self.dtype)

    def dequantize(self) -> torch.Tensor:
        return (self.qweight.float() * self.scales[:, None].float()).to(self.dtype)


def quantize_weight(weight: torch.Tensor) -> Int8Weight:
    return Int8Weight(weight)
