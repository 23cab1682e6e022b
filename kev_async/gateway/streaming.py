"""`stream: true`: an ASGI response that publishes the question, then sends Server-Sent Events built from
its deltas as they arrive, and `data: [DONE]` after the answer.

Written as a plain ASGI callable rather than starlette's StreamingResponse so that everything a
stream owns (its place in the reply router, its disconnect watcher, the cancel when it ends early)
lives and dies inside one `__call__`: a client that hangs up cancels the stream's task group, and
the `finally` sends the question's cancel, shielded, so the worker frees its KV blocks. A client
that stops reading is one that hangs up too: its connection is dropped once its writes have waited
gateway.send_timeout_ms (connections.py). The tenant's slot is the caller's (app.py), held around the
whole call.

A stream never splices two answers. It relays one worker attempt's deltas (replies.py); if the question
was redelivered and the final answer does not begin with the text already sent, the stream ends with
an OpenAI error event, code `stream_restarted`, and the whole answer is kept for
`GET /v1/chat/completions/{id}` (kept_answers.py).

A request with tools has its text read for `<tool_call>` blocks as it streams (tool_calls.py), and its
response begins only with the first reply: a worker that refuses the tools (a chat template without a
tool-call format) is a 400, not an error event inside a 200 stream.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import structlog
from anyio import CancelScope
from starlette.types import Receive, Scope, Send

from kev_async.gateway.callers import Caller
from kev_async.gateway.connections import STALLED
from kev_async.gateway.errors import ApiError
from kev_async.gateway.kept_answers import KEEP_S
from kev_async.gateway.metrics import CLIENT_GONE
from kev_async.gateway.openai_requests import ChatRequest, CompletionRequest, wants_usage_in_stream
from kev_async.gateway.openai_responses import SSE_DONE, ChunkMaker, audit_json, raise_for_error, sse
from kev_async.gateway.replies import Pending
from kev_async.gateway.state import Gateway
from kev_async.gateway.tool_calls import StreamedCalls
from kev_async.gateway.tools import tool_use
from schemas import AnswerDelta, AnswerEvent, QuestionEvent

log = structlog.get_logger("kev.gateway.streaming")

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


async def watch_disconnect(receive: Receive, scope: CancelScope | None) -> None:
    """Return when the client hangs up (the request body is already read), cancelling `scope` if given."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if scope is not None:
                scope.cancel()
            return


