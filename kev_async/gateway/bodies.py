"""A request's body, read whole within its limits: a size (413) and the deadline connections.py keeps
(408). Both refusals close the connection, so the rest of the body is never read."""

from __future__ import annotations

from starlette.requests import Request

from kev_async.gateway.connections import BODY_LATE
from kev_async.gateway.errors import ApiError
from schemas import GatewayConfig

# A refusal sent before the body was read in full: the rest of the body is not read either.
CLOSE = {"connection": "close"}


class ClientGone(Exception):
    """The client left before its response: nothing can be sent, the question (if any) is cancelled."""


async def read_body(request: Request, cfg: GatewayConfig, limit: int | None = None) -> bytes:
    """The whole body, up to `limit` (default max_body_bytes; 413) and within body_read_timeout_ms of the
    headers (408, from connections.py). ClientGone if the client hangs up."""
    limit = cfg.max_body_bytes if limit is None else limit
    too_large = ApiError(413, f"The request body is larger than {limit} bytes.", code="request_too_large",
                         headers=CLOSE)
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise too_large
    chunks, size = [], 0
    while True:
        # receive() rather than request.stream(): the protocol wakes it when the deadline passes, with no
        # timer of the app's own (a timer per request is event-loop time, and the loop is the latency).
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientGone(f"hung up after {size} bytes of its body")
        if request.scope.get(BODY_LATE):
            raise ApiError(408, f"The request body did not arrive within {cfg.body_read_timeout_ms / 1000:g} s.",
                           code="body_timeout", headers=CLOSE)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
