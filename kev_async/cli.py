"""The `kev` command line. Each subcommand is one `_add_<cmd>(subparsers)` listed in COMMANDS."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

import yaml

from kev_async.ask import add_ask, add_model
from kev_async.audit import add_audit
from kev_async.bench_cli import add_bench
from kev_async.serve_cli import add_demo, add_serve
from kev_async.settings import load_config, resolved_dict
from kev_async.top import add_top
from schemas import SCHEMA_VERSION, ConfigError

DESCRIPTION = """\
Kev answers many independent questions with one language model, one packed forward pass per step.
Questions and answers are Kafka events; no answer depends on the questions that shared its pass."""


def _add_config(subparsers: argparse._SubParsersAction) -> None:
    config = subparsers.add_parser("config", help="check and show configuration files",
                                   description="Work with kev.yaml configuration files.")
    actions = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check", help="validate a config file and print it resolved",
        description="Validate FILE plus KEV_* environment overrides. On success print the full "
                    "resolved config as YAML (secrets masked) and exit 0; otherwise print each "
                    "problem as 'FILE: key.path: reason' to stderr and exit 2.",
    )
    check.add_argument("file", metavar="FILE", type=Path, help="the YAML config, e.g. ops/kev.yaml")
    check.add_argument("--no-env", action="store_true", help="ignore KEV_* environment overrides")
    check.set_defaults(func=_config_check)


def _config_check(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.file, env={} if args.no_env else os.environ)
    except ConfigError as error:
        error.source = error.source or str(args.file)
        for line in error.lines():
            print(line, file=sys.stderr)
        return 2
    print(yaml.safe_dump(resolved_dict(cfg), sort_keys=False), end="")
    return 0


def _add_version(subparsers: argparse._SubParsersAction) -> None:
    version = subparsers.add_parser("version", help="print Kev's version",
                                    description="Print Kev's version and its event schema version.")
    version.set_defaults(func=_version)


def _version(_args: argparse.Namespace) -> int:
    print(f"kev {_package_version()} (event schema {SCHEMA_VERSION})")
    return 0


def _package_version() -> str:
    try:
        return metadata.version("kev")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


# Add a subcommand: write `_add_<cmd>(subparsers)` that sets `func=` and list it here.
COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_serve, add_demo, add_ask, add_bench, add_audit, add_model, add_top, _add_config, _add_version]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kev", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_command in COMMANDS:
        add_command(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help and usage errors; return instead
        return exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 2
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
