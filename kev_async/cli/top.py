"""`kev top`: a live terminal view of one worker; the scraping and the frame are observe/dashboard.py."""

from __future__ import annotations

import argparse
import sys
import time

from kev_async.observe.dashboard import CLEAR, DEFAULT_URL, Sample, Unreachable, render, scrape


def register(subparsers: argparse._SubParsersAction) -> None:
    top = subparsers.add_parser(
        "top", help="live view of a running worker (from its /metrics endpoint)",
        description="Show queue, batch, KV pool, throughput, answers, mailboxes and consumer lag of one "
                    "`kev serve` worker, refreshed every --interval seconds. Ctrl-C quits.")
    top.add_argument("--url", default=DEFAULT_URL, help=f"the worker's metrics URL (default {DEFAULT_URL})")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    top.add_argument("--once", action="store_true", help="print one frame (two scrapes, --interval apart) and exit")
    top.set_defaults(func=run_top)


def run_top(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print("kev top: --interval must be above 0", file=sys.stderr)
        return 2
    try:
        before = scrape(args.url)
        time.sleep(args.interval)
        now = scrape(args.url)
    except Unreachable as error:
        print(f"kev top: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    if args.once:
        print(render(now, before, args.url, args.interval))
        return 0
    return _live(args, before, now)


def _live(args: argparse.Namespace, before: Sample, now: Sample) -> int:
    try:
        while True:
            sys.stdout.write(CLEAR + render(now, before, args.url, args.interval) + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
            try:
                before, now = now, scrape(args.url)
            except Unreachable as error:  # the worker may be restarting: keep trying
                sys.stdout.write(f"{CLEAR}kev top: {error}; retrying every {args.interval:g}s\n")
                sys.stdout.flush()
                while True:
                    time.sleep(args.interval)
                    try:
                        before = now = scrape(args.url)
                        break
                    except Unreachable:
                        continue
    except KeyboardInterrupt:
        return 0
