"""`kev bench ...`: speed measured side by side in one run, printed as a table and ratios.

Each benchmark is a module `kev_async/bench/<name>.py`, or a package `kev_async/bench/<name>/` (load,
gateway), defining `register(kinds)`, which adds its `kev bench <name>` parser to `kinds` (the bench
subparsers) and sets `func=`. Enable a new one by adding "<name>" to BENCHES; the order there is the
order of `kev bench --help`. `kev --help` imports what defines `register`, so torch and the engine are
imported only when a benchmark runs: inside a module's functions, or by a package's run modules, which
its command.py imports when it runs.
"""

from __future__ import annotations

import argparse
from importlib import import_module

BENCHES: tuple[str, ...] = ("engine", "lora", "scaling", "kafka", "load", "gateway", "routing", "precision",
                            "step", "structured", "spec", "peer", "isolation", "fairness")


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks that print side-by-side ratios",
                                  description="Benchmarks. Each runs its contenders in one process, on the "
                                              "same inputs, and prints tokens/s and ratios.")
    kinds = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for name in BENCHES:
        import_module(f"kev_async.bench.{name}").register(kinds)
