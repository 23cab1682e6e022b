"""`Gateway`: what the routes and the streamed responses share (config, publisher, reply router, catalog,
auth, metrics, per-tenant slots, the answers of restarted streams, the Batch API), the deadline a request's question
gets, and the one thread that compiles response_format grammars."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.requests import Request

from kev_async.gateway.auth import Authenticator
from kev_async.gateway.callers import Caller, TenantSlots, caller_of
from kev_async.gateway.catalog import ModelCatalog
from kev_async.gateway.errors import bad_request
from kev_async.gateway.kept_answers import KeptAnswers
from kev_async.gateway.metrics import GatewayMetrics
from kev_async.gateway.openai_requests import check_response_format
from kev_async.gateway.publisher import BrokerUnavailable, QuestionPublisher
from kev_async.gateway.replies import ReplyRouter
from schemas import KevConfig, QuestionEvent

CLIENT_TIMEOUT_HEADER = "x-stainless-read-timeout"  # the openai client's own timeout, in seconds
# Compiling a big response_format takes tens of ms of CPU (an 81 KB schema: ~40 ms). With anyio's default
# of 40 threads, 40 at once left the event loop one core-share in 41 (plain requests waited 2.3-2.6 s);
# one thread leaves it a core of its own while they queue.
COMPILE_THREADS = 1


@dataclass
class Gateway:
    """Everything the routes share; built and started by kev_async.gateway.server."""

    cfg: KevConfig
    publisher: QuestionPublisher
    replies: ReplyRouter
    catalog: ModelCatalog
    auth: Authenticator
    metrics: GatewayMetrics
    slots: TenantSlots = field(default=None)  # type: ignore[assignment]  # None: from cfg
    kept: KeptAnswers = field(default_factory=KeptAnswers)
    # the Batch API's state, files and runner (batches.Batches), set by the server; untyped here because
    # batches.py builds on this module
    batches: Any = None
    # made on first use: it needs the running event loop
    _compiles: anyio.CapacityLimiter | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.slots is None:
            self.slots = TenantSlots(self.cfg.gateway.max_concurrent_per_tenant)

    def caller(self, authorization: str | None) -> Caller:
        return caller_of(self.auth.tenant(authorization), self.cfg.gateway)

    def deadline_ms(self, request: Request, stream: bool) -> int:
        """The question's timeout_ms: the configured deadline, shortened by a whole-response client timeout."""
        limit = self.cfg.gateway.request_timeout_ms or self.cfg.aggregator.timeout_ms
        client = client_timeout_ms(request.headers.get(CLIENT_TIMEOUT_HEADER))
        if client is not None and not stream:  # for a stream it bounds each chunk, not the whole answer
            limit = min(limit, client)
        return limit

    async def check_response_format(self, question: QuestionEvent) -> None:
        """A 400 when the question's response_format does not compile; off the event loop, one at a time."""
        if self._compiles is None:
            self._compiles = anyio.CapacityLimiter(COMPILE_THREADS)
        await anyio.to_thread.run_sync(check_response_format, question, limiter=self._compiles)

    async def cancel(self, question_id: str) -> None:
        self.metrics.cancels.inc()
        await self.publisher.cancel(question_id)

    async def publish(self, question: QuestionEvent, arrived_ms: int | None = None) -> None:
        """Publish; if the broker does not ack in time the question may still be delivered later, so it is
        cancelled too (a worker remembers a cancel that overtakes its question)."""
        try:
            await self.publisher.publish(question, arrived_ms)
        except BrokerUnavailable as error:
            self.metrics.publish_failures.inc()
            await self.cancel(question.question_id)
            error.headers = {"x-request-id": question.question_id}  # the id its cancel names
            raise


def client_timeout_ms(value: str | None) -> int | None:
    """The client's whole-request timeout in ms; None when absent or infinite; 400 when not a positive number."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if seconds == math.inf:
        return None
    if not seconds > 0:  # NaN too
        raise bad_request(f"{CLIENT_TIMEOUT_HEADER}: expected a positive number of seconds, got {value[:40]!r}",
                          param=CLIENT_TIMEOUT_HEADER, code="invalid_header")
    return max(1, int(min(seconds, 1e9) * 1000))
