"""`python -m benchmarks.<name>`: one research benchmark's parser, with `kev bench`'s -v and quiet logs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from kev_async.cli.bench import with_verbose


def run_alone(register: Callable[[argparse._SubParsersAction], None], argv: list[str] | None = None) -> int:
    """Parse `argv` (the command line by default) with the one parser `register` adds, then run it."""
    holder = argparse.ArgumentParser(add_help=False)
    kinds = holder.add_subparsers(dest="bench_command", required=True)
    register(kinds)
    ((name, parser),) = kinds.choices.items()
    parser.prog = f"python -m benchmarks.{name}"
    with_verbose(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return args.func(args)
