"""Start the gateway: the Kafka producer, this instance's reply topic and its reader, the model catalog,
then uvicorn (httptools parser, with the connection limits of connections.py) serving the app on asyncio
(aiokafka is asyncio-only) — and stop it in reverse.

    running = await tg.start(partial(run_gateway, cfg, shutdown))    # shutdown.requested: an anyio.Event
    print(running.url)                                                # http://127.0.0.1:8000

On shutdown uvicorn stops accepting connections and gives requests in flight GRACEFUL_TIMEOUT_S to
finish; the reply topic is deleted on the way out (best effort).
"""

from __future__ import annotations

import importlib.util
import socket
import sys
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import structlog
import uvicorn
from aiokafka.errors import KafkaError
from anyio.abc import TaskStatus

from consumers import EMBEDDED
from consumers.kafka_client.clients import open_admin, open_producer
from kev_async.gateway.app import create_app
from kev_async.gateway.auth import Authenticator
from kev_async.gateway.batch_store import BatchStore
from kev_async.gateway.batches import Batches
from kev_async.gateway.callers import TenantSlots
from kev_async.gateway.catalog import ModelCatalog, served_model_name
from kev_async.gateway.connections import ConnectionLimits, limited_protocol
from kev_async.gateway.exposure import check_exposure
from kev_async.gateway.files import FileStore, blobs_for
from kev_async.gateway.metrics import GatewayMetrics
from kev_async.gateway.publisher import QuestionPublisher
from kev_async.gateway.replies import ReplyRouter
from kev_async.gateway.slot_table import SlotTable
from kev_async.gateway.state import Gateway
from kev_async.runtime.embedded_uvicorn import EmbeddedUvicorn
from kev_async.runtime.lifecycle import run_service
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


