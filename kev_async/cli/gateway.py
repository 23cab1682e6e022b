"""`kev gateway`: the OpenAI-compatible HTTP API in front of Kafka (kev_async/gateway/)."""

from __future__ import annotations

import argparse
import sys
from functools import partial

import anyio
import msgspec

EMBEDDED = "embedded"  # consumers.EMBEDDED, without importing aiokafka for `kev --help`

DESCRIPTION = """\
Serve OpenAI's HTTP API (POST /v1/chat/completions, POST /v1/completions, GET /v1/models, plus
GET /health and GET /metrics) in front of Kev's Kafka topics. Each request becomes a question on
kafka.questions_topic whose answer (and streaming deltas) comes back on this gateway's own reply
topic, kev.replies.<instance>, created at start and deleted at stop. `kev serve` workers on the same
brokers answer; run as many gateways as you like.

Any OpenAI client works:  OpenAI(base_url="http://HOST:PORT/v1", api_key=KEY)
A request's `model` is the served model (gateway.served_model_name) or a LoRA adapter loaded through
kev.control. API keys (gateway.api_keys or gateway.api_keys_file) map to tenants; with none
configured the gateway is open. A client that disconnects, or a deadline that passes, cancels its
question on kev.control so the worker frees its KV blocks. SIGINT/SIGTERM: stop accepting, let
requests in flight finish (5 s), exit 0."""


def register(subparsers: argparse._SubParsersAction) -> None:
    gateway = subparsers.add_parser("gateway", help="the OpenAI-compatible HTTP API in front of Kafka",
                                    description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    gateway.add_argument("--config", default=None, help="a kev.yaml (default: built-in defaults + KEV_* env)")
    gateway.add_argument("--bootstrap-servers", default=None,
                         help="HOST:PORT[,HOST:PORT] of the brokers the workers use (kafka.bootstrap_servers)")
    gateway.add_argument("--host", default=None, help="address to listen on (gateway.host, default 127.0.0.1)")
    gateway.add_argument("--port", type=int, default=None, help="port to listen on (gateway.port, default 8000)")
    gateway.set_defaults(func=_gateway)


def _gateway(args: argparse.Namespace) -> int:
    from kev_async.gateway.server import has_uvloop, run_gateway
    from kev_async.logs import configure_logging
    from kev_async.runtime.lifecycle import run_service
    from kev_async.settings import load_config
    from schemas import ConfigError

    try:
        cfg = load_config(args.config)
    except ConfigError as error:
        error.source = error.source or args.config
        print("\n".join(error.lines()), file=sys.stderr)
        return 2
    if args.bootstrap_servers:
        cfg = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, bootstrap_servers=args.bootstrap_servers))
    listen = {key: value for key, value in (("host", args.host), ("port", args.port)) if value is not None}
    if listen:
        cfg = msgspec.structs.replace(cfg, gateway=msgspec.structs.replace(cfg.gateway, **listen))
    if cfg.kafka.bootstrap_servers == EMBEDDED:
        print("kev gateway: give the brokers the workers use (--bootstrap-servers or kafka.bootstrap_servers); "
              "`kev demo --http` runs a worker and the gateway together on the embedded broker", file=sys.stderr)
        return 2
    configure_logging(cfg.logging.level, cfg.logging.json)
    return anyio.run(partial(run_service, partial(run_gateway, cfg), drain_deadline=10.0), backend="asyncio",
                     backend_options={"use_uvloop": has_uvloop()})
