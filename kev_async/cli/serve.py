"""`kev serve`: the Kafka service (kev_async/app.py), stopped gracefully on SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import sys
from functools import partial

import anyio
import msgspec

from kev_async.cli._shared import add_config_and_model, load_service_config
from schemas import DEFAULT_CONFIG, EMBEDDED_BROKER


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve", help="answer questions from Kafka (the service)",
        description="Consume questions from kafka.questions_topic in consumer group kafka.group_id, answer "
                    "them in packed forwards, publish answers to kafka.answers_topic and commit offsets after "
                    "the broker acks each outcome. bootstrap_servers 'embedded' (the default) starts the "
                    "bundled Tansu broker on a free loopback port. SIGINT/SIGTERM: stop intake, drain, commit, "
                    "exit 0; a second signal exits at once. If the Kafka loop dies (an answer that cannot be published "
                    "after kafka.publish_retry_ms of retries, a refused answers topic), it logs kev.kafka_failed and "
                    "exits 1, to be restarted; what it had not committed is redelivered. "
                    "Runs on anyio's asyncio backend (aiokafka). "
                    "deploy.mode multi: start deploy.workers such workers on this host (one per GPU, or a share "
                    "of the cores each) and restart any that crash. "
                    "--port N: also serve the HTTP API in this process, beside the worker: OpenAI's routes and "
                    "POST /v1/query (docs/gateway.md), as `kev gateway` serves them, under the config's gateway.* "
                    "keys; its questions go through Kafka like any other. Without kafka.trust keys the worker and "
                    "the gateway share a key made for this run.")
    add_config_and_model(serve)
    serve.add_argument("--bootstrap-servers", default=None, help="HOST:PORT[,HOST:PORT] or 'embedded'")
    serve.add_argument("--drain-deadline", type=float, default=30.0, help="seconds to finish in-flight work on stop")
    serve.add_argument("--port", type=int, default=None,
                       help="also serve the HTTP API on this port (overrides gateway.port; 0 = any free port); "
                            "without it, no HTTP API")
    serve.add_argument("--host", default=None, help="with --port: the address the HTTP API listens on (overrides "
                                                    f"gateway.host, default {DEFAULT_CONFIG.gateway.host})")
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    # The service's modules pull in torch (the engine), aiokafka and structlog: imported when the command
    # runs, not for `kev --help`.
    from kev_async.app import serve
    from kev_async.kafka_loop import EXIT_KAFKA_FAILED, KafkaLoopFailed
    from kev_async.runtime.lifecycle import run_service
    from schemas.signing import TrustKeyError

    cfg = load_service_config(args, check_model=True, bootstrap_servers=args.bootstrap_servers)
    if (refused := _http_refusal(cfg, args)) is not None:
        print(f"kev serve: {refused}", file=sys.stderr)
        return 2
    if (problem := _start_problem(cfg)) is not None:
        print(f"kev serve: {problem}", file=sys.stderr)
        return 1
    if cfg.deploy.mode == "multi":
        return _serve_multi(cfg, args)
    service = partial(serve, cfg)
    if args.port is not None:
        from kev_async.gateway.server import listen

        cfg = _with_http(cfg, args)
        try:  # before the model loads: a port taken should not cost its seconds
            sock = listen(cfg.gateway.host, cfg.gateway.port)
        except OSError as error:
            print(f"kev serve: cannot listen ({error}); choose another --port or stop what holds it", file=sys.stderr)
            return 1
        service = partial(_serve_with_http, cfg, sock)
    try:
        return anyio.run(partial(run_service, service, drain_deadline=args.drain_deadline), backend="asyncio")
    except BaseExceptionGroup as group:  # task groups wrap what serve raises
        refused, rest = group.split(TrustKeyError)  # a start refused for its keys (a rotation half done): one line
        if refused is not None and rest is None:
            while isinstance(refused, BaseExceptionGroup):
                refused = refused.exceptions[0]
            print(f"kev serve: {refused}", file=sys.stderr)
            return 2
        failed, rest = group.split(KafkaLoopFailed)
        if failed is None or rest is not None:
            raise
        return EXIT_KAFKA_FAILED  # kev.kafka_failed has said why, in one line
    except KafkaLoopFailed:
        return EXIT_KAFKA_FAILED


def _start_problem(cfg) -> str | None:
    """A port or a broker that will fail the start, found before the model loads (kev_async/cli/preflight.py)."""
    from kev_async.cli.preflight import broker_problem, port_problem

    if cfg.deploy.mode != "multi":  # multi: each worker serves its metrics on port + i
        taken = port_problem(cfg.metrics.host, cfg.metrics.port, "the metrics endpoint",
                             "set metrics.port (KEV_METRICS__PORT) to a free port, or 0 for no metrics")
        if taken:
            return taken
    if cfg.kafka.bootstrap_servers == EMBEDDED_BROKER:
        return port_problem("127.0.0.1", cfg.broker.port, "the embedded broker",
                            "set broker.port (KEV_BROKER__PORT) to a free port, or 0 for any")
    return broker_problem(cfg.kafka.bootstrap_servers)


def _serve_multi(cfg, args: argparse.Namespace) -> int:
    """deploy.mode multi: this process supervises deploy.workers `kev serve` children (kev_async/deploy.py)."""
    from kev_async.deploy import CrashLoop, run_multi
    from kev_async.runtime.lifecycle import run_service

    serve_args = [*(["--config", args.config] if args.config else []), *(["--model", args.model] if args.model else [])]
    multi = partial(run_multi, cfg, serve_args=serve_args, drain_deadline=args.drain_deadline)
    try:
        # The children drain within their own deadline; the parent waits for them a little longer.
        return anyio.run(partial(run_service, multi, drain_deadline=args.drain_deadline + 15), backend="asyncio")
    except BaseExceptionGroup as group:  # task groups wrap what run_multi raises
        crashed, rest = group.split(CrashLoop)
        if crashed is None or rest is not None:
            raise
        while isinstance(crashed, BaseExceptionGroup):
            crashed = crashed.exceptions[0]
        print(f"kev serve: {crashed}", file=sys.stderr)
        return 1


def _with_http(cfg, args: argparse.Namespace):
    """cfg with --host/--port over gateway.*, and a session trust key where none is configured (the worker
    must know the key the gateway signs with)."""
    from kev_async.gateway.exposure import with_session_trust_key

    given = {key: value for key, value in (("host", args.host), ("port", args.port)) if value is not None}
    gateway = msgspec.convert(msgspec.to_builtins(msgspec.structs.replace(cfg.gateway, **given)),
                              type(cfg.gateway))  # checked as kev.yaml's values are
    return with_session_trust_key(msgspec.structs.replace(cfg, gateway=gateway))


def _http_refusal(cfg, args: argparse.Namespace) -> str | None:
    """Why --host/--port cannot serve as asked: None when they were not given or can."""
    if args.port is None:
        return "--host needs --port (the HTTP API's port)" if args.host is not None else None
    if cfg.deploy.mode == "multi":
        return ("--port serves the HTTP API beside one worker; with deploy.mode multi run `kev gateway` beside the "
                "workers instead")
    # starlette (the gateway's errors) loads for --port only, not for `kev --help`
    from kev_async.gateway.auth import Authenticator
    from kev_async.gateway.exposure import GatewayRefused, check_exposure

    try:
        cfg = _with_http(cfg, args)
        check_exposure(cfg, keys_configured=Authenticator.from_config(cfg.gateway).enabled)
    except msgspec.ValidationError as error:
        return f"{str(error).replace('`$', '`gateway')} (--host / --port)"
    except (GatewayRefused, ValueError) as error:
        return str(error)
    return None


async def _serve_with_http(cfg, sock, shutdown, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
    """The worker, then the gateway on `sock` in front of the worker's brokers (the embedded one included),
    until shutdown: the gateway stops taking requests while the worker drains."""
    from kev_async.app import serve
    from kev_async.gateway.server import run_gateway

    async with anyio.create_task_group() as tg:
        running = await tg.start(partial(serve, cfg, shutdown))
        brokers = msgspec.structs.replace(cfg.kafka, bootstrap_servers=running.bootstrap_servers)
        await tg.start(partial(run_gateway, msgspec.structs.replace(cfg, kafka=brokers), shutdown, sock=sock))
        task_status.started(running)
