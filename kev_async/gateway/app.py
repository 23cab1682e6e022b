"""The routes: an OpenAI request becomes a QuestionEvent on Kafka; its answer becomes the response.

    POST /v1/chat/completions   POST /v1/completions   (stream: true -> Server-Sent Events)
    POST /v1/query              (several questions, one result each: seed 002's API, query.py)
    GET  /v1/chat/completions/{id}   GET /v1/completions/{id}   (a restarted stream's whole answer)
    GET  /v1/models             GET  /health           GET  /metrics
    /v1/files, /v1/batches      (the Batch API: batch_routes.py)

An answer request is served in the order that costs a hostile client the least: the API key and the
tenant's slot from the headers alone (401, 429), then the body, within gateway.body_read_timeout_ms
(408) and max_body_bytes (413), then parsing and any response_format compile (400), and only then the
question. Every question gets a fresh random id (the response's `id`) and this instance's reply topic;
the request waits for its answer there. A client that goes away (a hang-up, or a stop in reading that
outlasts gateway.send_timeout_ms: connections.py drops it), a deadline that passes first, or a publish
the broker did not ack in time cancels the question on the control topic, so the worker frees its KV
blocks or never starts it; a client gone is logged at info as a 499. Whatever a client sends, a bad
request is a 4xx in OpenAI's error shape; a 500 means a bug in the gateway.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

import msgspec
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kev_async.gateway.batch_routes import batch_routes
from kev_async.gateway.bodies import CLOSE, ClientGone, read_body
from kev_async.gateway.callers import Caller, new_question_id
from kev_async.gateway.errors import HANDLERS, ApiError, internal_error
from kev_async.gateway.metrics import CLIENT_GONE, ObserveRequests, mark_client_gone
from kev_async.gateway.openai_requests import ChatRequest, CompletionRequest, parse_request, to_question
from kev_async.gateway.openai_responses import chat_completion, kev_headers, raise_for_error, text_completion
from kev_async.gateway.query import new_request_id, parse_query, query_response, take_slots, to_questions, wait_for_all
from kev_async.gateway.read_routes import health, json_response, kept_answer, metrics, models
from kev_async.gateway.replies import Pending
from kev_async.gateway.state import Gateway
from kev_async.gateway.streaming import AnswerStream, watch_disconnect
from kev_async.gateway.tools import with_tool_calls
from schemas import AnswerEvent, QuestionEvent

log = structlog.get_logger("kev.gateway")

# After a question's deadline the worker answers "timeout"; give that answer this long to come back.
REPLY_GRACE_S = 5.0


def create_app(gateway: Gateway) -> ObserveRequests:
    answers = {"/v1/chat/completions": AnswerEndpoint(gateway, ChatRequest),
               "/v1/completions": AnswerEndpoint(gateway, CompletionRequest),
               "/v1/query": QueryEndpoint(gateway)}
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in answers.items()),
        Route("/v1/chat/completions/{answer_id}", kept_answer, methods=["GET"]),
        Route("/v1/completions/{answer_id}", kept_answer, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *batch_routes(),
    ]
    app = Starlette(routes=routes, exception_handlers=HANDLERS)
    app.state.gateway = gateway
    # Outermost, so every route is counted the same way, whichever of the two paths below serves it.
    return ObserveRequests(AnswerRoutes(app, answers), metrics=gateway.metrics,
                           routes=frozenset(r.path for r in routes))


class AnswerRoutes:
    """ASGI: the two answer routes' POSTs go straight to their endpoint; everything else (and a wrong
    method on them) goes through Starlette, whose route table holds the same endpoints."""

    # Why a bypass: at 64 concurrent requests the event loop's time per request, queued, is the latency the
    # gateway adds, and Starlette's layers (error and exception middleware, routing, the endpoint wrappers)
    # were a tenth of its CPU.

    def __init__(self, app: Starlette, answers: dict[str, "AnswerEndpoint"]) -> None:
        self.app, self.answers = app, answers

    async def __call__(self, scope, receive, send) -> None:
        endpoint = self.answers.get(scope.get("path")) if scope["type"] == "http" and scope["method"] == "POST" \
            else None
        await (endpoint or self.app)(scope, receive, send)


class AnswerEndpoint:
    """ASGI: POST /v1/chat/completions or /v1/completions, whole or streamed."""

    def __init__(self, gateway: Gateway, kind: type[ChatRequest] | type[CompletionRequest]) -> None:
        self.gateway, self.kind = gateway, kind

    async def __call__(self, scope, receive, send) -> None:
        started, arrived_ms = time.perf_counter(), time.time_ns() // 1_000_000
        gateway, request = self.gateway, Request(scope, receive)
        try:  # from the headers alone: nothing of the body is read for a caller without a key or a slot
            caller = gateway.caller(request.headers.get("authorization"))
            slot = gateway.slots.take(caller.tenant)
        except ApiError as error:
            error.headers = {**(error.headers or {}), **CLOSE}
            await _respond(error.response(), scope, receive, send)
            return
        with slot:
            try:
                response = await self.respond(request, caller, started, arrived_ms)
            except ClientGone as gone:
                _client_gone(scope, str(gone))
                return
            except ApiError as error:
                response = error.response()
            except Exception:
                log.exception("gateway.request_failed", path=scope.get("path"))
                response = internal_error()
            await _respond(response, scope, receive, send)

    async def respond(self, request: Request, caller: Caller, started: float, arrived_ms: int) -> Response:
        return await _answer(self.gateway, request, self.kind, caller, started, arrived_ms)


class QueryEndpoint(AnswerEndpoint):
    """ASGI: POST /v1/query. The request's first slot is taken from its headers, as every answer request's;
    one more per further query once the body is parsed (query.py), held until the answers are in."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def respond(self, request: Request, caller: Caller, started: float, arrived_ms: int) -> Response:
        gateway, request_id = self.gateway, new_request_id()
        parsed = parse_query(await read_body(request, gateway.cfg.gateway), gateway.cfg)
        adapter = gateway.catalog.resolve(parsed.model) if parsed.model is not None else None
        timeout_ms = gateway.deadline_ms(request, stream=False)
        questions = to_questions(parsed, request_id=request_id, caller=caller, reply_topic=gateway.replies.topic,
                                 timeout_ms=timeout_ms, adapter=adapter,
                                 max_prompt_chars=gateway.cfg.gateway.max_prompt_chars)
        wait_s = timeout_ms / 1000 + REPLY_GRACE_S
        with take_slots(gateway.slots, caller.tenant, len(questions) - 1):
            answers = await _ask_all(request, gateway, questions, wait_s, arrived_ms)
        body = query_response(parsed, request_id, questions, answers, caller, wait_s)
        return json_response(body, headers={"x-request-id": request_id})


