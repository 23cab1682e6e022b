"""Kev's CPU kernels, compiled together into one extension for the host's instruction set.

row_linear.cpp (the row-invariant matmul), block_linear.cpp (the same promise for GGUF's block formats, with
block_formats.cpp, block_few.cpp and block_woven.cpp before it),
paged_decode.cpp (attention read from the block pool in
place) and layer_stack.cpp (RMSNorm, SwiGLU and the whole layer stack in one call, built from the other
two) are one translation unit: the layer stack calls the same compiled functions the Python forward calls one by one,
so both give a row the same bits. One set of flags serves all three:
  -ffp-contract=off    a multiply and an add stay two roundings unless the code calls fma by name, so
                       the plain C++ paths round as the torch ops they stand in for;
  -fno-trapping-math   lets floor() vectorise in the softmax's exp; Kev never reads floating-point traps.
"""

from __future__ import annotations

import functools
import pathlib

from engine.kernels import extension

_HERE = pathlib.Path(__file__).parent
SOURCES = [_HERE / name for name in (
    "row_linear.cpp", "block_formats.cpp", "block_few.cpp", "block_woven.cpp", "block_linear.cpp", "paged_decode.cpp", "layer_stack.cpp")]
FUNCTIONS = ["row_linear", "row_linear_isa", "block_linear", "block_rows", "block_linear_isa", "rms_norm",
             "paged_decode", "silu_mul", "layer_stack"]

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math")
NO_AVX512 = CFLAGS + ("-mno-avx512f",)  # what an AVX2 machine runs
PLAIN = NO_AVX512 + ("-mno-avx2",)  # neither: the portable C++ path


def module():
    """The kernels built for this CPU, or None where they cannot be built (no compiler or headers)."""
    return compiled(CFLAGS)


@functools.cache
def compiled(cflags: tuple[str, ...]):
    """The kernels built with these flags (tests also build NO_AVX512 and PLAIN), or None."""
    return extension.build("kev_cpu", SOURCES, FUNCTIONS, tuple(cflags))
