"""`kev serve`: the Kafka service (kev_async/app.py), stopped gracefully on SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import sys
from functools import partial

import anyio

from kev_async.cli._shared import add_config_and_model, load_service_config


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
                    "of the cores each) and restart any that crash.")
    add_config_and_model(serve)
    serve.add_argument("--bootstrap-servers", default=None, help="HOST:PORT[,HOST:PORT] or 'embedded'")
    serve.add_argument("--drain-deadline", type=float, default=30.0, help="seconds to finish in-flight work on stop")
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    # The service's modules pull in torch (the engine), aiokafka and structlog: imported when the command
    # runs, not for `kev --help`.
    from kev_async.app import serve
    from kev_async.kafka_loop import EXIT_KAFKA_FAILED, KafkaLoopFailed
    from kev_async.runtime.lifecycle import run_service
    from schemas.signing import TrustKeyError

    cfg = load_service_config(args, check_model=True, bootstrap_servers=args.bootstrap_servers)
    if cfg.deploy.mode == "multi":
        return _serve_multi(cfg, args)
    try:
        return anyio.run(partial(run_service, partial(serve, cfg), drain_deadline=args.drain_deadline),
                         backend="asyncio")
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