async def _ask_all(request: Request, gateway: Gateway, questions: list[QuestionEvent], wait_s: float,
                   arrived_ms: int) -> list[AnswerEvent | None]:
    """Publish them all, then wait for every answer, the deadline, or the client leaving; whatever is
    unanswered then is cancelled. A publish the broker refuses fails the request (503), and cancels all."""
    with ExitStack() as expected, gateway.metrics.waiting():
        pendings = [expected.enter_context(gateway.replies.expect(q.question_id)) for q in questions]
        hung_up = False
        try:
            published = await asyncio.gather(*(gateway.publish(q, arrived_ms) for q in questions),
                                             return_exceptions=True)  # each one acked or refused before going on
            refused = next((outcome for outcome in published if isinstance(outcome, BaseException)), None)
            if refused is not None:
                raise refused
            hung_up = await wait_for_all(pendings, request.receive, wait_s)
        finally:
            unanswered = [p.question_id for p in pendings if p.answer is None]
            await asyncio.gather(*(gateway.cancel(question_id) for question_id in unanswered))
    if hung_up:
        raise ClientGone(f"hung up waiting for {len(unanswered)} of {len(questions)} answers; those cancelled")
    return [pending.answer for pending in pendings]


async def _respond(response, scope, receive, send) -> None:
    """Send a response; a crash before its first byte is a 500."""
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
        log.exception("gateway.request_failed", path=scope.get("path"))
        await internal_error()(scope, receive, send)


