"""Fixed-shape tiles: the matmuls of deterministic mode, whose rows do not depend on their neighbours.

A BLAS library picks its kernel, blocking and reduction order from the problem's shape, and the
choice differs between CPUs (MKL on an AMD EPYC and on an Intel Xeon take different paths). So a
row's last bits can move when the number of rows sharing its matmul moves. Deterministic mode never
lets the row count reach the library: rows are padded to whole tiles of ROW_TILE and issued as a
batch of independent (ROW_TILE x K) @ (K x N) products, one shape per weight matrix whatever the
batch. `TileCheck` proves this on the running CPU and thread count before an engine relies on it;
a shape that fails the check is computed one tile per call, which is invariant by definition.

fp32 weights with a packed (oneDNN) copy go further where the check allows: on CPUs where oneDNN's
packed fp32 kernel gives a 16-row tile the same bits alone and inside a call of many rows, one call
over many tiles is faster than the same tiles batched. So such a weight multiplies a step's rows,
padded to whole tiles, in a few calls whose row counts come from ONE_CALL_ROWS (largest first), if
`TileCheck` finds a probe tile's bits unchanged in every tile of a call made of probe copies and at
the start, middle and end of a call of random rows, at each of those row counts, on this CPU and
thread count; otherwise it takes the batched tiles above.
"""

from __future__ import annotations

import structlog
import torch

from engine.kernels.packed_weight import PackedWeight
from engine.kernels.quant import Int8Weight

log = structlog.get_logger("kev.tiles")

ROW_TILE = 16  # rows of every deterministic matmul tile
_LOOPED: set[tuple] = set()  # shapes whose batched tiles failed the check here: one call per tile
# Row counts a packed fp32 weight is checked at and then only called with: a step's rows go out as a sum
# of them, largest first, so a few calls cover any step. A count whose call would take more than
# CHECK_MACS multiply-adds is left out, to keep the start-up check short (a vocabulary-wide output
# head stops at 128 rows).
ONE_CALL_ROWS = (2048, 1024, 512, 256, 128, 64, 32, 16)
CHECK_MACS = 4e9
_ONE_CALL: dict[tuple, tuple[int, ...]] = {}  # (shape, dtype, threads) -> the row counts checked here


def pad_rows(x: torch.Tensor, multiple: int, fill=0) -> torch.Tensor:
    """x with rows of `fill` appended up to a multiple of `multiple` rows."""
    pad = (-x.shape[0]) % multiple
    return torch.cat([x, x.new_full((pad,) + x.shape[1:], fill)]) if pad else x


