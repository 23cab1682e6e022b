"""`kev version`: Kev's package version and its event schema version."""

from __future__ import annotations

import argparse
from importlib import metadata

from schemas import SCHEMA_VERSION


def register(subparsers: argparse._SubParsersAction) -> None:
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
