"""The routes: an OpenAI request becomes a QuestionEvent on Kafka; its answer becomes the response.

    POST /v1/chat/completions   POST /v1/completions   (stream: true -> Server-Sent Events)
    GET  /v1/models             GET  /health           GET  /metrics

Every question gets a fresh random id (the response's `id`) and this instance's reply topic; the
request waits for its answer there. A client that goes away, a deadline that passes first, or a
publish the broker did not ack in time cancels the question on the control topic, so the worker frees
its KV blocks or never starts it. Whatever a client sends, a bad request is a 4xx in OpenAI's error
shape; a 500 means a bug in the gateway.
"""

from __future__ import annotations

import asyncio
import time

import anyio
import msgspec
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kev_async.gateway.callers import new_question_id
from kev_async.gateway.errors import HANDLERS, ApiError, internal_error
from kev_async.gateway.metrics import CONTENT_TYPE, ObserveRequests
from kev_async.gateway.openai_requests import (
    ChatRequest,
    CompletionRequest,
    check_response_format,
    parse_request,
    to_question,
)
from kev_async.gateway.openai_responses import chat_completion, kev_headers, raise_for_error, text_completion
from kev_async.gateway.replies import Pending
from kev_async.gateway.state import Gateway
from kev_async.gateway.streaming import AnswerStream, watch_disconnect
from schemas import AnswerEvent, QuestionEvent

log = structlog.get_logger("kev.gateway")

# After a question's deadline the worker answers "timeout"; give that answer this long to come back.
REPLY_GRACE_S = 5.0
_JSON = msgspec.json.Encoder()


def create_app(gateway: Gateway) -> ObserveRequests:
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers=HANDLERS)
    app.state.gateway = gateway
    # Outermost, so every route is counted the same way, whichever of the two paths below serves it.
    return ObserveRequests(AnswerRoutes(app, gateway), metrics=gateway.metrics,
                           routes=frozenset(r.path for r in routes))


class AnswerRoutes:
    """ASGI: the two answer routes' POSTs go straight to their handler; everything else (and a wrong
    method on them) goes through Starlette. Same responses and errors either way."""

    # Why a bypass: at 64 concurrent requests the event loop's time per request, queued, is the latency the
    # gateway adds, and Starlette's layers (error and exception middleware, routing, the endpoint wrappers)
    # were a tenth of its CPU.

    ROUTES = {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest}

    def __init__(self, app: Starlette, gateway: Gateway) -> None:
        self.app, self.gateway = app, gateway

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path")
        kind = self.ROUTES.get(path) if scope["type"] == "http" and scope["method"] == "POST" else None
        if kind is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await _answer(self.gateway, Request(scope, receive), kind)
        except ApiError as error:
            response = error.response()
        except Exception:
            log.exception("gateway.request_failed", path=path)
            response = internal_error()
        if not isinstance(response, AnswerStream):
            await response(scope, receive, send)
            return
        started = False

        async def send_noting_start(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await response(scope, receive, send_noting_start)
        except Exception:
            if started:
                raise  # mid-stream: the status line is gone, nothing else can be sent
            log.exception("gateway.request_failed", path=path)
            await internal_error()(scope, receive, send)


# Starlette's routes for the two POSTs: AnswerRoutes serves them first; these keep the route table whole
# (a GET there gets Starlette's 405, in OpenAI's error shape).
async def chat_completions(request: Request) -> Response:
    return await _answer(request.app.state.gateway, request, ChatRequest)


async def completions(request: Request) -> Response:
    return await _answer(request.app.state.gateway, request, CompletionRequest)


async def models(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    gateway.auth.tenant(request.headers.get("authorization"))
    return _json(gateway.catalog.listing())


async def health(request: Request) -> Response:
    """Healthy or not, and nothing more: no topic, host or process for anyone to aim at."""
    ok = request.app.state.gateway.publisher.healthy
    return _json({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)


async def metrics(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)


async def _answer(gateway: Gateway, request: Request, kind: type[ChatRequest] | type[CompletionRequest]) -> Response:
    started, arrived_ms = time.perf_counter(), time.time_ns() // 1_000_000
    caller = gateway.caller(request.headers.get("authorization"))
    body = await _read_body(request, gateway.cfg.gateway.max_body_bytes)
    parsed = parse_request(body, kind)
    adapter = gateway.catalog.resolve(parsed.model)
    chat = kind is ChatRequest
    question_id = new_question_id("chatcmpl" if chat else "cmpl")
    timeout_ms = gateway.deadline_ms(request, bool(parsed.stream))
    question = to_question(parsed, question_id=question_id, tenant=caller.tenant, cache_salt=caller.cache_salt(),
                           reply_topic=gateway.replies.topic, timeout_ms=timeout_ms, adapter=adapter,
                           max_prompt_chars=gateway.cfg.gateway.max_prompt_chars)
    if question.params.response_format is not None:
        await anyio.to_thread.run_sync(check_response_format, question)
    wait_s = timeout_ms / 1000 + REPLY_GRACE_S
    if parsed.stream:
        return AnswerStream(gateway, question, parsed, caller=caller, chat=chat, wait_s=wait_s, started=started,
                            arrived_ms=arrived_ms)
    with gateway.slots.take(caller.tenant):
        answer = await _ask(request, gateway, question, wait_s, arrived_ms)
    raise_for_error(answer)
    shape = chat_completion if chat else text_completion
    body = shape(answer, id_=question_id, model=parsed.model, created=int(time.time()),
                 show_cached=not caller.anonymous)
    return _json(body, headers={"x-request-id": question_id, **kev_headers(answer, audit=caller.audit)})


async def _ask(request: Request, gateway: Gateway, question: QuestionEvent, wait_s: float, arrived_ms: int):
    """Publish, then wait for the answer, the deadline, or the client leaving (the last two cancel it)."""
    answer = None
    with gateway.replies.expect(question.question_id) as pending, gateway.metrics.waiting():
        await gateway.publish(question, arrived_ms)
        try:
            answer = await _answer_or_hangup(pending, request.receive, wait_s)
        finally:
            if answer is None:
                await gateway.cancel(question.question_id)
    if answer is None:
        raise ApiError(504, f"No answer within {wait_s:g} s; the question was cancelled.", code="timeout")
    return answer


async def _answer_or_hangup(pending: Pending, receive, wait_s: float) -> AnswerEvent | None:
    """The answer, or None if the client hangs up or `wait_s` passes first."""
    # Plain asyncio rather than an anyio task group with a watcher task and a cancel scope: ~40 instead of
    # ~190 µs of the event loop per request, and at 64 concurrent requests the loop's time per request,
    # queued, is the latency the gateway adds.
    hangup = asyncio.ensure_future(watch_disconnect(receive, None))
    try:
        await asyncio.wait((pending.answered, hangup), timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
    return pending.answer


async def _read_body(request: Request, limit: int) -> bytes:
    too_large = ApiError(413, f"The request body is larger than {limit} bytes.", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _json(body: dict, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_JSON.encode(body), status_code=status, headers=headers, media_type="application/json")
