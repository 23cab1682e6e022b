"""bf16 weight matrices kept in oneDNN's blocked layout, for CPU matmuls.

`F.linear` on bf16 CPU tensors hands the weight to oneDNN, which reorders it into its blocked layout on
every call; at a decode step's few rows that reorder costs about as much as the product itself.
Reordered once at load, the same kernel gives the same results, faster (bitwise equal to F.linear for
every shape of SmolLM2 at 1-257 rows; at 1,000 rows one shape differs in its last bits, because
F.linear picks another blocking there). The 30 layers of
SmolLM2-135M took 33.8 -> 21.5 ms at 8 rows and 64.2 -> 31.6 ms at 64 rows, and its output layer
4.8 -> 2.2 ms at 1 row (2 Sapphire Rapids cores). fp32 gains nothing this way: MKL's packed GEMM is
only used for the one row count it was packed for, and any other falls back to plain F.linear.
"""

from __future__ import annotations

import torch

PACK_ROWS_HINT = 32  # the row count oneDNN picks its blocking for; any row count works


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedWeight:
    """A weight matrix [out, in] in oneDNN's layout; `linear(x)` computes `F.linear(x, weight)`."""

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
        self.shape, self.dtype = weight.shape, weight.dtype

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