def _client_gone(scope, why: str) -> None:
    mark_client_gone(scope)
    log.info("gateway.client_gone", status=CLIENT_GONE, path=scope.get("path"), why=why)


async def _answer(gateway: Gateway, request: Request, kind: type[ChatRequest] | type[CompletionRequest],
                  caller: Caller, started: float, arrived_ms: int) -> Response:
    body = await read_body(request, gateway.cfg.gateway)
    parsed = parse_request(body, kind)
    if parsed.model is None:
        parsed = msgspec.structs.replace(parsed, model=gateway.catalog.model)
    adapter = gateway.catalog.resolve(parsed.model)
    chat = kind is ChatRequest
    question_id = new_question_id("chatcmpl" if chat else "cmpl")
    timeout_ms = gateway.deadline_ms(request, bool(parsed.stream))
    question = to_question(parsed, question_id=question_id, tenant=caller.tenant, cache_salt=caller.cache_salt(),
                           reply_topic=gateway.replies.topic, timeout_ms=timeout_ms, adapter=adapter,
                           max_prompt_chars=gateway.cfg.gateway.max_prompt_chars)
    if question.params.response_format is not None:
        await gateway.check_response_format(question)
    wait_s = timeout_ms / 1000 + REPLY_GRACE_S
    if parsed.stream:
        return AnswerStream(gateway, question, parsed, caller=caller, chat=chat, wait_s=wait_s, started=started,
                            arrived_ms=arrived_ms)
    answers = await _ask(request, gateway, question, wait_s, arrived_ms)
    for answer in answers:
        raise_for_error(answer)
    shape = chat_completion if chat else text_completion
    body = shape(answers, id_=question_id, model=parsed.model, created=int(time.time()),
                 show_cached=not caller.anonymous)
    if chat:
        body = with_tool_calls(body, parsed)
    return json_response(body, headers={"x-request-id": question_id, **kev_headers(answers[0], audit=caller.audit)})


async def _ask(request: Request, gateway: Gateway, question: QuestionEvent, wait_s: float,
               arrived_ms: int) -> list[AnswerEvent]:
    """Publish, then wait for the answers (one per sample, params.n), the deadline, or the client leaving (the
    last two cancel it)."""
    answer, hung_up = None, False
    with gateway.replies.expect(question.question_id, samples=question.params.n) as pending, \
            gateway.metrics.waiting():
        await gateway.publish(question, arrived_ms)
        try:
            answer, hung_up = await _answer_or_hangup(pending, request.receive, wait_s)
        finally:
            if answer is None:
                await gateway.cancel(question.question_id)
    if hung_up:
        raise ClientGone(f"hung up waiting for the answer; {question.question_id} cancelled")
    if answer is None:
        raise ApiError(504, f"No answer within {wait_s:g} s; the question was cancelled.", code="timeout")
    return pending.ordered()


async def _answer_or_hangup(pending: Pending, receive, wait_s: float) -> tuple[AnswerEvent | None, bool]:
    """(the answer, False); (None, True) if the client hangs up first; (None, False) once `wait_s` passed."""
    # Plain asyncio rather than an anyio task group with a watcher task and a cancel scope: ~40 instead of
    # ~190 µs of the event loop per request, and at 64 concurrent requests the loop's time per request,
    # queued, is the latency the gateway adds.
    hangup = asyncio.ensure_future(watch_disconnect(receive, None))
    try:
        await asyncio.wait((pending.answered, hangup), timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        hung_up = hangup.done()
    finally:
        hangup.cancel()
    return pending.answer, pending.answer is None and hung_up
