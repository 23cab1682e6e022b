"""`kev bench ...`: speed measured side by side in one run, printed as a table and ratios.

Each benchmark is a module `kev_async/bench/<name>.py`, or a package `kev_async/bench/<name>/` (load,
gateway, fairness), defining `register(kinds)`, which adds its `kev bench <name>` parser to `kinds` (the bench
subparsers) and sets `func=`. Enable a new one by adding "<name>" to BENCHES; the order there is the
order of `kev bench --help`. `kev --help` imports what defines `register`, so torch and the engine are
imported only when a benchmark runs: inside a module's functions, or by a package's run modules, which
its command.py imports when it runs. These are the benchmarks a user of the service runs; the research
comparisons (engine, scaling, lora, precision, step, routing, row_linear, answer_surface) are
`python -m benchmarks.<name>` in a clone.
"""

from __future__ import annotations

import argparse
from importlib import import_module

BENCHES: tuple[str, ...] = ("load", "kafka", "gateway", "batch", "peer", "structured", "spec", "isolation",
                             "fairness")


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks that print side-by-side ratios",
                                  description="Benchmarks. Each runs its contenders in one process, on the "
                                              "same inputs, and prints tokens/s and ratios.",
                                  epilog="The research comparisons (engine, scaling, lora, precision, step, routing, "
                                         "row_linear, answer_surface) run from a clone: "
                                         "python -m benchmarks.<name> --help")
    kinds = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for name in BENCHES:
        import_module(f"kev_async.bench.{name}").register(kinds)
    for parser in kinds.choices.values():
        with_verbose(parser)


def with_verbose(parser: argparse.ArgumentParser) -> None:
    """Add -v to a benchmark's parser and run its func with logs on stderr, quiet unless -v."""
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at info on stderr (default: warnings only, so stdout is the table alone)")
    parser.set_defaults(func=_quiet_unless_verbose(parser.get_default("func")))


def _quiet_unless_verbose(func):
    """Run a benchmark with structlog configured (JSON or console lines on stderr, never on stdout beside
    the table) at warning, or info with -v; the level is restored after, as tests run benchmarks in process."""
    def run(args: argparse.Namespace) -> int:
        from kev_async.logs import quieted  # structlog: not for `kev --help`

        with quieted("info" if args.verbose else "warning"):
            return func(args)
    return run
