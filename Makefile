# The two commands of the README. Each sets itself up (venv, packages, model) and is quick the second time.
.PHONY: demo test setup

setup:
	@bash ops/setup.sh

demo: setup
	.venv/bin/kev ask "Explain TCP's three-way handshake in one sentence." "Write a haiku about autumn." "What is the capital of France?" --max-new-tokens 64

test: setup
	.venv/bin/python -m pytest -q
