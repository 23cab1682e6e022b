"""The `kev` command line: `main(argv)` builds the parser from COMMANDS and dispatches.

A command is a module `kev_async/cli/<name>.py` defining `register(subparsers)`, which adds its
parser(s) and sets `func=` (called with the parsed args; returns the exit code). Enable it by adding
"<name>" to COMMANDS; the order there is the order of `kev --help`. Nothing outside kev_async/cli
imports the CLI; each command module keeps its top-level imports light (no torch), since `kev --help`
imports every one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import import_module

import msgspec

from schemas import ConfigError
from schemas.signing import TrustKeyError

DESCRIPTION = """\
Kev answers many independent questions with one language model, one packed forward pass per step.
Questions and answers are Kafka events; no answer depends on the questions that shared its pass."""

COMMANDS: tuple[str, ...] = ("serve", "route", "gateway", "control", "demo", "drill", "ask", "pipeline", "bench",
                             "audit", "model", "top", "config", "version")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kev", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        import_module(f"kev_async.cli.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help and usage errors; return instead
        return exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 2
    try:
        return args.func(args)
    except ConfigError as error:
        for line in error.lines():
            print(f"kev {args.command}: {line}", file=sys.stderr)
        return 2
    except Exception as error:
        if not _user_mistake(error):
            raise
        print(f"kev {args.command}: {error}", file=sys.stderr)
        return 2


def _user_mistake(error: Exception) -> bool:
    """Errors that a command's arguments or config caused: one line, not a traceback."""
    if isinstance(error, (TrustKeyError, msgspec.ValidationError)):
        return True
    loader = sys.modules.get("engine.model.loader")  # not imported for `kev --help`: torch is heavy
    backend = sys.modules.get("engine.kernels.backend")  # core.attention / isolation.deterministic refused
    return ((loader is not None and isinstance(error, (loader.ModelNotFound, loader.UnsupportedModel)))
            or (backend is not None and isinstance(error, backend.BackendRefused)))
