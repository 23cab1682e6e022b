"""What this CPU can do fast, read from /proc/cpuinfo flags (never from the CPU's name).

bf16 matmuls are fast only where the ISA has bf16 dot products: AVX-512 BF16 (AMD Zen 4 and later,
Intel Cooper Lake) or AMX (Intel Sapphire Rapids and later). Elsewhere oneDNN emulates bf16 and is
slower than fp32, so a requested bf16 falls back to fp32 with one log line.
"""

from __future__ import annotations

import functools
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("kev.cpu")

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's flags; empty where /proc/cpuinfo is missing (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def can_reorder_bf16() -> bool:
    """oneDNN reorders bf16 weights into its blocked layout only with these (torch raises otherwise)."""
    flags = cpu_flags()
    return "avx_ne_convert" in flags or {"avx512bw", "avx512vl", "avx512dq"} <= flags


def has_fast_bf16() -> bool:
    return any(flag in cpu_flags() for flag in BF16_FLAGS)


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype to run in: bf16 on a CPU without bf16 instructions falls back to fp32, logged once."""
    if dtype is not torch.bfloat16 or device.type != "cpu" or has_fast_bf16():
        return dtype
    log.warning("precision.bf16_fallback", requested="bf16", using="fp32",
                reason=f"this CPU has none of the flags {', '.join(BF16_FLAGS)}: bf16 would be emulated "
                       "and slower than fp32")
    return torch.float32


def int8_dot_isa() -> str:
    """The int8 dot product block_linear.cpp multiplies GGUF blocks with on this CPU: AVX-512 VNNI's or
    AVX-VNNI's vpdpbusd, AVX2's vpmaddubsw + vpmaddwd, or plain C++ (the build's -march=native sees the same
    flags; tests/test_block_linear.py checks that they agree)."""
    flags = cpu_flags()
    if {"avx512_vnni", "avx512vl", "avx2", "fma"} <= flags:
        return "avx512-vnni"
    if {"avx_vnni", "avx2", "fma"} <= flags:
        return "avx-vnni"
    return "avx2" if {"avx2", "fma"} <= flags else "plain"
