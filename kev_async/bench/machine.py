"""The machine a benchmark ran on, as its reports name it."""

from __future__ import annotations

from pathlib import Path


def cpu_name() -> str:
    """The CPU model and the flags that decide reduced-precision speed."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    wanted = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    return f"{name} ({', '.join(wanted) or 'no avx512'})"
