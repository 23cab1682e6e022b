"""`Gateway`: what the routes and the streamed responses share (config, publisher, reply router, catalog,
auth, metrics, per-tenant slots), and the deadline a request's question gets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from starlette.requests import Request

from kev_async.gateway.auth import Authenticator
from kev_async.gateway.callers import Caller, TenantSlots, caller_of
from kev_async.gateway.catalog import ModelCatalog
from kev_async.gateway.errors import bad_request
from kev_async.gateway.metrics import GatewayMetrics
from kev_async.gateway.publisher import BrokerUnavailable, QuestionPublisher
from kev_async.gateway.replies import ReplyRouter
from schemas import KevConfig, QuestionEvent

CLIENT_TIMEOUT_HEADER = "x-stainless-read-timeout"  # the openai client's own timeout, in seconds


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
