"""The machine and the code a benchmark ran on, as its reports and archived JSON name them."""

from __future__ import annotations

import subprocess
from pathlib import Path

# The clone this package was imported from, if it was: kev_async/bench/machine.py -> the repository root.
_SOURCE_ROOT = Path(__file__).resolve().parents[2]


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


def source_commit() -> str | None:
    """The commit checked out where Kev runs from a git clone; None for an installed package or without git."""
    if not (_SOURCE_ROOT / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "-C", str(_SOURCE_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None


def run_stamp() -> dict:
    """What every benchmark's JSON records so an archived figure can be traced: the commit and the CPU."""
    return {"commit": source_commit(), "cpu": cpu_name()}
