"""A worker's metrics endpoint: an ASGI app answering GET /metrics (Prometheus text) and GET /health (a
liveness probe), served by uvicorn on the worker's own asyncio loop while a block runs.

    async with serve_metrics(MetricsRoutes(scrape, healthy), port, host) as bound:
        ...                                 # GET http://HOST:BOUND/metrics, GET /health

HEAD is answered as GET without the body; any other method is a 405, any other path a 404. /health says
healthy or not and nothing more: 200 {"status":"ok"} or 503 {"status":"unhealthy"}.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import structlog
import uvicorn
from anyio.abc import SocketAttribute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kev_async.runtime.embedded_uvicorn import EmbeddedUvicorn

log = structlog.get_logger("kev.metrics")

TEXT = "text/plain; charset=utf-8"
STOP_GRACE_S = 1.0  # a scrape still running when the block ends gets this long to finish


class MetricsRoutes:
    """ASGI: GET or HEAD /metrics and /health. `scrape()` is the exposition text; `healthy()` the probe."""

    def __init__(self, scrape: Callable[[], Awaitable[bytes]], healthy: Callable[[], bool]) -> None:
        self.scrape, self.healthy = scrape, healthy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.respond(scope["method"], scope["path"])
        await response(scope, receive, send)

    async def respond(self, method: str, path: str) -> Response:
        if method not in ("GET", "HEAD"):
            return Response(b"GET /metrics only\n", 405, {"Allow": "GET, HEAD"}, TEXT)
        if path == "/health":
            ok = self.healthy()
            body = b'{"status":"ok"}' if ok else b'{"status":"unhealthy"}'
            return Response(body, 200 if ok else 503, media_type="application/json")
        if path != "/metrics":
            return Response(b"metrics are at /metrics\n", 404, media_type=TEXT)
        return Response(await self.scrape(), media_type=CONTENT_TYPE_LATEST)


@asynccontextmanager
async def serve_metrics(app: MetricsRoutes, port: int, host: str) -> AsyncIterator[int]:
    """Serve `app` on host:port (every address family `host` resolves to) while the block runs; yields the
    port. A port that cannot be bound is an OSError naming metrics.port, raised before the block runs."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError("the metrics endpoint runs on asyncio (uvicorn), as `kev serve` does") from None
    try:
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    except OSError as error:
        raise OSError(error.errno, f"cannot serve metrics on {host}:{port}: {error.strerror} "
                                   "(set metrics.port to a free port, or 0 to turn metrics off)") from None
    server = EmbeddedUvicorn(uvicorn.Config(
        app, lifespan="off", ws="none", access_log=False, log_config=None, log_level="warning",
        server_header=False, date_header=False, proxy_headers=False, timeout_graceful_shutdown=STOP_GRACE_S))
    sockets = [socket_listener.extra(SocketAttribute.raw_socket) for socket_listener in listener.listeners]
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(_serve_until_told, server, sockets)
        bound = listener.extra(SocketAttribute.local_port)
        log.info("metrics.listening", url=f"http://{host}:{bound}/metrics")
        try:
            yield bound
        finally:
            server.should_exit = True


async def _serve_until_told(server: EmbeddedUvicorn, sockets: list) -> None:
    # Shielded: however the block ends (even cancelled) it sets should_exit, and uvicorn then closes its
    # listeners and connections itself; a cancelled serve() would leave them open.
    with anyio.CancelScope(shield=True):
        await server.serve(sockets=sockets)
