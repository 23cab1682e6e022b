"""Deterministic mode's matmuls on row_linear, wherever a start-up check proves it row-invariant here.

row_linear (engine/kernels/row_linear.py) reduces every output in an order fixed by K alone, so a row's
bits do not depend on what shares its call, and the fixed tiles of engine/deterministic/tiles.py are not
needed. As TileCheck does for tiles, the promise is checked on the running CPU and thread count before
an engine relies on it: a probe row computed alone must keep its bits in every place of a call of its
copies and at the start, middle and end of calls of random rows up to CHECK_ROWS. A shape that fails, a
machine without the kernel and int8 weights take the tiles.

Each matrix gets its repacked copy once, the first time deterministic mode checks it, kept as long as
the matrix lives (a default-mode engine may share the matrix and keeps multiplying its own copy); a
matrix that default mode already multiplies through row_linear (core.matmul) is its own copy.
"""

from __future__ import annotations

import weakref

import structlog
import torch

from engine.deterministic.tiles import TileCheck
from engine.kernels import row_linear
from engine.kernels.packed_weight import PackedWeight
from engine.kernels.row_linear import RowWeight

log = structlog.get_logger("kev.deterministic")

CHECK_ROWS = (2, 7, 64, 2048)  # row counts a probe row is checked inside
CHECK_MACS = 4e9  # a check call over this many multiply-adds is left out (a vocabulary-wide head stops at 64)
COPIES = 37  # a call of the probe's copies: every place in a tile of rows, and a partial tile


class _Rows:
    """A matrix's row_linear copy and, per thread count, whether the check passed for its shape."""

    def __init__(self, row: RowWeight, proven: dict[int, bool] | None = None):
        self.row = row
        self.proven: dict[int, bool] = {} if proven is None else proven


_COPIES: dict[int, _Rows] = {}  # id(matrix) -> its copy, while the matrix lives
# A RowWeight is its own copy; its verdicts are kept beside it, weakly, so a dropped model is freed.
_OWN: "weakref.WeakKeyDictionary[RowWeight, dict[int, bool]]" = weakref.WeakKeyDictionary()
_CHECKED: dict[tuple, bool] = {}  # (shape, dtype, isa, threads) -> the check's verdict


def covered(matrix) -> bool:
    """Whether row_linear can multiply by this matrix: fp32 or bf16 on the CPU, plain, oneDNN-packed or
    already repacked for row_linear (core.matmul)."""
    if isinstance(matrix, RowWeight):
        return True
    if isinstance(matrix, PackedWeight):
        return matrix.dtype in row_linear.DTYPES and row_linear.kernel() is not None
    return row_linear.usable(matrix)


def take(matrices: list) -> list:
    """Prove each matrix row_linear covers (see `prove`); the ones left for the tiles. One log line says
    how the matrices split and which instruction set the kernel runs."""
    left = [matrix for matrix in matrices if not prove(matrix)]
    module = row_linear.kernel()
    log.info("deterministic.row_linear", isa=module.row_linear_isa() if module else None,
             matrices=len(matrices) - len(left), tiled=len(left), threads=torch.get_num_threads())
    return left


def prove(matrix) -> bool:
    """Give a covered matrix its row_linear copy (once) and check its shape at this thread count; True
    if deterministic mode may multiply by it through row_linear here."""
    if not covered(matrix):
        return False
    if isinstance(matrix, RowWeight):  # default mode multiplies by it already: no second copy
        return _holds(_Rows(matrix, _OWN.setdefault(matrix, {})))
    rows = _COPIES.get(id(matrix))
    if rows is None:
        rows = _COPIES[id(matrix)] = _Rows(RowWeight(matrix.matrix() if isinstance(matrix, PackedWeight) else matrix))
        weakref.finalize(matrix, _COPIES.pop, id(matrix), None)
    return _holds(rows)


def row_weight(matrix) -> RowWeight | None:
    """The proven row_linear copy to multiply `matrix` by at this thread count, or None (tiles)."""
    proven = _OWN.get(matrix) if isinstance(matrix, RowWeight) else None
    rows = _Rows(matrix, proven) if proven is not None else _COPIES.get(id(matrix))
    if rows is None:
        return None
    verdict = rows.proven.get(torch.get_num_threads())
    if verdict is None:  # first met at this thread count
        verdict = _holds(rows)
        if not verdict:
            TileCheck.weights([matrix])  # declined here: its tiles are checked instead
    return rows.row if verdict else None


def _holds(rows: _Rows) -> bool:
    threads = torch.get_num_threads()
    verdict = rows.proven.get(threads)
    if verdict is None:
        row = rows.row
        key = (tuple(row.shape), row.dtype, row.isa, threads)
        if key not in _CHECKED:
            _CHECKED[key] = row_invariant(row)
            if not _CHECKED[key]:
                log.warning("deterministic.row_linear_declined", shape=list(row.shape), dtype=str(row.dtype),
                            isa=row.isa, threads=threads, reason="a row's bits moved with its neighbours; tiles instead")
        verdict = rows.proven[threads] = _CHECKED[key]
    return verdict


def row_invariant(row: RowWeight) -> bool:
    """A probe row's bits alone, in every place of a call of its copies, and at the start, middle and
    end of calls of random rows: the same every time."""
    inner = row.shape[1]
    generator = torch.Generator().manual_seed(4)
    probe = torch.randn(1, inner, generator=generator).to(row.dtype)
    alone = row.linear(probe)[0]
    if not torch.equal(row.linear(probe.expand(COPIES, -1).contiguous()), alone.expand(COPIES, -1)):
        return False
    for count in (c for c in CHECK_ROWS if c == CHECK_ROWS[0] or c * row.shape[0] * inner <= CHECK_MACS):
        batch = torch.randn(count, inner, generator=generator).to(row.dtype)
        places = sorted({0, count // 2, count - 1})
        batch[places] = probe
        out = row.linear(batch)
        if not all(torch.equal(out[place], alone) for place in places):
            return False
    return True
