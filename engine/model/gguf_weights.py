"""A GGUF file's weights under transformers' names, read one tensor at a time, the block formats kept.

`weights: auto` on a GGUF whose matrices are all in a block format Kev multiplies as stored
(engine/kernels/block_weight.py FORMATS: Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K) reads each matrix's
bytes from the file straight into a BlockWeight: the model holds about the file's size and no
full-precision copy of it is ever made. An embedding table beside its own output head stays in the file
(FileTable), read by row. Other tensors (norms, biases, an embedding table in another
format) are dequantized one at a time. Names and row orders are transformers' own: its GGUF name map
and its tensor processors (Llama's q/k rows are stored permuted by llama.cpp's converter; a row being
whole blocks, the permutation moves bytes and changes no value).
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.kernels import native
from engine.kernels.block_weight import BY_TYPE, BlockTensor, BlockWeight, pack


NAMES_FILE = "gguf_names.json"
EMBEDDING = "token_embd.weight"  # looked up by rows: left in the file (FileTable) unless it is also the head


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF's order: innermost first ([in, out] for a matrix)
    ggml_type: int
    offset: int  # from the file's start
    n_bytes: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name


@dataclass(frozen=True)
class Header:
    architecture: str
    tensors: tuple[TensorInfo, ...]


_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@functools.lru_cache(maxsize=8)
def _header(path: Path, size: int, mtime: float) -> Header:
    """The file's architecture and tensor table, parsed directly: gguf-py's reader turns every metadata
    value (a tokenizer's 150k strings) into arrays first, 10 s for a 135M model on a busy host."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
        if version < 2:
            raise ValueError(f"{path} is GGUF version {version}; Kev reads 2 and later")
        at, values = 24, {}

        def read(fmt: str):
            nonlocal at
            out = struct.unpack_from("<" + fmt, data, at)[0]
            at += struct.calcsize("<" + fmt)
            return out

        def string() -> str:
            nonlocal at
            length = read("Q")
            at += length
            return bytes(data[at - length:at]).decode("utf-8", "replace")

        def value(kind: int):
            nonlocal at
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                item, count = read("I"), read("Q")
                if item in _SCALAR:  # skipped: Kev reads no array here
                    at += count * struct.calcsize("<" + _SCALAR[item])
                else:
                    for _ in range(count):
                        value(item)
                return None
            return read(_SCALAR[kind])

        for _ in range(n_kv):
            key = string()
            values[key] = value(read("I"))
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = tuple(read("Q") for _ in range(read("I")))
            ggml_type, offset = read("I"), read("Q")
            block, size_ = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            infos.append((name, dims, ggml_type, offset, math.prod(dims) // block * size_))
        align = values.get("general.alignment", 32)
        start = -(-at // align) * align
    tensors = tuple(TensorInfo(name, dims, kind, start + offset, n_bytes) for name, dims, kind, offset, n_bytes in infos)
    return Header(values.get("general.architecture", ""), tensors)


def read_header(path: Path) -> Header:
    stat = Path(path).stat()
    return _header(Path(path), stat.st_size, stat.st_mtime)


def _matrices(header: Header) -> list[TensorInfo]:
    """The tensors a forward multiplies by: the layers' 2-D weights and the output head (the embedding
    table where the file ties it to the head)."""
    names = {t.name for t in header.tensors}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    return [t for t in header.tensors if len(t.dims) == 2 and (t.name.startswith("blk.") or t.name == head)]


def unstored_matrices(path: Path) -> dict[str, str]:
    """Matrices of this GGUF whose format Kev does not multiply as stored: name -> format (empty: all run as stored)."""
    return {t.name: t.type_name for t in _matrices(read_header(path)) if t.ggml_type not in BY_TYPE}


def runs_as_stored(path: Path) -> bool:
    """Whether `weights: auto` keeps this GGUF's blocks: every matrix in FORMATS, and the kernels built here."""
    return not unstored_matrices(path) and native.module() is not None


class GgufState(Mapping):
    """transformers' name -> the weight, read from the file when asked: a BlockWeight (compute dtype
    `dtype`) for a block-format matrix, else a float32 tensor. Each tensor is read once, when first asked."""

    def __init__(self, path: Path, hf_config, dtype: torch.dtype, names: dict[str, str] | None = None):
        """`names`: the file's name map as `name_map` gives it (loader.py keeps it beside the config), else
        made here, at the cost of transformers' modeling code staying imported (~85 MiB)."""
        self.path, self.dtype = Path(path), dtype
        header = read_header(self.path)
        self._processor = _processor(header.architecture, hf_config)
        to_hf = names if names is not None else name_map(hf_config, header.architecture)
        self._tensors = {to_hf[t.name]: t for t in header.tensors if t.name in to_hf}
        self._head = next((t.name for t in _matrices(header) if not t.name.startswith("blk.")), None)

    def __getitem__(self, name: str):
        info = self._tensors[name]
        if info.ggml_type in BY_TYPE:
            if info.name == EMBEDDING and info.name != self._head and not self._reorders(info):
                return FileTable(self.path, info, self.dtype)
            return BlockWeight([self._blocks(info)], self.dtype)
        return self._dense(info)

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the tensor to answer
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def _bytes(self, info, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor's bytes read from the file into `out` (or a new array); not mapped: mapped pages
        would stay in the process."""
        out = np.empty(info.n_bytes, dtype=np.uint8) if out is None else out.reshape(-1)
        with open(self.path, "rb") as file:
            file.seek(info.offset)
            if file.readinto(memoryview(out)) != out.size:
                raise ValueError(f"{self.path} ends inside tensor {info.name}")
        return out

    def _reorders(self, info) -> bool:
        rows = info.dims[1]
        return not np.array_equal(self._order(info, rows), np.arange(rows))

    def _order(self, info, rows: int) -> np.ndarray:
        """The row order transformers' tensor processor gives this matrix (Llama's q/k are permuted)."""
        order = self._processor.process(weights=np.arange(rows, dtype=np.float64).reshape(rows, 1), name=info.name).weights
        return np.asarray(order).reshape(-1)

    def _blocks(self, info) -> BlockTensor:
        fmt = BY_TYPE[info.ggml_type]
        k, rows = info.dims
        blocks = BlockTensor.blank(fmt, rows, k)
        if blocks.data.numel() != info.n_bytes:
            raise ValueError(f"{self.path}: {info.name} holds {info.n_bytes} bytes, not the {blocks.data.numel()} "
                             f"of {rows} {fmt.name} rows of {k}")
        self._bytes(info, blocks.data.numpy())
        order = self._order(info, rows)
        return blocks if np.array_equal(order, np.arange(rows)) else blocks.take_rows(order.astype(np.int64))

    def _dense(self, info) -> torch.Tensor:
        from gguf import GGMLQuantizationType, dequantize

        shape = list(reversed(info.dims))
        rows = math.prod(shape[:-1])
        values = dequantize(self._bytes(info).reshape(rows, -1), GGMLQuantizationType(info.ggml_type)).reshape(shape)
        values = self._processor.process(weights=values, name=info.name).weights
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


class FileTable(BlockWeight):
    """An embedding table left in its GGUF file: each step reads the rows its tokens look up (os.preadv)
    and dequantizes them as a BlockWeight would. The process never holds the table (89 of Qwen2.5 0.5B's
    463 MiB of weights), nor does it grow toward it as questions use more of the vocabulary: only the
    page cache holds the file, shared and reclaimable. Used where the file has its own output head; a
    table that is also the head is read whole, as every step multiplies by all of it."""

    def __init__(self, path: Path, info: TensorInfo, dtype: torch.dtype):
        fmt, (k, rows) = BY_TYPE[info.ggml_type], info.dims
        super().__init__([BlockTensor(fmt, torch.empty(0, k // fmt.block * fmt.bytes, dtype=torch.uint8), k)], dtype)
        self.shape, self._parts = torch.Size((rows, k)), None
        self.format, self.path, self.offset = fmt, Path(path), info.offset
        self._file = open(path, "rb")  # held open: a file replaced by a rename keeps answering from this one
        if os.fstat(self._file.fileno()).st_size < info.offset + info.n_bytes:
            raise ValueError(f"{self.path} ends inside tensor {info.name}")

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        wanted, where = torch.unique(ids.reshape(-1), return_inverse=True)  # sorted: read in file order
        if wanted.numel() and not (0 <= int(wanted[0]) and int(wanted[-1]) < self.shape[0]):
            raise ValueError(f"embedding rows {int(wanted[0])} .. {int(wanted[-1])} asked of {self.shape[0]}")
        part = BlockTensor.blank(self.format, wanted.numel(), self.shape[1])
        self._read(wanted.tolist(), part.data.numpy())
        flat = self.op.block_rows(pack([part]), where)
        return flat.view(*ids.shape, self.shape[1]).to(dtype or self.dtype)

    def _read(self, rows: list[int], out: np.ndarray) -> None:
        """Rows `rows` into out's rows, one read per run of consecutive rows."""
        size, slot = out.shape[1], 0
        while slot < len(rows):
            run = 1
            while slot + run < len(rows) and rows[slot + run] == rows[slot] + run:
                run += 1
            if os.preadv(self._file.fileno(), [out[slot:slot + run]], self.offset + rows[slot] * size) != run * size:
                raise ValueError(f"{self.path} ends inside its embedding table: was it truncated in place?")
            slot += run

    @property
    def packed(self) -> torch.Tensor:
        """The whole table, read at first use (a caller that multiplies by it, or wants every row at once)."""
        if self._packed is None:
            part = BlockTensor.blank(self.format, *self.shape)
            self._read(list(range(self.shape[0])), part.data.numpy())
            self._packed = pack([part])
        return self._packed

    @property
    def nbytes(self) -> int:
        return self._packed.nbytes if self._packed is not None else 0


def _processor(architecture: str, hf_config):
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())


def name_map(hf_config, architecture: str) -> dict[str, str]:
    """GGUF name -> transformers' name, from transformers' own map over the model built on the meta device
    (`architecture`: the file's, which picks transformers' tensor processor)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return get_gguf_hf_weights_map(model, _processor(architecture, hf_config))


def save_name_map(path: Path, hf_config, directory: Path) -> None:
    """Keep GGUF `path`'s name map in `directory`, so that a process loading it never imports the modeling code."""
    names = name_map(hf_config, read_header(Path(path)).architecture)
    (Path(directory) / NAMES_FILE).write_text(json.dumps(names, indent=0))


def load_name_map(directory: Path) -> dict[str, str] | None:
    """The name map kept in a described GGUF's directory; None where it is missing (GgufState then makes it)."""
    try:
        return json.loads((Path(directory) / NAMES_FILE).read_text())
    except FileNotFoundError:
        return None
