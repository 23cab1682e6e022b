"""Weight matrices kept in GGUF's block formats, multiplied as stored (block_linear.cpp).

A llama.cpp user's Q4_K_M or Q8_0 file holds its matrices as blocks of 4-8 bit codes with a scale
(and a min) per block. Kev keeps those bytes: a matrix reads as many bytes per step as the file holds,
about a quarter of bf16's for Q4_K, and a 7B model fits where a full-precision copy would not. Each
row of activations is quantized to int8 in blocks of 32 on its own (never with the rest of the batch),
multiplied by int8 dot products, and reduced in one order fixed by K, so a row's bits never depend on
what shares its call: solo == packed, at any thread count (tests/test_block_linear.py).

FORMATS lists what runs as stored. A `BlockWeight` is a RowWeight to the rest of Kev (the layer
stack, deterministic mode): the same `linear`, `matrix` and `packed` tensor, which row_linear's
`multiply` hands to block_linear.cpp by its dtype (uint8).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels import native
from engine.kernels.row_linear import RowWeight

MAGIC = 0x4B45564230303031  # "KEVB0001", block_linear.cpp's header tag
HEADER_BYTES = 256
MAX_PARTS = 9
ALIGN = 64


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # the id a GGUF file's tensor info carries
    block: int  # weights per block
    bytes: int  # bytes per block


FORMATS = {f.name: f for f in (
    BlockFormat("Q4_0", 2, 32, 18),
    BlockFormat("Q5_0", 6, 32, 22),
    BlockFormat("Q8_0", 8, 32, 34),
    BlockFormat("Q4_K", 12, 256, 144),
    BlockFormat("Q5_K", 13, 256, 176),
    BlockFormat("Q6_K", 14, 256, 210),
)}
BY_TYPE = {f.ggml_type: f for f in FORMATS.values()}


@dataclass
class BlockTensor:
    """One matrix [rows, k] as its file stores it: `data` uint8 [rows, k / block * bytes]."""

    format: BlockFormat
    data: torch.Tensor
    k: int
    buffer: torch.Tensor | None = None  # set by blank(): the buffer `data` sits in, where pack() puts it

    @classmethod
    def blank(cls, fmt: BlockFormat, rows: int, k: int) -> "BlockTensor":
        """A matrix of unset bytes placed in a buffer as pack() lays out one part, so that a matrix read
        into `data` (a file's tensor) becomes its block weight without a copy: the largest matrix (a big
        vocabulary's embedding table) would otherwise briefly take twice its bytes."""
        row_bytes = k // fmt.block * fmt.bytes
        buffer = torch.empty(HEADER_BYTES + _aligned(rows * row_bytes), dtype=torch.uint8)
        return cls(fmt, buffer[HEADER_BYTES : HEADER_BYTES + rows * row_bytes].view(rows, row_bytes), k, buffer)

    def __post_init__(self):
        if self.k % self.format.block:
            raise ValueError(f"a {self.format.name} matrix needs rows of whole {self.format.block}-blocks, not {self.k}")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != self.row_bytes:
            raise ValueError(f"{self.format.name} rows of {self.k} take {self.row_bytes} bytes, got {list(self.data.shape)}")

    @property
    def row_bytes(self) -> int:
        return self.k // self.format.block * self.format.bytes

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.k)

    def take_rows(self, order: torch.Tensor | np.ndarray) -> "BlockTensor":
        """The matrix with its rows in `order` (a row is whole blocks: reordering rows moves bytes only)."""
        return BlockTensor(self.format, self.data[torch.as_tensor(order, dtype=torch.long)].contiguous(), self.k)


def pack(parts: list[BlockTensor]) -> torch.Tensor:
    """The uint8 tensor block_linear.cpp reads: a header, then each part's rows (outputs side by side)."""
    if not parts or len(parts) > MAX_PARTS:
        raise ValueError(f"a block weight has 1 to {MAX_PARTS} parts, not {len(parts)}")
    k = parts[0].k
    if any(part.k != k for part in parts):
        raise ValueError(f"fused parts must share their input width, got {[part.k for part in parts]}")
    header, offset = [MAGIC, k, len(parts)], HEADER_BYTES
    for part in parts:
        header += [part.format.ggml_type, part.shape[0], offset]
        offset += _aligned(part.data.numel())
    if len(parts) == 1 and parts[0].buffer is not None:  # read where it belongs: the header goes in front
        out, used = parts[0].buffer, HEADER_BYTES + parts[0].data.numel()
        out[:HEADER_BYTES].zero_()
        out[used:].zero_()
    else:
        out = torch.zeros(offset, dtype=torch.uint8)
        for part, start in zip(parts, header[5::3]):
            out[start : start + part.data.numel()] = part.data.reshape(-1)
    out[: 8 * len(header)] = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    return out


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


class BlockWeight(RowWeight):
    """A matrix [out, in] in block formats (a fused one: parts stacked by output); `linear(x)` is
    x @ W^T with x's rows quantized to int8 per 32-block, in x's dtype (fp32 or bf16)."""

    def __init__(self, parts: list[BlockTensor], dtype: torch.dtype, module=None):
        self.op = module or native.module()
        if self.op is None:
            raise RuntimeError("Kev's CPU kernels are not built on this machine: block weights cannot run")
        self.shape = torch.Size((sum(part.shape[0] for part in parts), parts[0].k))
        self.dtype, self.int8 = dtype, False
        self.formats = tuple(part.format.name for part in parts)
        self.isa = self.op.block_linear_isa()
        self._parts: list[BlockTensor] | None = list(parts)
        self._packed: torch.Tensor | None = None

    @property
    def packed(self) -> torch.Tensor:
        """The tensor block_linear.cpp reads, made at first use: a fused matrix's parts are copied once,
        into it, and then let go."""
        if self._packed is None:
            self._packed, self._parts = pack(self._parts), None
        return self._packed

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """torch.cat of block weights along their outputs (q|k|v, gate|up) fuses their parts, unpacked."""
        weights, dim = args[0], args[1] if len(args) > 1 else (kwargs or {}).get("dim", 0)
        if func is not torch.cat or dim != 0 or not all(isinstance(w, BlockWeight) and w._parts for w in weights):
            return NotImplemented
        dtypes = {w.dtype for w in weights}
        if len(dtypes) != 1:
            raise ValueError(f"fused block weights must share a compute dtype, got {sorted(map(str, dtypes))}")
        return BlockWeight([part for w in weights for part in w._parts], dtypes.pop(), weights[0].op)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1]).to(self.dtype).contiguous()
        out = self.op.block_linear(rows, self.packed, self.shape[0]).view(*lead, self.shape[0])
        return out + bias if bias is not None else out

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows `ids` dequantized (the file's float32 values), in `dtype` or the compute dtype (an embedding
        table kept in blocks)."""
        flat = self.op.block_rows(self.packed, ids.reshape(-1))
        return flat.view(*ids.shape, self.shape[1]).to(dtype or self.dtype)

    def matrix(self) -> torch.Tensor:
        """The whole matrix dequantized (tests, and deterministic mode's tiles where it declines these)."""
        return self.rows(torch.arange(self.shape[0]))

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes
