"""ms per call of row_linear beside default mode's linear and deterministic mode's tiled linear.

    python -m benchmarks.row_linear [--repeats 25] [--threads N] [--shapes qkv,o,...]

SmolLM2-135M's matrices as Kev multiplies them (q, k and v fused; gate and up fused; the output head),
fp32 and bf16, at decode-sized row counts. Each cell is the median over repeats of the mean of a
short batch of calls; the three kernels take turns within a repeat, so a noisy neighbour hits them alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine.deterministic.tiles import TileCheck, tiled_linear
from engine.kernels.packed_weight import PackedWeight, can_pack
from engine.kernels.row_linear import RowWeight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
ROWS = (1, 4, 16, 32, 64)


def default_weight(weight: torch.Tensor):
    """What default mode multiplies by: a oneDNN-packed weight where it can, else the plain matrix."""
    return PackedWeight(weight) if can_pack(weight.dtype, weight.device) else weight


def default_linear(x, weight):
    return weight.linear(x) if isinstance(weight, PackedWeight) else F.linear(x, weight)


def seconds(fn, x, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls


def cell(kernels: dict, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median ms per call for each kernel on x. A sample is a short batch of calls (about 0.5 ms): on a
    shared machine a thread loses its core for a time slice now and then, and a short sample lets the
    median skip those stalls where one long batch would contain one nearly every time."""
    calls = {name: max(1, int(5e-4 / max(seconds(fn, x, 3), 1e-7))) for name, fn in kernels.items()}
    times = {name: [] for name in kernels}
    for _ in range(repeats):
        for name, fn in kernels.items():
            times[name].append(seconds(fn, x, calls[name]))
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.row_linear", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    print(f"threads {args.threads}; ms per call (median of {args.repeats}); ratio = other / row_linear")
    print(f"{'dtype':6} {'matrix':8} {'rows':>4} {'row':>8} {'default':>8} {'tiled':>8} {'def/row':>8} {'tile/row':>8}")
    for dtype in (torch.float32, torch.bfloat16):
        for name in args.shapes.split(","):
            out, inner = SHAPES[name]
            weight = (torch.randn(out, inner, generator=generator) * 0.05).to(dtype)
            row, default = RowWeight(weight), default_weight(weight)
            TileCheck.weights([default])
            kernels = {"row": row.linear, "default": lambda x: default_linear(x, default),
                       "tiled": lambda x: tiled_linear(x, default)}
            for rows in ROWS:
                x = torch.randn(rows, inner, generator=generator).to(dtype)
                ms = cell(kernels, x, args.repeats)
                print(f"{str(dtype)[6:]:6} {name:8} {rows:4} {ms['row']:8.3f} {ms['default']:8.3f} {ms['tiled']:8.3f} "
                      f"{ms['default'] / ms['row']:8.2f} {ms['tiled'] / ms['row']:8.2f}", flush=True)


if __name__ == "__main__":
    main()
