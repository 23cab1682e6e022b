"""`kev gateway`: the OpenAI-compatible HTTP API in front of Kafka (kev_async/gateway/)."""

from __future__ import annotations

import argparse
import sys
from functools import partial

import msgspec

from kev_async.settings import load_config
from schemas import DEFAULT_CONFIG, EMBEDDED_BROKER, ConfigError


DESCRIPTION = """\
Serve OpenAI's HTTP API (POST /v1/chat/completions, POST /v1/completions, GET /v1/models, plus
GET /health and GET /metrics), and Kev's POST /v1/query (several questions in one call, one result
each, gateway.max_queries_per_request at most), in front of Kev's Kafka topics. Each request becomes a question on
kafka.questions_topic whose answer (and streaming deltas) comes back on this gateway's own reply
topic, kev.replies.<instance>, created at start and deleted at stop. `kev serve` workers on the same
brokers answer; run as many gateways as you like.

Any OpenAI client works:  OpenAI(base_url="http://HOST:PORT/v1", api_key=KEY)
A request's `model` is the served model (gateway.served_model_name) or a LoRA adapter loaded through
kev.control. API keys (gateway.api_keys or gateway.api_keys_file) map to tenants. Without keys the
gateway listens on the loopback only, unless --allow-anonymous (gateway.allow_anonymous) is given;
every anonymous request then gets a prefix cache of its own. It signs what it publishes with a
kafka.trust key the workers share (they honour a reply topic or tenant only when signed), and refuses
to start without one.
Each tenant may have gateway.max_concurrent_per_tenant requests in flight (more: 429, Retry-After);
the x-kev-audit header goes only to gateway.audit_tenants. A client that disconnects, a deadline
that passes, or a publish the broker does not ack in time cancels its question on kev.control so
the worker frees its KV blocks. SIGINT/SIGTERM: stop accepting, let requests in flight finish
(5 s), exit 0.

--processes N (gateway.processes) runs N such gateways on the one port, each with its own event loop,
producer and reply topic: at high concurrency a request waits for its loop's work on the requests
ahead of it, so more processes cut that wait where cores are free. /metrics then describes the
process that accepted the connection."""


def register(subparsers: argparse._SubParsersAction) -> None:
    gateway = subparsers.add_parser("gateway", help="the OpenAI-compatible HTTP API in front of Kafka",
                                    description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    gateway.add_argument("--config", default=None, help="a kev.yaml (default: built-in defaults + KEV_* env)")
    gateway.add_argument("--bootstrap-servers", default=None,
                         help="HOST:PORT[,HOST:PORT] of the brokers the workers use (kafka.bootstrap_servers)")
    gateway.add_argument("--host", default=None,
                         help=f"address to listen on (gateway.host, default {DEFAULT_CONFIG.gateway.host})")
    gateway.add_argument("--port", type=int, default=None,
                         help=f"port to listen on (gateway.port, default {DEFAULT_CONFIG.gateway.port})")
    gateway.add_argument("--processes", type=int, default=None,
                         help="gateway processes sharing the port (gateway.processes, "
                              f"default {DEFAULT_CONFIG.gateway.processes})")
    gateway.add_argument("--allow-anonymous", action="store_true", default=None,
                         help="serve callers without an API key beyond the loopback (gateway.allow_anonymous)")
    gateway.set_defaults(func=_gateway)


def _gateway(args: argparse.Namespace) -> int:
    # aiokafka, starlette and uvicorn load when the gateway runs, not for `kev --help` (it imports every command)
    from kev_async.gateway.processes import CHILD_DRAIN_S, PARENT_DRAIN_S, ChildExited, run_gateway_processes
    from kev_async.gateway.server import run_gateway, run_until_stopped

    try:
        cfg = load_config(args.config)
    except ConfigError as error:
        error.source = error.source or args.config
        print("\n".join(error.lines()), file=sys.stderr)
        return 2
    if args.bootstrap_servers:
        cfg = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, bootstrap_servers=args.bootstrap_servers))
    given = {key: value for key, value in (("host", args.host), ("port", args.port), ("processes", args.processes),
                                           ("allow_anonymous", args.allow_anonymous)) if value is not None}
    if given:
        try:
            gateway = msgspec.convert(msgspec.to_builtins(msgspec.structs.replace(cfg.gateway, **given)),
                                      type(cfg.gateway))  # checked as kev.yaml's values are
        except msgspec.ValidationError as error:
            print(f"kev gateway: {str(error).replace('`$', '`gateway')}", file=sys.stderr)
            return 2
        cfg = msgspec.structs.replace(cfg, gateway=gateway)
    if cfg.kafka.bootstrap_servers == EMBEDDED_BROKER:
        print("kev gateway: give the brokers the workers use (--bootstrap-servers or kafka.bootstrap_servers); "
              "`kev demo --http` runs a worker and the gateway together on the embedded broker", file=sys.stderr)
        return 2
    refused = _refusal(cfg)
    if refused:
        print(f"kev gateway: {refused}", file=sys.stderr)
        return 2
    if problem := _start_problem(cfg):
        print(f"kev gateway: {problem}", file=sys.stderr)
        return 1
    from kev_async.logs import configure_logging  # structlog and rich: not loaded for `kev --help`
    configure_logging(cfg.logging.level, cfg.logging.json)
    if cfg.gateway.processes == 1:
        serve, drain_deadline = run_gateway, CHILD_DRAIN_S
    else:
        serve, drain_deadline = run_gateway_processes, PARENT_DRAIN_S
    try:
        return run_until_stopped(partial(serve, cfg), drain_deadline, "kev gateway")
    except ExceptionGroup as group:  # run_service's task group wraps what the processes' parent raised
        exited, rest = group.split(ChildExited)
        if rest is not None or exited is None:
            raise
        print(f"kev gateway: {'; '.join(str(error) for error in exited.exceptions)}", file=sys.stderr)
        return 1


def _start_problem(cfg) -> str | None:
    """The port taken or no broker answering, said before anything starts (kev_async/cli/preflight.py)."""
    from kev_async.cli.preflight import broker_problem, port_problem

    return (port_problem(cfg.gateway.host, cfg.gateway.port, "the gateway",
                         "choose another --port / gateway.port (0: any free port)")
            or broker_problem(cfg.kafka.bootstrap_servers))


def _refusal(cfg) -> str | None:
    """Why this config must not serve (unreadable API keys, exposed without keys, unsigned with tenants)."""
    # starlette (the gateway's errors) loads only when the gateway runs, not for `kev --help`
    from kev_async.gateway.auth import Authenticator
    from kev_async.gateway.exposure import GatewayRefused, check_exposure

    try:
        check_exposure(cfg, keys_configured=Authenticator.from_config(cfg.gateway).enabled)
    except (GatewayRefused, ValueError) as error:
        return str(error)
    return None
