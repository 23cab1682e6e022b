"""`kev route`: questions from kafka.intake_topic onto the questions topic's partition router.strategy picks
(consumers/route.py); SIGINT/SIGTERM stop fetching, wait for every re-publish's ack, commit, exit 0."""

from __future__ import annotations

import argparse
import sys
from functools import partial

import anyio
import msgspec

from kev_async.cli._shared import load_service_config
from schemas import EMBEDDED_BROKER
from schemas.routing import STRATEGIES


def register(subparsers: argparse._SubParsersAction) -> None:
    route = subparsers.add_parser(
        "route", help="route questions to partitions (workers) by router.strategy",
        description="Consume kafka.intake_topic (kev.questions.in) in group <kafka.group_id>.route and re-publish "
                    "each question unchanged to kafka.questions_topic on the partition router.strategy picks: "
                    "round_robin, length_aware (long prompts apart from short ones), prefix_hash (one system "
                    "prompt, one partition: its worker's prefix cache hits), semantic_hash (by meaning: an LSH of "
                    "the question's vector from core.model_path's embedding layer, whose table it loads), "
                    "consistent_hash (a tenant stays on one partition; adding partitions moves few tenants). "
                    "Offsets are committed after the re-publish is acked; undecodable events go to "
                    "kafka.dlq_topic. Needs a running broker.")
    route.add_argument("--config", default=None, help="a kev.yaml (default: built-in defaults + KEV_* env)")
    route.set_defaults(model=None)
    route.add_argument("--bootstrap-servers", default=None, help="HOST:PORT[,HOST:PORT] of a running broker")
    route.add_argument("--strategy", choices=STRATEGIES, default=None, help="overrides router.strategy")
    route.add_argument("--intake-topic", default=None, help="overrides kafka.intake_topic")
    route.set_defaults(func=_route)


def _route(args: argparse.Namespace) -> int:
    # The service's modules pull in aiokafka, structlog and (through kev_async.app) torch: imported when
    # the command runs, not for `kev --help`.
    from kev_async.runtime.lifecycle import run_service

    cfg = load_service_config(args, bootstrap_servers=args.bootstrap_servers, intake_topic=args.intake_topic)
    if cfg.kafka.bootstrap_servers == EMBEDDED_BROKER:
        print("kev route: needs a running broker (--bootstrap-servers or kafka.bootstrap_servers); "
              "it cannot share the broker another process embeds", file=sys.stderr)
        return 2
    if args.strategy:
        cfg = msgspec.structs.replace(cfg, router=msgspec.structs.replace(cfg.router, strategy=args.strategy))
    return anyio.run(partial(run_service, partial(run_route, cfg)), backend="asyncio")


async def run_route(cfg, shutdown, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
    """The route service until `shutdown` is requested; then it drains (acks in flight) and commits."""
    from consumers.route import RouteService
    from kev_async.app import consumer_options  # honours $KEV_KAFKA_SESSION_TIMEOUT_MS, as `kev serve` does

    semantic = await anyio.to_thread.run_sync(semantic_hash, cfg)
    service = RouteService(cfg.kafka, cfg.router.strategy, consumer_options=consumer_options(False),
                           semantic=semantic)
    async with anyio.create_task_group() as tg:
        await tg.start(service.run)
        task_status.started(service)
        await shutdown.requested.wait()
        service.stop()


def semantic_hash(cfg):
    """semantic_hash's partition function for `cfg` (its model's tokenizer and embedding table, about 0.4 s
    to read), or None for another strategy. The start is logged with a note that the system prompt's text
    hash is prefix_hash, for a config that meant that."""
    if cfg.router.strategy != "semantic_hash":
        return None
    import structlog

    from engine.routing_embedding import EmbeddingHash

    semantic = EmbeddingHash.from_source(cfg.core.model_path)
    structlog.get_logger("kev.route").info(
        "route.semantic_hash", model=cfg.core.model_path, vocabulary=semantic.table.shape[0], bits=semantic.bits,
        note="semantic_hash routes by the model's embedding layer; the system-prompt text hash is prefix_hash")
    return semantic
