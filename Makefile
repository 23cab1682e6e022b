# The two commands of the README. Each sets itself up (venv, packages, model) and is quick the second time.
.PHONY: demo test setup

setup:
	@bash ops/setup.sh

demo: setup
	.venv/bin/kev demo

test: setup
	.venv/bin/python -m pytest -q
