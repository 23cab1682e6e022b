"""`kev serve` and `kev demo`: the Kafka service, and the whole path on embedded defaults."""

from __future__ import annotations

import argparse
import sys
from functools import partial

import anyio
import msgspec


def add_serve(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve", help="answer questions from Kafka (the service)",
        description="Consume questions from kafka.questions_topic in consumer group kafka.group_id, answer "
                    "them in packed forwards, publish answers to kafka.answers_topic and commit offsets after "
                    "the broker acks each outcome. bootstrap_servers 'embedded' (the default) starts the "
                    "bundled Tansu broker on a free loopback port. SIGINT/SIGTERM: stop intake, drain, commit, "
                    "exit 0; a second signal exits at once. Runs on anyio's asyncio backend (aiokafka).")
    _common(serve)
    serve.add_argument("--bootstrap-servers", default=None, help="HOST:PORT[,HOST:PORT] or 'embedded'")
    serve.add_argument("--drain-deadline", type=float, default=30.0, help="seconds to finish in-flight work on stop")
    serve.set_defaults(func=_serve)


def add_demo(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo", help="the whole path on embedded defaults: broker, worker, questions, answers",
        description="Start the embedded broker and a worker, publish mixed questions plus two bad events, "
                    "print every answer as it arrives on the answers topic, then stop gracefully.")
    _common(demo)
    demo.add_argument("--questions", type=int, default=32, help="how many questions to publish (default 32)")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.set_defaults(func=_demo)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="a kev.yaml (default: built-in defaults + KEV_* env)")
    parser.add_argument("--model", default=None, help="HF directory, .gguf or built-in name (core.model_path)")


def _load(args: argparse.Namespace, **kafka):
    from kev_async.ask import set_threads
    from kev_async.logs import configure_logging
    from kev_async.settings import load_config

    cfg = load_config(args.config)
    if args.model:
        cfg = msgspec.structs.replace(cfg, core=msgspec.structs.replace(cfg.core, model_path=args.model))
    kafka = {k: v for k, v in kafka.items() if v}
    if kafka:
        cfg = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, **kafka))
    configure_logging(cfg.logging.level, cfg.logging.json)
    set_threads(cfg.core.threads)
    return cfg


def _serve(args: argparse.Namespace) -> int:
    from kev_async.app import serve
    from kev_async.lifecycle import run_service

    cfg = _load(args, bootstrap_servers=args.bootstrap_servers)
    return anyio.run(partial(run_service, partial(serve, cfg), drain_deadline=args.drain_deadline),
                     backend="asyncio")


def _demo(args: argparse.Namespace) -> int:
    from kev_async.demo import run_demo
    from kev_async.lifecycle import run_service

    cfg = _load(args)
    if cfg.kafka.bootstrap_servers != "embedded":
        print("kev demo: runs on the embedded broker only (kafka.bootstrap_servers: embedded)", file=sys.stderr)
        return 2
    # The demo is one short-lived process: no metrics endpoint, so it never clashes with a running worker.
    cfg = msgspec.structs.replace(cfg, metrics=msgspec.structs.replace(cfg.metrics, port=0))
    demo = partial(run_demo, cfg, num_questions=args.questions, max_new_tokens=args.max_new_tokens)
    return anyio.run(partial(run_service, demo), backend="asyncio")
