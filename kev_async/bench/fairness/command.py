"""`kev bench fairness`'s command line."""

from __future__ import annotations

import argparse
import sys

from kev_async.bench.arguments import positive_int
from schemas import DEFAULT_MODEL

DESCRIPTION = """\
Tenants sharing one engine (scheduler.policy fair against fcfs, the same questions, one after another in one
run), on two paths: Kev's async Engine in this process, and through Kafka (`kev serve` in this process on a
fresh embedded broker per run, each question published at its arrival, signed under its tenant; the worker
reads --read-ahead records per partition ahead and holds --channel-pool-size questions):

  flood   tenant "bulk" asks --flood questions at once; --after s later tenant "chat" asks --small short
          ones. Printed: chat's median latency under the flood against chat alone, under each policy, and
          bulk's goodput (its answer tokens per second of wall time) under fair against FCFS.
  shares  tenants "a" and "b" each ask --backlog questions at once, with weights 1:1 and then 3:1;
          printed: the service (tokens prefilled and decoded) each received while both were backlogged,
          against what the weights promise.

Greedy answers; every answer must be the same under every policy and on both paths (fairness changes order,
never tokens). The two paths' figures are printed side by side at the end.
"""


def register(kinds: argparse._SubParsersAction) -> None:
    fairness = kinds.add_parser("fairness", help="tenants sharing one engine: policy fair against FCFS",
                                description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    fairness.add_argument("--model", default=DEFAULT_MODEL, help="HF directory, .gguf or built-in name")
    fairness.add_argument("--scenarios", default="flood,shares", help="flood, shares or both (default both)")
    fairness.add_argument("--paths", default="in_process,kafka",
                          help="in_process, kafka or both (default both, in process first)")
    fairness.add_argument("--read-ahead", type=positive_int("--read-ahead"), default=None,
                          help="through Kafka: kafka.read_ahead, records per partition (default: --batch-size)")
    fairness.add_argument("--channel-pool-size", type=positive_int("--channel-pool-size"), default=None,
                          help="through Kafka: router.channel_pool_size (default: 4 x --batch-size, what 4 "
                               "partitions' windows read ahead)")
    fairness.add_argument("--flood", type=positive_int("--flood"), default=96, help="bulk's questions (default 96)")
    fairness.add_argument("--flood-tokens", type=positive_int("--flood-tokens"), default=64,
                          help="each bulk answer's max_new_tokens (default 64)")
    fairness.add_argument("--small", type=positive_int("--small"), default=6, help="chat's questions (default 6)")
    fairness.add_argument("--small-tokens", type=positive_int("--small-tokens"), default=16,
                          help="each chat answer's max_new_tokens (default 16)")
    fairness.add_argument("--after", type=float, default=0.5, help="s between the flood and chat (default 0.5)")
    fairness.add_argument("--backlog", type=positive_int("--backlog"), default=64,
                          help="questions each tenant of `shares` asks (default 64)")
    fairness.add_argument("--backlog-tokens", type=positive_int("--backlog-tokens"), default=48,
                          help="their max_new_tokens (default 48)")
    fairness.add_argument("--batch-size", type=positive_int("--batch-size"), default=32,
                          help="router.max_parallel_queries (default 32)")
    fairness.add_argument("--max-tokens-per-step", type=positive_int("--max-tokens-per-step"), default=None,
                          help="scheduler.max_tokens_per_step (default: the engine's)")
    fairness.add_argument("--prompt-chunk-tokens", type=int, default=None,
                          help="scheduler.prompt_chunk_tokens (default: the engine's)")
    fairness.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores, at most 16)")
    fairness.add_argument("--output-json", default=".cache/bench/fairness.json",
                          help="the JSON result (default .cache/bench/fairness.json)")
    fairness.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    from kev_async.bench.fairness.run import run_fairness  # torch and the engine: only for a run

    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(scenarios) - {"flood", "shares"}
    if unknown or not scenarios:
        print(f"kev bench fairness: error: --scenarios {args.scenarios!r}: give flood, shares or both", file=sys.stderr)
        return 2
    path_names = {"in_process": "in process", "kafka": "through Kafka"}
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or set(paths) - set(path_names):
        print(f"kev bench fairness: error: --paths {args.paths!r}: give in_process, kafka or both", file=sys.stderr)
        return 2
    if args.channel_pool_size is not None and args.channel_pool_size < args.batch_size:
        print("kev bench fairness: error: --channel-pool-size must be at least --batch-size", file=sys.stderr)
        return 2
    if args.after < 0:
        print("kev bench fairness: error: --after must be 0 or more", file=sys.stderr)
        return 2
    run_fairness(args, scenarios, [path_names[p] for p in paths])
    return 0