async def run_gateway(cfg: KevConfig, shutdown: Any, *, sock: socket.socket | None = None,
                      slot_table: SlotTable | None = None, runs_batches: bool = True,
                      task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
    """Serve until `shutdown.requested` is set (a kev_async Shutdown, or anything with that Event).

    `sock`: a listening socket to accept on (one of `kev gateway --processes N`); else it listens on
    gateway.host and gateway.port itself. `slot_table`: the tenants' slots shared by all those processes;
    else this process counts its own. `runs_batches`: whether this process asks the Batch API's lines (one
    process of a fleet does; every one serves the batch routes from the batch topic)."""
    kafka = cfg.kafka
    if kafka.bootstrap_servers == EMBEDDED:
        raise ValueError("the gateway needs a running broker: set kafka.bootstrap_servers (or --bootstrap-servers) "
                         "to the brokers the workers use; `kev demo --http` runs both on the embedded broker")
    auth = Authenticator.from_config(cfg.gateway)
    signer = check_exposure(cfg, keys_configured=auth.enabled)  # GatewayRefused: listen nowhere
    replies = ReplyRouter(kafka, reply_topic_name())
    timeout_ms = cfg.gateway.publish_timeout_ms
    try:
        async with open_producer(kafka, **QuestionPublisher.producer_options(timeout_ms)) as producer, \
                anyio.create_task_group() as tg:
            publisher = QuestionPublisher(kafka, timeout_ms, producer, signer)
            slots = TenantSlots(cfg.gateway.max_concurrent_per_tenant, slot_table)
            gateway = Gateway(cfg, publisher, replies, ModelCatalog(served_model_name(cfg)), auth, GatewayMetrics(),
                              slots)
            await tg.start(replies.run)
            await tg.start(gateway.catalog.follow, kafka)
            store = BatchStore(kafka, kafka.batches_topic, producer)
            gateway.batches = Batches(gateway, store, FileStore(blobs_for(cfg.gateway)),
                                      runs_batches=runs_batches and cfg.gateway.run_batches)
            await tg.start(store.run)
            await tg.start(gateway.batches.run)
            sock = sock or listen(cfg.gateway.host, cfg.gateway.port)
            url = socket_url(sock)
            log.info("gateway.ready", url=url, model=gateway.catalog.model, reply_topic=replies.topic,
                     auth="api_keys" if auth.enabled else "anonymous", sign_key=signer.key_id,
                     bootstrap_servers=kafka.bootstrap_servers)
            http_stopped = anyio.Event()
            limits = ConnectionLimits.of(cfg.gateway, gateway.metrics.refuse)
            tg.start_soon(_serve_http, create_app(gateway), sock, limits, shutdown, http_stopped)
            task_status.started(GatewayRunning(url, replies.topic, gateway.catalog.model))
            # uvicorn returns once shutdown is requested and its requests finished (or their grace ran out).
            await http_stopped.wait()
            tg.cancel_scope.cancel()  # the reply reader, the catalog and the batches
    finally:
        await _delete_topic(kafka, replies.topic)


def listen(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """Listen now, so a client arriving before uvicorn's loop starts waits instead of being refused.

    proto=IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on connections whose socket says
    TCP, and with Nagle on a response written in two parts waits for the client's delayed ACK, 40 ms.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:  # several listening sockets on one port (kev gateway --processes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


async def _serve_http(app, sock: socket.socket, limits: ConnectionLimits, shutdown: Any,
                      stopped: anyio.Event) -> None:
    """Serve `app` on `sock` with uvicorn until shutdown is requested, then set `stopped`."""
    # The httptools parser: per request it spends about half the CPU of hypercorn/h11, and at 64 concurrent
    # requests that CPU, serial in one event loop, is most of the latency the gateway adds. Its protocol,
    # with the limits that apply before the app (connections.py); no WebSocket upgrades: nothing serves them.
    config = uvicorn.Config(app, http=limited_protocol(limits), ws="none", lifespan="off", access_log=False,
                            log_config=None, log_level="warning", timeout_graceful_shutdown=GRACEFUL_TIMEOUT_S,
                            backlog=BACKLOG,
                            proxy_headers=False)  # X-Forwarded-For is never read: the client's address is unused
    server = EmbeddedUvicorn(config)

    async def exit_on_shutdown() -> None:
        await shutdown.requested.wait()
        server.should_exit = True  # uvicorn polls this every 0.1 s

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(exit_on_shutdown)
            await server.serve(sockets=[sock])
            tg.cancel_scope.cancel()
    finally:
        stopped.set()


def socket_url(sock: socket.socket) -> str:
    """http://host:port of a listening socket; a wildcard address is reached through the loopback."""
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _delete_topic(kafka: KafkaConfig, topic: str) -> None:
    """Each gateway start makes a reply topic; leave none behind (best effort, bounded)."""
    with anyio.move_on_after(3.0, shield=True):
        try:
            async with open_admin(kafka) as admin:
                await admin.delete_topics([topic], timeout_ms=2000)
        except KafkaError as error:
            log.warning("gateway.reply_topic_not_deleted", topic=topic, error=repr(error))


def run_until_stopped(serve, drain_deadline: float, who: str) -> int:
    """`serve(shutdown, task_status=...)` under run_service on asyncio (uvloop where installed) until it
    stops. Brokers it cannot reach or a port it cannot listen on end it with one line on stderr, naming
    `who`, and exit code 1; anything else keeps its traceback."""
    try:
        return anyio.run(partial(run_service, serve, drain_deadline=drain_deadline), backend="asyncio",
                         backend_options={"use_uvloop": has_uvloop()})
    except ExceptionGroup as group:
        why = _startup_failure(group)
        if why is None:
            raise
        print(f"{who}: {why}", file=sys.stderr)
        return 1


def _startup_failure(group: BaseExceptionGroup) -> str | None:
    """One line for an operator when the gateway stopped on brokers it cannot reach or a port it cannot
    listen on (what run_service's task group raised); None for anything else, which keeps its traceback."""
    failures, rest = group.split((KafkaError, OSError))
    if failures is None or rest is not None:
        return None
    error = failures.exceptions[0]
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    if isinstance(error, KafkaError):
        return f"cannot reach the brokers ({error}); start them, or check kafka.bootstrap_servers"
    return f"cannot listen ({error}); choose another gateway.port or stop what holds it"


def has_uvloop() -> bool:
    """uvloop's event loop takes ~30% less CPU per request than asyncio's; without it (not on Windows) the
    gateway runs on plain asyncio."""
    return importlib.util.find_spec("uvloop") is not None
