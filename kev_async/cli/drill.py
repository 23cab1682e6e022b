"""`kev drill`: the fault drill (kev_async/drill/): workers killed, added and stopped mid-stream on the
embedded broker, then every answer, commit and KV pool checked. Exit 0 only if every check holds."""

from __future__ import annotations

import argparse
from pathlib import Path

import anyio

from schemas import DEFAULT_MODEL


def register(subparsers: argparse._SubParsersAction) -> None:
    drill = subparsers.add_parser(
        "drill", help="fault drill: kill, add and stop workers mid-stream, then check nothing was lost",
        description="Start the embedded broker and --workers `kev serve` processes in one group, publish "
                    "--questions questions over --spread seconds, SIGKILL one worker at 25%% answered and start "
                    "a new one, SIGKILL the broker at 40%% and restart it on its data (durable storage under "
                    "--workdir), SIGTERM another worker at 55%%, then check: every question has exactly one final "
                    "answer (redelivery duplicates counted, and identical), no offset was committed before its "
                    "answer was acked, every gracefully stopped worker's KV pool is all free. Workers run "
                    "deterministic mode at temperature 0. --no-faults makes it a plain throughput run (default mode; --spread 0 --pin "
                    "for the scaling table). --exactly-once runs the workers with kafka.delivery exactly_once and "
                    "reads the answers read_committed: then no duplicate at all is allowed.")
    drill.add_argument("--questions", type=int, default=400)
    drill.add_argument("--workers", type=int, default=3)
    drill.add_argument("--partitions", type=int, default=6)
    drill.add_argument("--max-new-tokens", type=int, default=16)
    drill.add_argument("--spread", type=float, default=60.0, help="seconds over which the questions arrive")
    drill.add_argument("--model", default=DEFAULT_MODEL, help="HF directory, .gguf or built-in name")
    drill.add_argument("--workdir", default=".cache/drill",
                       help="where worker logs and report.json go (default .cache/drill)")
    drill.add_argument("--no-faults", action="store_true", help="no kills or stops: measure answers/s")
    drill.add_argument("--pin", action="store_true", help="pin worker i to core i mod cores (one torch thread each)")
    drill.add_argument("--exactly-once", action="store_true",
                       help="workers commit answers and offsets in Kafka transactions; answers read read_committed "
                            "must show each question exactly once")
    drill.set_defaults(func=_drill)


def _drill(args: argparse.Namespace) -> int:
    # The drill (aiokafka, the broker) and structlog's set-up: loaded to run it, not for `kev --help`.
    from kev_async.drill.run import DrillOptions, DrillStalled, result_json, run_drill
    from kev_async.logs import configure_logging

    configure_logging("warning")
    options = DrillOptions(questions=args.questions, workers=args.workers, partitions=args.partitions,
                           max_new_tokens=args.max_new_tokens, spread_s=args.spread, model=args.model,
                           workdir=Path(args.workdir), faults=not args.no_faults, pin=args.pin,
                           exactly_once=args.exactly_once)
    try:
        result = anyio.run(run_drill, options, backend="asyncio")
    except DrillStalled as stalled:
        print(f"DRILL FAILED: {stalled}")
        return 1
    (options.workdir / "report.json").write_bytes(result_json(result))
    allowed = (f"0 allowed; at_least_once would allow {result.duplicate_bound}" if args.exactly_once else
               f"at most {result.duplicate_bound} explained by the faults")
    print(f"\ndelivery {result.delivery}{' (answers read read_committed)' if args.exactly_once else ''}: "
          f"{result.answered}/{result.questions} answered, {result.answer_records} answer records "
          f"({result.duplicates} duplicates, {allowed} {result.duplicate_allowance}; "
          f"{len(result.duplicates_differing)} differing), "
          f"{result.error_answers} error answers; {result.answers_per_s} answers/s over {result.seconds:.1f}s")
    print(f"commits checked: {result.commits_checked}, before their answer's ack: {len(result.commits_before_ack)}; "
          f"final commit covers every question: {result.final_commit_covers_all}")
    for worker, pool in result.kv_pools.items():
        print(f"{worker}: {result.workers[worker]}; KV pool {pool}")
    print(f"broker restart: {result.broker_restart}")
    print(f"report: {options.workdir / 'report.json'}; worker logs beside it")
    print("DRILL PASSED" if result.ok else "DRILL FAILED")
    return 0 if result.ok else 1
