"""`kev demo`: the whole path on embedded defaults (broker, worker, questions, answers); kev_async/demo.py."""

from __future__ import annotations

import argparse
import socket
import sys
from functools import partial

import anyio
import msgspec

from kev_async.cli._shared import add_config_and_model, load_service_config
from kev_async.gateway.exposure import GatewayRefused, check_exposure, with_session_trust_key
from schemas import DEFAULT_CONFIG, EMBEDDED_BROKER, MetricsConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo", help="the whole path on embedded defaults: broker, worker, questions, answers",
        description="Start the embedded broker and a worker, publish mixed questions plus two bad events, "
                    "print every answer as it arrives on the answers topic, then stop gracefully. With --http, "
                    "then start the OpenAI-compatible gateway too, print a curl line that works, and serve "
                    "until Ctrl-C.")
    add_config_and_model(demo)
    demo.add_argument("--questions", type=int, default=32, help="how many questions to publish (default 32)")
    demo.add_argument("--max-new-tokens", type=int, default=64, help="at most this many tokens per answer (default 64)")
    demo.add_argument("--http", action="store_true", help="also start `kev gateway` and keep serving until Ctrl-C")
    demo.add_argument("--port", type=int, default=None, help="the gateway's port with --http (default gateway.port, "
                                                             f"{DEFAULT_CONFIG.gateway.port}; 0 = any free port)")
    demo.add_argument("-v", "--verbose", action="store_true",
                      help="the worker's log lines on stderr at logging.level (default: warnings only, so the "
                           "terminal shows the answers)")
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    # The demo and the service runner import the engine (torch), aiokafka and structlog: not for `kev --help`.
    from kev_async.demo import run_demo
    from kev_async.runtime.lifecycle import run_service

    cfg = load_service_config(args)
    if not args.verbose and cfg.logging.level in ("debug", "info"):
        from kev_async.logs import configure_logging

        configure_logging("warning", cfg.logging.json)
    if cfg.kafka.bootstrap_servers != EMBEDDED_BROKER:
        print("kev demo: runs on the embedded broker only (kafka.bootstrap_servers: embedded)", file=sys.stderr)
        return 2
    # The worker serves its metrics as `kev serve`'s does, for `kev top`; a running worker may hold the port.
    cfg = msgspec.structs.replace(cfg, metrics=msgspec.structs.replace(cfg.metrics, port=_metrics_port(cfg.metrics)))
    if args.port is not None:
        cfg = msgspec.structs.replace(cfg, gateway=msgspec.structs.replace(cfg.gateway, port=args.port))
    if args.http and (refused := _gateway_refusal(cfg)):
        print(f"kev demo: {refused}", file=sys.stderr)
        return 2
    if args.http and (taken := _port_taken(cfg)):
        print(f"kev demo: {taken}", file=sys.stderr)
        return 1
    demo = partial(run_demo, cfg, num_questions=args.questions, max_new_tokens=args.max_new_tokens, http=args.http)
    return anyio.run(partial(run_service, demo), backend="asyncio")


def _metrics_port(metrics: MetricsConfig) -> int:
    """metrics.port where it is free, else a port the system has free; 0 stays 0 (metrics off)."""
    if not metrics.port:
        return 0
    with socket.socket(socket.AF_INET6 if ":" in metrics.host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the endpoint's own listener
        try:
            probe.bind((metrics.host, metrics.port))
        except OSError:
            probe.bind((metrics.host, 0))
        return probe.getsockname()[1]


def _port_taken(cfg) -> str | None:
    from kev_async.cli.preflight import port_problem

    return port_problem(cfg.gateway.host, cfg.gateway.port, "the gateway", "choose another --port (0: any free port)")


def _gateway_refusal(cfg) -> str | None:
    """Why the demo's gateway must not serve as configured (listening beyond the loopback without keys)."""
    # starlette: loaded for `kev demo --http`, not for `kev --help`
    from kev_async.gateway.auth import Authenticator

    try:
        check_exposure(with_session_trust_key(cfg), keys_configured=Authenticator.from_config(cfg.gateway).enabled)
    except (GatewayRefused, ValueError) as error:
        return str(error)
    return None
