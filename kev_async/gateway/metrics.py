"""The gateway's Prometheus metrics, served by the gateway itself on `GET /metrics`."""

from __future__ import annotations

import re
import secrets
import time
from contextlib import contextmanager

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

# Seconds: from a few milliseconds of gateway overhead to minutes-long answers.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
CLIENT_GONE = 499  # nginx's status for a client that closed the connection before its response was sent
_GONE = "kev.client_gone"  # a scope key: the app saw the client leave before its response started
_PROCESS = re.compile(r'^kev_gateway_process_info\{process="([0-9a-f]+)"\}', re.M)


def process_of(metrics_text: str) -> str | None:
    """The gateway process that served a /metrics scrape (with `--processes N`, which one took the connection)."""
    match = _PROCESS.search(metrics_text)
    return match[1] if match else None


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kev_gateway_requests_total", "HTTP requests answered, by route and status.",
                                ["route", "status"], registry=r)
        self.latency = Histogram("kev_gateway_request_seconds", "Request received to response finished, by route.",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_byte = Histogram("kev_gateway_time_to_first_chunk_seconds",
                                    "Streamed requests: received to the first content chunk sent.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("kev_gateway_requests_in_flight", "Questions published and not yet answered.",
                               registry=r)
        self.cancels = Counter("kev_gateway_cancels_total",
                               "Cancels sent to the workers (client gone or deadline passed).", registry=r)
        self.publish_failures = Counter("kev_gateway_publish_failures_total",
                                        "Questions the broker did not ack in time (answered 503).", registry=r)
        self.refused = Counter("kev_gateway_refused_total",
                               "Connections refused before the app: too many, headers too large, headers too slow.",
                               ["reason"], registry=r)
        # A random name per process, not its pid: enough to tell `--processes N` apart, nothing to aim at.
        Info("kev_gateway_process", "This gateway process.", registry=r).info({"process": secrets.token_hex(6)})
        self._counts: dict[tuple[str, int], Counter] = {}
        self._latencies: dict[str, Histogram] = {}

    @contextmanager
    def waiting(self):
        self.in_flight.inc()
        try:
            yield
        finally:
            self.in_flight.dec()

    def observe(self, route: str, status: int, started: float) -> None:
        # prometheus_client's labels() takes a lock and builds a key on every call: keep each child once.
        count = self._counts.get((route, status))
        if count is None:
            count = self._counts[route, status] = self.requests.labels(route, str(status))
        latency = self._latencies.get(route)
        if latency is None:
            latency = self._latencies[route] = self.latency.labels(route)
        count.inc()
        latency.observe(time.perf_counter() - started)

    def refuse(self, reason: str) -> None:
        self.refused.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def mark_client_gone(scope) -> None:
    """The client left before its response started: counted as CLIENT_GONE (499), not the 500 of no response."""
    scope[_GONE] = True


class ObserveRequests:
    """ASGI middleware: count every HTTP response by route and status and time it to its last byte
    (for a stream, that is when `data: [DONE]` went out). A request whose client left before any response
    counts as 499; one that got no response otherwise, as 500."""

    def __init__(self, app, metrics: GatewayMetrics, routes: frozenset[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), None
        route = scope.get("path", "") if scope.get("path", "") in self.routes else "other"

        async def observed_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            if status is None:  # no response at all
                status = CLIENT_GONE if scope.get(_GONE) else 500
            self.metrics.observe(route, status, started)
