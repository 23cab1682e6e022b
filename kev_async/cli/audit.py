"""`kev audit check` and `kev audit render`: the audit checker (observe/audit.py) and the mask picture
(observe/mask_picture.py) from the command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kev_async.observe.audit import AUDIT_EVENTS, AuditLog, AuditLogError, check_log, format_report, read_audit_log


def register(subparsers: argparse._SubParsersAction) -> None:
    audit = subparsers.add_parser("audit", help="check or draw the per-forward isolation audit log",
                                  description="Work with the audit records an engine logs per forward when "
                                              "audit is on (isolation.debug, or logging.level debug).")
    actions = audit.add_subparsers(dest="audit_command", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check", help="re-verify every forward record of a log",
        description="Read every forward.mask / forward.isolation_violation record of LOGFILE (structlog JSON "
                    "lines; other lines are skipped), re-check each forward's invariants and each question's "
                    "position continuity across forwards (with speculative decoding, each draft's origin and "
                    "outcome, from question.verified and engine.drained records too), and print a summary. "
                    "Exit 0 when clean, 1 on any violation, 2 when the file is unreadable or holds no audit "
                    "records.")
    check.add_argument("logfile", metavar="LOGFILE", type=Path)
    check.set_defaults(func=_check)
    render = actions.add_parser(
        "render", help="draw one forward's attention visibility as a PNG",
        description="Draw which keys each query row of one recorded forward can see: one coloured block per "
                    "question, causal inside, blank elsewhere.")
    render.add_argument("logfile", metavar="LOGFILE", type=Path)
    render.add_argument("--forward", "-f", type=int, required=True, metavar="N", help="the forward number to draw")
    render.add_argument("--run", type=int, default=None, metavar="R",
                        help="which run, when the log holds several engines' forwards (default: the first "
                             "that has forward N)")
    render.add_argument("-o", "--output", type=Path, default=Path("mask.png"), help="PNG path (default mask.png)")
    render.add_argument("--size", type=float, default=8.0, help="figure side in inches (default 8)")
    render.add_argument("--dpi", type=int, default=100, help="dots per inch (default 100)")
    render.set_defaults(func=_render)


def _load(path: Path) -> AuditLog | None:
    try:
        log = read_audit_log(path)
    except AuditLogError as exc:
        print(f"kev audit: {exc}", file=sys.stderr)
        return None
    if not log.records:
        print(f"kev audit: {path}: no {' / '.join(AUDIT_EVENTS)} records in {log.lines} lines "
              f"(turn audit on: isolation.debug: true, or logging.level: debug with JSON logs)", file=sys.stderr)
        return None
    return log


def _check(args: argparse.Namespace) -> int:
    log = _load(args.logfile)
    if log is None:
        return 2
    report = check_log(log)
    print(format_report(str(args.logfile), log, report))
    return 0 if report.clean else 1


def _render(args: argparse.Namespace) -> int:
    from kev_async.drawing import matplotlib_missing

    if matplotlib_missing("kev audit render"):
        return 2
    log = _load(args.logfile)
    if log is None:
        return 2
    matches = log.find(args.forward, args.run)
    if not matches:
        numbers = sorted({r.forward for r in log.records if args.run is None or r.run == args.run})
        span = f"{numbers[0]}..{numbers[-1]}" if numbers else "none"
        run = f" in run {args.run}" if args.run is not None else ""
        print(f"kev audit render: forward {args.forward} is not in {args.logfile}{run} "
              f"(recorded forwards: {span}, {len(numbers)} in all)", file=sys.stderr)
        return 2
    record = matches[0]
    from kev_async.observe.mask_picture import render_forward  # matplotlib: only when drawing

    drawn = render_forward(record.data, args.output, size_in=args.size, dpi=args.dpi,
                           title_prefix=f"run {record.run} " if log.runs > 1 else "")
    note = f" (run {record.run}; {len(matches)} runs have forward {args.forward})" if len(matches) > 1 else ""
    print(f"wrote {args.output}: {record.label}, {drawn.segments} questions, {drawn.rows} rows x "
          f"{drawn.keys} keys, {drawn.width}x{drawn.height} px{note}")
    return 0
