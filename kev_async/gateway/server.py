"""Start the gateway: the Kafka producer, this instance's reply topic and its reader, the model catalog,
then hypercorn serving the app on asyncio (aiokafka is asyncio-only) — and stop it in reverse.

    running = await tg.start(partial(run_gateway, cfg, shutdown))    # shutdown.requested: an anyio.Event
    print(running.url)                                                # http://127.0.0.1:8000

On shutdown hypercorn stops accepting connections and gives requests in flight
`gateway.graceful_timeout_s` to finish; the reply topic is deleted on the way out (best effort).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import anyio
import structlog
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from anyio.abc import TaskStatus
from hypercorn.asyncio.run import worker_serve
from hypercorn.config import Config as HypercornConfig
from hypercorn.utils import wrap_app

from consumers import EMBEDDED
from consumers.security import client_options
from kev_async.gateway.app import Gateway, create_app
from kev_async.gateway.auth import Authenticator
from kev_async.gateway.catalog import ModelCatalog, served_model_name
from kev_async.gateway.metrics import GatewayMetrics
from kev_async.gateway.publisher import QuestionPublisher
from kev_async.gateway.replies import ReplyRouter
from schemas import KafkaConfig, KevConfig

log = structlog.get_logger("kev.gateway.server")

GRACEFUL_TIMEOUT_S = 5.0
BACKLOG = 2048  # a burst of clients must not overflow the accept queue (each overflow costs a 1 s SYN retry)


@dataclass(frozen=True)
class GatewayRunning:
    url: str  # http://host:port, the base of /v1
    reply_topic: str
    model: str


def reply_topic_name(instance: str | None = None) -> str:
    return f"kev.replies.{instance or uuid.uuid4().hex[:12]}"


async def run_gateway(cfg: KevConfig, shutdown: Any, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
    """Serve until `shutdown.requested` is set (a kev_async Shutdown, or anything with that Event)."""
    kafka = cfg.kafka
    if kafka.bootstrap_servers == EMBEDDED:
        raise ValueError("the gateway needs a running broker: set kafka.bootstrap_servers (or --bootstrap-servers) "
                         "to the brokers the workers use; `kev demo --http` runs both on the embedded broker")
    auth = Authenticator.from_config(cfg.gateway)
    publisher = QuestionPublisher(kafka, cfg.gateway.publish_timeout_ms)
    replies = ReplyRouter(kafka, reply_topic_name())
    gateway = Gateway(cfg, publisher, replies, ModelCatalog(served_model_name(cfg)), auth, GatewayMetrics())
    await publisher.start()
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(replies.run)
            await tg.start(gateway.catalog.follow, kafka)
            hyper = _hypercorn_config(cfg.gateway.host, cfg.gateway.port)
            sockets = hyper.create_sockets()
            for sock in sockets.insecure_sockets:
                sock.listen(BACKLOG)  # now, so a client arriving before hypercorn's loop starts waits, not refused
            host, port = sockets.insecure_sockets[0].getsockname()[:2]
            url = f"http://{_url_host(host)}:{port}"
            log.info("gateway.ready", url=url, model=gateway.catalog.model, reply_topic=replies.topic,
                     auth="api_keys" if auth.enabled else "off", bootstrap_servers=kafka.bootstrap_servers)
            http_stopped = anyio.Event()
            tg.start_soon(_serve_http, create_app(gateway), hyper, sockets, shutdown, http_stopped)
            task_status.started(GatewayRunning(url, replies.topic, gateway.catalog.model))
            # hypercorn returns once shutdown is requested and its requests finished (or their grace ran out).
            await http_stopped.wait()
            tg.cancel_scope.cancel()  # the reply reader and the catalog
    finally:
        await publisher.stop()
        await _delete_topic(kafka, replies.topic)


async def _serve_http(app, hyper: HypercornConfig, sockets, shutdown: Any, stopped: anyio.Event) -> None:
    """hypercorn in a task of its own: its asyncio TaskGroup and its lifespan task's cancel must not touch
    the bookkeeping of the task that owns the gateway's task group."""
    try:
        await worker_serve(wrap_app(app, hyper.wsgi_max_body_size, "asgi"), hyper, sockets=sockets,
                           shutdown_trigger=shutdown.requested.wait)
    except asyncio.CancelledError:
        # On a graceful stop hypercorn cancels its lifespan task and awaits it, which can re-raise that
        # task's CancelledError here. Only a cancel aimed at this task (cancelling() > 0) is ours to pass on.
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise
    finally:
        stopped.set()


def _hypercorn_config(host: str, port: int) -> HypercornConfig:
    hyper = HypercornConfig()
    hyper.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    hyper.backlog = BACKLOG
    hyper.graceful_timeout = GRACEFUL_TIMEOUT_S
    hyper.accesslog = None
    hyper.loglevel = "WARNING"
    return hyper


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


async def _delete_topic(kafka: KafkaConfig, topic: str) -> None:
    """Each gateway start makes a reply topic; leave none behind (best effort, bounded)."""
    with anyio.move_on_after(3.0, shield=True):
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers, **client_options(kafka.security))
        try:
            await admin.start()
            await admin.delete_topics([topic], timeout_ms=2000)
        except KafkaError as error:
            log.warning("gateway.reply_topic_not_deleted", topic=topic, error=repr(error))
        finally:
            await admin.close()
