"""`python -m kev_async.bench.gateway ...`, the same as `kev bench gateway ...`."""

from __future__ import annotations

import argparse
import sys

from kev_async.bench.gateway.command import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kev bench")
    register(parser.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(["gateway", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
