"""`kev bench batch`'s command line."""

from __future__ import annotations

import argparse
from functools import partial

import anyio

from kev_async.bench.arguments import positive_int
from kev_async.bench.model import bench_model
from schemas import DEFAULT_MODEL

DESCRIPTION = """\
Interactive latency beside a batch: `kev gateway` and `kev serve` in this process on a fresh embedded broker.
--requests chat requests are sent one after another (greedy, --max-new-tokens) with nothing else running;
then a batch of --lines requests (--batch-max-tokens each) is created through POST /v1/files and
POST /v1/batches, and once its first lines are answered the same requests are sent again while it runs
(gateway.batch_in_flight = --in-flight lines of it at a time, at priority -10); then the batch is cancelled
and the requests are sent once more alone. Printed: each phase's p50 and p90, and the p50 beside the batch
over the p50 alone (both alone phases together), with the batch lines answered meanwhile.
"""


def register(kinds: argparse._SubParsersAction) -> None:
    batch = kinds.add_parser("batch", help="interactive latency through the gateway beside a running batch",
                             description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    batch.add_argument("--model", default=DEFAULT_MODEL, help="HF directory, .gguf or built-in name")
    batch.add_argument("--requests", type=positive_int("--requests"), default=20,
                       help="interactive requests per phase (default 20)")
    batch.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=16,
                       help="tokens per interactive answer (default 16)")
    batch.add_argument("--lines", type=positive_int("--lines"), default=400, help="requests in the batch (default 400)")
    batch.add_argument("--batch-max-tokens", type=positive_int("--batch-max-tokens"), default=64,
                       help="tokens per batch answer (default 64)")
    batch.add_argument("--in-flight", type=positive_int("--in-flight"), default=16,
                       help="gateway.batch_in_flight: batch lines asked at once (default 16)")
    batch.add_argument("--threads", type=int, default=None)
    batch.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    from kev_async.bench.batch.run import bench_batch  # the worker, the gateway, aiokafka: for a run only

    model = bench_model(args)
    result = anyio.run(partial(bench_batch, model, requests=args.requests, max_new_tokens=args.max_new_tokens,
                               lines=args.lines, batch_max_tokens=args.batch_max_tokens, in_flight=args.in_flight),
                       backend="asyncio")
    return 0 if result["batch_ran_throughout"] else 1
