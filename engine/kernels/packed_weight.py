"""Weight matrices kept in oneDNN's blocked layout, for CPU matmuls.

bf16: `F.linear` on bf16 CPU tensors hands the weight to oneDNN, which reorders it into its blocked
layout on every call; at a decode step's few rows that reorder costs about as much as the product
itself. Reordered once at load, the same kernel gives the same results, faster (bitwise equal to
F.linear for every shape of SmolLM2 at 1-257 rows; at 1,000 rows one shape differs in its last bits,
because F.linear picks another blocking there). The 30 layers of SmolLM2-135M took 33.8 -> 21.5 ms at
8 rows and 64.2 -> 31.6 ms at 64 rows, and its output layer 4.8 -> 2.2 ms at 1 row (2 Sapphire Rapids
cores).

fp32: `F.linear` goes to MKL, whose small-batch GEMMs are slow for these shapes: all of SmolLM2-135M's
matmuls in a row (weights streamed from memory, as in a step) took 64-68 ms at 8 rows through MKL and
38-43 through oneDNN's packed kernel, 88-89 against 68-71 at 32, 50 against 37 at 4; at 1-2 rows MKL
was faster (26-30 against 30-36) and from ~128 rows on they were level. Whole decode steps, the two
alternating on one engine: packed 0.89x at 3 rows, 1.16x at 4, 1.21x at 16, 1.16x at 32, 1.03x at 64,
1.02x at 96. So an fp32 matrix keeps its plain copy too (twice the weight memory; `core.pack_fp32:
false` declines the packed one) and `linear` picks by row count: PACKED_FP32_ROWS packed, the rest
plain. The two kernels round differently, so a row's last bits depend on how many rows share the step
(default mode promises equal greedy tokens, not bits). Deterministic mode multiplies the packed copy in
calls of the row counts where its start-up check shows the kernel keeps a 16-row tile's bits, else the
plain copy in batched tiles (engine/deterministic/tiles.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.cpu_features import can_reorder_bf16

PACK_ROWS_HINT = 32  # the row count oneDNN picks its blocking for; any row count works
PACKED_FP32_ROWS = range(4, 97)  # fp32 row counts where the packed kernel was faster (see above)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    if dtype is torch.bfloat16 and not can_reorder_bf16():
        return False  # a CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT: bf16 stays in plain F.linear
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedWeight:
    """A weight matrix [out, in] in oneDNN's layout; `linear(x)` computes `F.linear(x, weight)`.

    `plain`: the matrix as loaded, kept for fp32, where MKL on it beats the packed kernel at some row
    counts; None for bf16 (the packed kernel is as fast or faster at every row count)."""

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
        self.shape, self.dtype = weight.shape, weight.dtype
        self.plain = weight if weight.dtype == torch.float32 else None

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + (self.plain.nbytes if self.plain is not None else 0)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.plain is not None and x.shape[0] not in PACKED_FP32_ROWS:
            return F.linear(x, self.plain, bias)
        return self.packed_linear(x, bias)

    def packed_linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The packed kernel at any row count."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
