# The two commands of the README. Each sets itself up (venv, packages, model) and is quick the second time.
.PHONY: demo test setup

setup:
	@bash ops/setup.sh

demo: setup
	.venv/bin/kev demo

test: setup
	@echo "kev: the test suite, about 15 minutes on 2 cores (a dot per test)" >&2
	.venv/bin/python -m pytest -q
