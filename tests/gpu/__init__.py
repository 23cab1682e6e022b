"""The GPU suite, a package so its conftest is `gpu.conftest`: a second top-level `conftest` module would
shadow tests/conftest.py for the CPU tests that import helpers from it."""
