"""The gateway's HTTP connections: uvicorn's httptools protocol with the limits that hold before and
around the app, so a client cannot make the gateway hold memory, sockets or a tenant's slot by
sending slowly, sending too much, or not reading.

    config = uvicorn.Config(app, http=limited_protocol(ConnectionLimits.of(cfg.gateway, metrics.refuse)), ...)

- **The connection budget**: past `max_connections` open connections (this process) a new one is
  answered 503 with Retry-After and closed at once.
- **The head**: request line and headers together may be `max_header_bytes`, in at most `max_headers`
  lines; past either, 431 and the connection closed. httptools itself has no limit and buffers an
  unfinished header whole: the bytes of an unfinished head are counted as they arrive, so a
  connection never holds more than the limit plus one read (at most 256 KiB) of it.
- **The head's pace**: a head must be complete within `header_read_timeout_ms` of its first byte (or
  of the connection opening), else 408 and the connection closed. Between requests uvicorn's own
  keep-alive timeout (5 s) closes an idle connection.
- **The body's pace**: a body must be complete within `body_read_timeout_ms` of its headers. Past it
  the request's scope is marked `BODY_LATE` and the app, which reads the body only once the tenant's
  slot is taken, is woken to answer 408 (app.py); a body still arriving after its response is over
  closes the connection.
- **Writes**: a connection whose unsent output stays above the transport's high-water mark (64 KiB)
  for `send_timeout_ms` — a client that stopped reading — is dropped at once, unsent bytes and all,
  and its scope marked `STALLED`. The app sees the hang-up it would see from any client that left:
  a stream cancels its question and frees its slot (streaming.py).

No timer is set per request: one per connection, set for the earliest deadline and moved on when it
fires early, and one more only while writes are held up. Refusals are written straight to the socket
in OpenAI's error shape, counted in `kev_gateway_refused_total{reason}` and logged at info.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kev_async.gateway.errors import ApiError
from schemas import GatewayConfig

log = structlog.get_logger("kev.gateway.connections")

BODY_LATE = "kev.body_late"  # scope key: the body did not arrive in time (the app answers 408)
STALLED = "kev.stalled"  # scope key: the client stopped reading and the connection was dropped
RETRY_AFTER_S = 1
HEAD, BODY = "head", "body"  # what a connection is waiting for


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    max_header_bytes: int
    max_headers: int
    header_timeout_s: float
    body_timeout_s: float
    send_timeout_s: float
    refused: Callable[[str], None] = lambda reason: None  # counts a refusal (the gateway's metrics)

    @classmethod
    def of(cls, cfg: GatewayConfig, refused: Callable[[str], None]) -> ConnectionLimits:
        return cls(cfg.max_connections, cfg.max_header_bytes, cfg.max_headers, cfg.header_read_timeout_ms / 1000,
                   cfg.body_read_timeout_ms / 1000, cfg.send_timeout_ms / 1000, refused)


def limited_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's `http=` argument: the protocol class, bound to these limits."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits: ConnectionLimits

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._refused = False
        self._head_bytes = 0  # bytes read while inside the current head, before the read being parsed
        self._read_bytes = 0  # the read being parsed
        self._waiting: str | None = None  # HEAD or BODY: what the deadline below is for
        self._since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.limits.max_connections:
            self._refuse(ApiError(503, "The gateway has too many open connections; retry shortly.",
                                  code="too_many_connections", headers={"retry-after": str(RETRY_AFTER_S)}))
            return
        self._wait_for(HEAD)  # the first head must start, and end, in time too

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._timer, self._stall_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._stall_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._read_bytes = len(data)
        super().data_received(data)
        if self._waiting == HEAD and not self.transport.is_closing():
            # Still inside a head after all of `data`: count it whole (a pipelined request's body that came in
            # the same read is counted too, which errs on the safe side by at most one read).
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(self._head_too_large())

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._wait_for(HEAD)

    def on_headers_complete(self) -> None:
        if self._head_over_limits():
            # The parser goes on through the body, so the refusal runs as the request's app: it answers 431
            # and closes, and nothing of the request reaches the gateway's app.
            app, self.app = self.app, _refusal_app(self._head_too_large(), self.limits.refused)
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        else:
            super().on_headers_complete()
        self._wait_for(BODY)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._wait_for(None)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.limits.send_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _head_over_limits(self) -> bool:
        if len(self.headers) > self.limits.max_headers:
            return True
        if self._head_bytes + self._read_bytes <= self.limits.max_header_bytes:
            return False  # all of it came in fewer bytes than the limit: no need to add it up
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        return size > self.limits.max_header_bytes

    def _head_too_large(self) -> ApiError:
        return ApiError(431, f"The request's headers are larger than {self.limits.max_header_bytes} bytes or "
                             f"{self.limits.max_headers} lines.", code="headers_too_large")

    # -- the deadlines: one timer per connection, moved on instead of set and cancelled per request

    def _wait_for(self, what: str | None) -> None:
        self._waiting, self._since = what, self.loop.time()
        if what is None:
            return
        due = self._since + self._limit(what)
        if self._timer is not None and self._timer.when() > due:  # the limits differ: an earlier one now
            self._timer.cancel()
            self._timer = None
        if self._timer is None:
            self._timer = self.loop.call_at(due, self._deadline)

    def _limit(self, what: str) -> float:
        return self.limits.header_timeout_s if what == HEAD else self.limits.body_timeout_s

    def _deadline(self) -> None:
        self._timer = None
        if self._waiting is None or self.transport.is_closing():
            return
        due = self._since + self._limit(self._waiting)
        if self.loop.time() < due:  # set for an earlier wait that ended in time
            self._timer = self.loop.call_at(due, self._deadline)
        elif self._waiting == HEAD:
            self._head_late()
        else:
            self._body_late()

    def _head_late(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            self._wait_for(HEAD)  # a pipelined head behind a response in flight: it waits its turn
            return
        self._refuse(ApiError(408, f"The request's headers did not arrive within "
                                   f"{self.limits.header_timeout_s:g} s.", code="header_timeout"))

    def _body_late(self) -> None:
        self._waiting = None
        if self.cycle.response_started:  # answered without its body (a 401, a 429): nobody reads the rest
            self.limits.refused("body_timeout")
            log.info("gateway.connection_closed", reason="body_timeout", path=self.scope.get("path"))
            self.transport.close()
            return
        self.scope[BODY_LATE] = True
        self.cycle.message_event.set()  # wakes the app's receive(): it sees BODY_LATE and answers 408

    def _stalled(self) -> None:
        self._stall_timer = None
        self.limits.refused("client_stalled")
        if self.scope is not None:
            self.scope[STALLED] = True
        log.info("gateway.client_stalled", status=499, path=self.scope.get("path") if self.scope else None,
                 waited_s=self.limits.send_timeout_s)
        self.transport.abort()  # close() would wait to send what the client does not read

    def _refuse(self, error: ApiError) -> None:
        """Answer `error` on the socket itself and close: nothing more is read from this connection."""
        self._refused, self._waiting = True, None
        self.limits.refused(error.code)
        log.info("gateway.connection_refused", status=error.status, reason=error.code)
        self.transport.write(_raw_response(error))
        self.transport.close()


def _raw_response(error: ApiError) -> bytes:
    body = json.dumps(error.body()).encode()
    headers = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close",
               **(error.headers or {})}
    return STATUS_LINE[error.status] + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) + b"\r\n" + body


def _refusal_app(error: ApiError, refused: Callable[[str], None]):
    async def refuse(scope, receive, send) -> None:
        refused(error.code)
        log.info("gateway.connection_refused", status=error.status, reason=error.code)
        response = error.response()
        response.headers["connection"] = "close"
        await response(scope, receive, send)
    return refuse