class AnswerStream:
    def __init__(self, gateway: Gateway, question: QuestionEvent, request: ChatRequest | CompletionRequest, *,
                 caller: Caller, chat: bool, wait_s: float, started: float, arrived_ms: int) -> None:
        self.gateway, self.question, self.wait_s, self.started = gateway, question, wait_s, started
        self.caller, self.arrived_ms, self.chat, self.model = caller, arrived_ms, chat, request.model
        self.include_usage = wants_usage_in_stream(request)
        self.chunks = ChunkMaker(chat=chat, id_=question.question_id, model=request.model, created=int(time.time()))
        use = tool_use(request) if isinstance(request, ChatRequest) else None
        self.calls = StreamedCalls(use.names, use.parallel) if use is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway, question_id = self.gateway, self.question.question_id
        with gateway.replies.expect(question_id, streamed=True, samples=self.question.params.n) as pending, \
                gateway.metrics.waiting():
            try:
                await gateway.publish(self.question, self.arrived_ms)
            except ApiError as error:
                await error.response()(scope, receive, send)
                return
            answered, left = False, False
            try:
                async with anyio.create_task_group() as tg:
                    async def hung_up() -> None:
                        nonlocal left
                        await watch_disconnect(receive, tg.cancel_scope)
                        left = True

                    tg.start_soon(hung_up)
                    answered = await self._relay(pending, scope, receive, send)
                    tg.cancel_scope.cancel()
            finally:
                if not answered:
                    await gateway.cancel(question_id)
            if left:
                why = "stopped reading" if scope.get(STALLED) else "hung up mid-stream"
                log.info("gateway.client_gone", status=CLIENT_GONE, path=scope.get("path"), question_id=question_id,
                         why=why, cancelled=not answered)

    async def _relay(self, pending: Pending, scope: Scope, receive: Receive, send: Send) -> bool:
        """Send the stream; True once the answers arrived (a deadline passing first is reported in-stream)."""
        events = pending.events()
        peeked = None
        if self.calls is not None or _has_tool_turns(self.question):
            with anyio.move_on_after(self.wait_s):
                peeked = await _first_reply(events)
            if peeked is None:
                await self._timed_out().response()(scope, receive, send)
                return False
            if isinstance(peeked, AnswerEvent) and peeked.finish_reason == "error":
                try:
                    raise_for_error(peeked)
                except ApiError as error:
                    await error.response()(scope, receive, send)
                return True
        headers = [*SSE_HEADERS, (b"x-request-id", self.question.question_id.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for index in range(self.question.params.n):
            if (first := self.chunks.first(index)) is not None:
                await self._send(send, sse(first))
        sent: dict[int, list[str]] = {}  # sample -> its text sent
        scored: dict[int, int] = {}  # sample -> how many of its tokens' logprobs were sent
        answers = 0
        with anyio.move_on_after(self.wait_s):
            async for event in _chained(peeked, events):
                if isinstance(event, AnswerDelta):
                    if event.text or event.logprobs:  # an end token has a logprob and no text
                        if not sent:
                            self.gateway.metrics.first_byte.observe(time.perf_counter() - self.started)
                        sent.setdefault(event.index, []).append(event.text)
                        scored[event.index] = scored.get(event.index, 0) + len(event.logprobs or ())
                        if chunks := self._text_chunks(event):
                            await self._send(send, chunks)
                    continue
                if not await self._finish_sample(send, event, "".join(sent.get(event.index, ())),
                                                 scored.get(event.index, 0)):
                    return True  # ended with an error event
                answers += 1
                if pending.relayed_all(answers):
                    await self._finish(send, pending.ordered())
                    return True
        await self._send(send, sse(self._timed_out().body()) + SSE_DONE, more=False)
        return False

    def _timed_out(self) -> ApiError:
        return ApiError(504, f"No answer within {self.wait_s:g} s; the question was cancelled.", code="timeout")

    async def _finish_sample(self, send: Send, answer: AnswerEvent, sent: str, scored: int = 0) -> bool:
        """A sample's end: its tail and finish_reason; False when the stream ended with an error event.
        `scored`: how many of its tokens' logprobs the deltas carried; the answer's own carry the rest."""
        try:
            raise_for_error(answer)
        except ApiError as error:  # mid-stream, OpenAI sends the error object as an event
            await self._send(send, sse(error.body()) + SSE_DONE, more=False)
            return False
        if not answer.text.startswith(sent):
            await self._send(send, sse(self._restarted(answer, sent).body()) + SSE_DONE, more=False)
            return False
        tail = answer.text[len(sent):]  # normally empty: the last delta carries the tail
        # With exactly_once delivery a sample's last deltas (outside the worker's transaction) can land after
        # its answer (inside it): the tail then comes from the answer, with those tokens' logprobs.
        rest = answer.logprobs[scored:] if answer.logprobs else ()
        if self.calls is not None:
            pairs, logprobs, called = self.calls.end(answer.index, tail, rest)
            reason = "tool_calls" if called and answer.finish_reason == "stop" else None
            await self._send(send, b"".join(sse(self.chunks.delta(d, answer.index, lp)) for d, lp in pairs) +
                             sse(self.chunks.last(answer, reason, logprobs)))
            return True
        await self._send(send, (sse(self.chunks.text(tail, answer.index, rest or None)) if tail or rest else b"") +
                         sse(self.chunks.last(answer)))
        return True

    def _text_chunks(self, delta: AnswerDelta) -> bytes:
        if self.calls is None:
            return sse(self.chunks.text(delta.text, delta.index, delta.logprobs))
        pairs = self.calls.feed(delta.index, delta.text, delta.logprobs)
        return b"".join(sse(self.chunks.delta(d, delta.index, logprobs)) for d, logprobs in pairs)

    async def _finish(self, send: Send, answers: list[AnswerEvent]) -> None:
        out = b""
        if self.include_usage:
            out += sse(self.chunks.usage(answers, show_cached=not self.caller.anonymous))
        if self.caller.audit:
            # An SSE comment: clients skip it, so Kev's audit rides along without touching the chunk schema.
            out += b": x-kev-audit " + audit_json(answers[0]).encode() + b"\n\n"
        await self._send(send, out + SSE_DONE, more=False)

    def _restarted(self, answer: AnswerEvent, sent: str) -> ApiError:
        """The answer came from a second attempt that does not extend what was sent: keep it, and say where."""
        question_id = self.question.question_id
        kept = self.gateway.kept.keep(question_id, answer, tenant=self.caller.tenant, model=self.model,
                                      created=self.chunks.head["created"], chat=self.chat)
        log.warning("gateway.stream_restarted", question_id=question_id, sent_chars=len(sent),
                    attempt=answer.audit.attempt, kept=kept)
        route = "chat/completions" if self.chat else "completions"
        where = (f"the whole answer is at GET /v1/{route}/{question_id} for {KEEP_S:g} s" if kept
                 else "the whole answer was too large to keep")
        return ApiError(502, f"The answer was restarted on another worker after part of it was sent, and the "
                             f"new answer differs from the text already streamed, which is void; {where}.",
                        type_="server_error", code="stream_restarted")

    async def _send(self, send: Send, body: bytes, *, more: bool = True) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": more})


async def _chained(first: AnswerEvent | AnswerDelta | None, events: AsyncIterator[AnswerEvent | AnswerDelta]):
    """The reply already read (if any), then the rest."""
    if first is not None:
        yield first
    async for event in events:
        yield event


def _has_tool_turns(question: QuestionEvent) -> bool:
    """Tool calls or tool messages in the conversation: a model without a tool format refuses them."""
    return any(m.role == "tool" or m.tool_calls for m in question.messages or ())


async def _first_reply(events: AsyncIterator[AnswerEvent | AnswerDelta]) -> AnswerEvent | AnswerDelta | None:
    """The first answer or delta with something in it (a worker ending a question sends an empty last delta
    before its answer, an error answer included); None when the replies end first."""
    async for event in events:
        if isinstance(event, AnswerEvent) or event.text or event.logprobs:
            return event
    return None
