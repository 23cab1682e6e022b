"""A CPU matmul whose result for a row never depends on how many rows share the call (fp32, bf16).

Library GEMMs (MKL, oneDNN) pick their blocking, and with it each output's order of additions, from the
problem's shape, so a row's last bits move with the number of rows beside it. Here every output element
is one chain of multiply-adds over k = 0 .. K-1 from zero (bf16: over pairs of k, by `vdpbf16ps` where
the CPU has AVX512_BF16), the same instruction whatever the tile; rows and column panels only decide
which chains run side by side, and threads split the work by column panels. A row alone, inside 2,048
rows, at any place among them and at any thread count gives the same bits: batch-invariant by
construction (tests/test_row_linear.py proves it on the running CPU).

The weight is repacked once, at load, into panels of 16 output columns by K (bf16: by K/2 pairs of
k), so a step reads each weight once whatever its row count, 16 columns per vector load.

The C++ (row_linear.cpp, built with Kev's other CPU kernels: engine/kernels/native.py) is compiled for
the host (`-march=native`): AVX-512 (with or without
AVX512_BF16), AVX2 or plain C++, chosen by what the compiler sees the CPU has. Paths differ from
each other in the last bits, never within one build. KEV_ROW_LINEAR=0 declines the kernel.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from engine.kernels import native
from engine.kernels.native import CFLAGS, NO_AVX512, PLAIN  # noqa: F401  (the builds tests compare)

PANEL = 16  # output columns per panel: one AVX-512 vector of fp32
DTYPES = (torch.float32, torch.bfloat16)


def kernel():
    """The module built for this CPU (engine/kernels/native.py), or None (no compiler, or KEV_ROW_LINEAR=0)."""
    if os.environ.get("KEV_ROW_LINEAR", "1") == "0":
        return None
    return native.module()


def compiled(cflags: tuple[str, ...]):
    """The module built with these flags (tests also build NO_AVX512 and PLAIN), or None."""
    return native.compiled(cflags)


def usable(weight) -> bool:
    """Whether `weight` (a plain tensor) can be a RowWeight here."""
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.dtype in DTYPES and kernel() is not None)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> fp32 [panels, K, 16]; bf16 [panels, K2/2, 16, 2] with K2 = K rounded up to even.
    Columns past N and the k past an odd K are zeros."""
    n, k = weight.shape
    pairs = weight.dtype is torch.bfloat16
    padded = F.pad(weight, (0, k % 2 if pairs else 0, 0, (-n) % PANEL))
    panels = padded.view(-1, PANEL, padded.shape[1])
    if not pairs:
        return panels.transpose(1, 2).contiguous()
    return panels.view(panels.shape[0], PANEL, -1, 2).transpose(1, 2).contiguous()


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> int8 [panels, K + 4, 16]: each panel's K rows of 16 int8 columns, then the 16 columns'
    fp32 scales as 64 bytes, so a panel's scales are read with it. Symmetric per output channel, as
    Int8Weight quantises (engine/kernels/quant.py): the same int8 values, the scales kept in fp32."""
    rows = weight.detach().cpu().float()
    scales = rows.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(rows / scales[:, None]).clamp(-127, 127).to(torch.int8)
    pad = (-q.shape[0]) % PANEL
    q, scales = F.pad(q, (0, 0, 0, pad)), F.pad(scales, (0, pad))
    panels = q.view(-1, PANEL, q.shape[1]).transpose(1, 2)
    return torch.cat([panels, scales.view(-1, PANEL).contiguous().view(torch.int8).view(-1, 4, PANEL)], 1).contiguous()


class RowWeight:
    """A weight matrix [out, in] repacked for row_linear; `linear(x)` computes `F.linear(x, weight)`.
    `int8=True` stores it as weight-only int8 with a scale per output channel: rows keep their dtype
    (fp32 or bf16) and are multiplied in fp32 by the exactly widened int8 values, then the scale."""

    def __init__(self, weight: torch.Tensor, module=None, int8: bool = False):
        self.op = module or kernel()
        if self.op is None:
            raise RuntimeError("the row_linear kernel is not built on this machine")
        if weight.dtype not in DTYPES or weight.dim() != 2:
            raise ValueError(f"row_linear takes fp32 or bf16 matrices, not {weight.dtype} {list(weight.shape)}")
        self.shape, self.dtype, self.int8 = weight.shape, weight.dtype, int8
        self.packed = pack_int8(weight) if int8 else pack(weight.detach().cpu())
        self.isa = self.op.row_linear_isa()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def matrix(self) -> torch.Tensor:
        """The matrix as loaded [out, in], unpacked exactly (for quantising, or tiles in deterministic mode)."""
        n, k = self.shape
        if self.int8:  # dequantised: the values this weight multiplies by
            scales = self.packed[:, k:].contiguous().view(torch.float32).reshape(-1)[:n]
            return (self.packed[:, :k].transpose(1, 2).reshape(-1, k)[:n].float() * scales[:, None]).to(self.dtype)
        if self.dtype is torch.bfloat16:
            return self.packed.permute(0, 2, 1, 3).reshape(-1, self.packed.shape[1] * 2)[:n, :k].contiguous()
        return self.packed.transpose(1, 2).reshape(-1, k)[:n].contiguous()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead, inner = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, inner)
        if self.dtype is torch.bfloat16 and inner % 2 and not self.int8:
            rows = F.pad(rows, (0, 1))  # the packed pairs' zero k
        out = self.op.row_linear(rows.contiguous(), self.packed, self.shape[0]).view(*lead, self.shape[0])
        return out + bias if bias is not None else out
