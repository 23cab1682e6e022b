"""`kev bench gateway`'s command line: its flags, and the run on the gateway's own kind of event loop."""

from __future__ import annotations

import argparse
from functools import partial

import anyio

from kev_async.bench.arguments import positive_int, positive_ints
from kev_async.bench.model import bench_model
from schemas import DEFAULT_MODEL


def register(kinds: argparse._SubParsersAction) -> None:
    gateway = kinds.add_parser(
        "gateway", help="latency the HTTP gateway adds over publishing to Kafka directly",
        description="Send --concurrency questions at once, --rounds times per path, alternately through "
                    "`kev gateway` (HTTP, non-streaming) and straight to kev.questions (aiokafka); print each "
                    "path's p50/p90 latency and the p50 the gateway adds. A list (--concurrency 1,8,64) "
                    "repeats the measurement per level: a fixed cost shows at 1, queueing in the gateway's one "
                    "event loop grows with the level.")
    gateway.add_argument("--model", default=DEFAULT_MODEL)
    gateway.add_argument("--concurrency", type=positive_ints("concurrency levels", "64 or 1,8,64"), default=[64],
                         help="questions at once, or a comma list of levels (default 64)")
    gateway.add_argument("--rounds", type=int, default=5, help="rounds per path (default 5)")
    gateway.add_argument("--max-new-tokens", type=int, default=1)
    gateway.add_argument("--threads", type=int, default=None)
    gateway.add_argument("--gateway-process", action="store_true",
                         help="run the gateway as its own `kev gateway` process, as deployed, instead of in the "
                              "bench's event loop beside the worker and both clients")
    gateway.add_argument("--gateway-processes", type=positive_int("gateway processes"), default=1, metavar="N",
                         help="with --gateway-process: `kev gateway --processes N`, N event loops on one port "
                              "(default 1; implies --gateway-process); the CPU column sums them")
    gateway.add_argument("--worker-process", action="store_true",
                         help="run the worker as its own `kev serve` process, as deployed, so that the clients' "
                              "work in the bench's event loop does not delay the worker's")
    gateway.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    # The run imports the worker, the gateway and aiokafka: loaded for a run, not for `kev --help`.
    from kev_async.bench.gateway.run import bench_gateway
    from kev_async.gateway.server import has_uvloop

    model = bench_model(args)
    anyio.run(partial(bench_gateway, model, concurrency=args.concurrency, rounds=args.rounds,
                      max_new_tokens=args.max_new_tokens,
                      gateway_process=args.gateway_process or args.gateway_processes > 1,
                      gateway_processes=args.gateway_processes, worker_process=args.worker_process), backend="asyncio",
              backend_options={"use_uvloop": has_uvloop()})  # clients as lean as the gateway's own loop
    return 0
