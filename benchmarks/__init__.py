"""Research comparisons, apart from the service: each one is `python -m benchmarks.<name> ...` from a clone,
run in one process on the same inputs, printing a table and its ratios (docs/speed.md holds the results).

engine, scaling (+ scaling_plot), lora, precision, step, routing (+ semantic) and row_linear. They lean on
the service's own benchmark parts (kev_async/bench/: model, machine, arguments); the benchmarks a user of
the service runs stay `kev bench ...`. Their smoke tests are benchmarks/tests/ (`make test-bench`).
"""