def tiled_matmul(x: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """x [rows, K] @ right [K, N], every row computed inside a ROW_TILE x K tile of its own shape."""
    rows = x.shape[0]
    tiles = pad_rows(x, ROW_TILE).contiguous().view(-1, ROW_TILE, x.shape[1])
    if _key(right) in _LOOPED:
        out = torch.cat([tile @ right for tile in tiles])
    else:
        out = torch.bmm(tiles, right.expand(tiles.shape[0], -1, -1)).flatten(0, 1)
    return out[:rows]


def tiled_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear in fixed row tiles (deterministic mode)."""
    sizes = TileCheck.one_call(weight) if isinstance(weight, PackedWeight) and weight.plain is not None else None
    if sizes:
        out = _in_parts(x, weight.packed_linear, _parts(x.shape[0], sizes))
    elif isinstance(tile_matrix(weight), torch.Tensor):
        out = tiled_matmul(x, tile_matrix(weight).t())
    else:  # int8 and packed bf16 kernels take no batch of tiles: one call per tile, each of the same shape
        out = _in_parts(x, weight.linear, ROW_TILE)
    return out + bias if bias is not None else out


def _in_parts(x: torch.Tensor, multiply, parts) -> torch.Tensor:
    """multiply() on x's rows padded to whole tiles, split into `parts` (a size or a list of sizes)."""
    return torch.cat([multiply(part) for part in pad_rows(x, ROW_TILE).split(parts)])[: x.shape[0]]


def _parts(rows: int, sizes: tuple[int, ...]) -> list[int]:
    """`rows` padded to whole tiles, as a sum of checked row counts, largest first."""
    rows, parts = -(-rows // ROW_TILE) * ROW_TILE, []
    for size in sizes:
        while rows >= size:
            parts.append(size)
            rows -= size
    return parts


def tile_matrix(weight):
    """What deterministic mode tiles: an fp32 packed weight's plain copy (when its one call was declined,
    batched tiles of one shape beat one packed call per tile), otherwise the weight itself."""
    if isinstance(weight, PackedWeight) and weight.plain is not None:
        return weight.plain
    return weight


def _key(right: torch.Tensor) -> tuple:
    return (tuple(right.shape), tuple(right.stride()), right.dtype)


class TileCheck:
    """Checks that a tile's result is the same alone and in batches of other tiles, on this CPU.

    Each tile of random rows is computed alone, then at several places among 1–6 random neighbour
    tiles; any bit that moves marks the shape as looped (one call per tile). Cheap: a few batched
    matmuls per weight shape, once per process and thread count.
    """

    _done: set[tuple] = set()

    @classmethod
    def weights(cls, matrices: list) -> None:
        for matrix in matrices:
            if isinstance(matrix, PackedWeight) and matrix.plain is not None:
                cls.one_call(matrix)  # at another thread count again, when tiled_linear meets one there
                continue
            weight = tile_matrix(matrix)
            if isinstance(weight, torch.Tensor):
                cls.right(weight.t())
            else:
                cls.per_call(weight)

    @classmethod
    def one_call(cls, weight: PackedWeight) -> tuple[int, ...] | None:
        """The row counts an fp32 packed weight may be called with here, or None where its plain copy
        takes batched tiles instead (checked once per shape and thread count)."""
        key = (tuple(weight.shape), weight.dtype, torch.get_num_threads())
        if ("one call",) + key not in cls._done:
            cls._done.add(("one call",) + key)
            sizes = tuple(m for m in ONE_CALL_ROWS if m == ROW_TILE or m * weight.shape[0] * weight.shape[1] <= CHECK_MACS)
            if _one_call_invariant(weight, sizes):
                _ONE_CALL[key] = sizes
            else:
                log.info("deterministic.one_call_declined", shape=list(weight.shape), threads=key[-1],
                         reason="a tile's bits moved with the row count; batched tiles instead")
                cls.right(weight.plain.t())  # what this weight takes instead, checked like any plain matrix
        return _ONE_CALL.get(key)

    @classmethod
    def per_call(cls, weight: Int8Weight | PackedWeight) -> None:
        """One call per tile is always issued with ROW_TILE rows; a row's neighbours and its place in
        the tile must still not matter. If they do, deterministic mode cannot hold: refuse."""
        kind = "int8" if isinstance(weight, Int8Weight) else "packed bf16"
        key = (kind, tuple(weight.shape), torch.get_num_threads())
        if key in cls._done:
            return
        if not _per_call_invariant(weight):
            setting = "core.weights: int8" if kind == "int8" else "core.precision: bf16"
            raise NotDeterministic(f"the {kind} weight kernel is not row-invariant on this CPU (shape "
                                   f"{list(weight.shape)}): isolation.deterministic cannot be combined with "
                                   f"{setting} here")
        cls._done.add(key)

    @classmethod
    def right(cls, right: torch.Tensor) -> None:
        key = _key(right) + (torch.get_num_threads(),)
        if key in cls._done:
            return
        cls._done.add(key)
        if not _invariant(right):
            _LOOPED.add(_key(right))
            log.warning("deterministic.tile_fallback", shape=list(right.shape), threads=torch.get_num_threads(),
                        reason="batched tiles are not bitwise invariant on this CPU; one call per tile")


class NotDeterministic(ValueError):
    """A precision whose kernels cannot be made batch-invariant on this CPU."""


def _per_call_invariant(weight: Int8Weight | PackedWeight) -> bool:
    generator = torch.Generator().manual_seed(2)
    tile = torch.randn(ROW_TILE, weight.shape[1], generator=generator).to(weight.dtype)
    alone = weight.linear(tile)
    others = torch.randn(ROW_TILE, weight.shape[1], generator=generator).to(weight.dtype)
    order = torch.randperm(ROW_TILE, generator=generator)
    mixed = torch.cat([tile[:3], others[3:]])
    return (torch.equal(weight.linear(tile[order]), alone[order])
            and torch.equal(weight.linear(mixed)[:3], alone[:3]))


def _one_call_invariant(weight: PackedWeight, row_counts: tuple[int, ...]) -> bool:
    """A probe tile alone and with its rows reordered; then, at each row count, in every tile of a call
    of probe copies (every place) and at the start, middle and end of a call of random rows (other
    neighbours): the same bits every time."""
    generator = torch.Generator().manual_seed(3)
    probe = torch.randn(ROW_TILE, weight.shape[1], generator=generator)
    alone = weight.packed_linear(probe)
    order = torch.randperm(ROW_TILE, generator=generator)
    if not torch.equal(weight.packed_linear(probe[order]), alone[order]):
        return False
    for rows in row_counts:
        if not torch.equal(weight.packed_linear(probe.repeat(rows // ROW_TILE, 1)), alone.repeat(rows // ROW_TILE, 1)):
            return False
        batch = torch.randn(rows, weight.shape[1], generator=generator)
        starts = sorted({0, rows // 2 // ROW_TILE * ROW_TILE, rows - ROW_TILE})
        for start in starts:
            batch[start:start + ROW_TILE] = probe
        out = weight.packed_linear(batch)
        if not all(torch.equal(out[start:start + ROW_TILE], alone) for start in starts):
            return False
    return True


def check_items(rows: int, inner: int, cols: int, dtype: torch.dtype) -> bool:
    """Attention's batched items (rows x inner) @ (inner x cols), each with its own right-hand side:
    one item's result alone and among others must agree. There is no slower fallback to switch to,
    so a failure is logged as an error (deterministic mode would not be bitwise here)."""
    generator = torch.Generator().manual_seed(1)
    left = torch.randn(7, rows, inner, generator=generator).to(dtype)
    right = torch.randn(7, inner, cols, generator=generator).to(dtype)
    alone = torch.bmm(left[3:4], right[3:4])[0]
    same = all(torch.equal(torch.bmm(left[a:b], right[a:b])[3 - a], alone) for a, b in ((0, 7), (2, 5), (3, 6)))
    if not same:
        log.error("deterministic.attention_not_invariant", item=[rows, inner, cols], threads=torch.get_num_threads())
    return same


def _invariant(right: torch.Tensor) -> bool:
    generator = torch.Generator().manual_seed(0)

    def random_tiles(count: int) -> torch.Tensor:
        shape = (count, ROW_TILE, right.shape[0])
        return torch.randn(shape, generator=generator).to(right.dtype)

    probe = random_tiles(1)
    alone = torch.bmm(probe, right.expand(1, -1, -1))[0]
    for count, place in ((2, 1), (3, 0), (5, 2), (7, 6)):
        batch = random_tiles(count)
        batch[place] = probe[0]
        if not torch.equal(torch.bmm(batch, right.expand(count, -1, -1))[place], alone):
            return False
    # A row's place inside its tile must not matter either (chunking moves it).
    order = torch.randperm(ROW_TILE, generator=generator)
    moved = torch.bmm(probe[0][order][None], right.expand(1, -1, -1))[0]
    return torch.equal(moved, alone[order])
