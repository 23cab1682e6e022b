"""Weight matrices kept in oneDNN's blocked layout, for CPU matmuls.

bf16: `F.linear` on bf16 CPU tensors hands the weight to oneDNN, which reorders it into its blocked
layout on every call; at a decode step's few rows that reorder costs about as much as the product
itself. A `PackedWeight` is reordered once, at load, and multiplied by the same kernel. Its results
equal `F.linear`'s at decode-sized row counts; at large ones F.linear may pick another blocking, so
the last bits can differ.

fp32: `F.linear` goes to MKL. For these shapes oneDNN's packed kernel is the faster from a few rows
to about a hundred; MKL is faster at one to three rows, and above that range the two are level. So an
fp32 matrix keeps its plain copy too (twice the weight memory; `core.pack_fp32: false` declines the
packed one) and `linear` picks by row count: PACKED_FP32_ROWS packed, the rest plain. The two kernels
round differently, so a row's last bits depend on how many rows share the step (default mode promises
equal greedy tokens, not bits). Deterministic mode multiplies the packed copy in calls of the row
counts where its start-up check shows the kernel keeps a 16-row tile's bits, else the plain copy in
batched tiles (engine/deterministic/tiles.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.cpu_features import can_reorder_bf16

PACK_ROWS_HINT = 32  # the row count oneDNN picks its blocking for; any row count works
PACKED_FP32_ROWS = range(4, 97)  # fp32 row counts the packed kernel takes; the rest go to MKL (see above)


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

    def matrix(self) -> torch.Tensor:
        """The matrix as loaded: the plain copy, or (bf16) recovered from the packed one as I @ W^T. Each
        output is one weight times 1 plus zeros, so it is the weight, except that a -0 comes back +0 and
        a subnormal 0 (the kernel flushes them; its products see the same)."""
        if self.plain is not None:
            return self.plain
        return self.packed_linear(torch.eye(self.shape[1], dtype=self.dtype)).t().contiguous()

    def packed_linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The packed kernel at any row count."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
