"""One batch line asked and answered: the same question a single request would publish (to_question, the
workers' own gate), as the batch's tenant, at BATCH_PRIORITY, with the batch's deadline; its answer
shaped as the endpoint would have answered it, in OpenAI's batch output line
`{id, custom_id, response: {status_code, request_id, body}, error}`."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import TYPE_CHECKING

import anyio
import msgspec

from kev_async.gateway.batch_input import BatchLine
from kev_async.gateway.batch_store import BatchRecord, LineRecord
from kev_async.gateway.callers import Caller, caller_of, new_question_id
from kev_async.gateway.errors import ApiError
from kev_async.gateway.openai_requests import ChatRequest, to_question
from kev_async.gateway.openai_responses import chat_completion, raise_for_error, text_completion
from kev_async.gateway.publisher import BrokerUnavailable
from kev_async.gateway.tools import with_tool_calls
from schemas import AnswerEvent, QuestionEvent

if TYPE_CHECKING:
    from kev_async.gateway.state import Gateway

# Below interactive requests (priority 0): within a tenant a worker admits its interactive questions first;
# between tenants the fair policy shares the fleet as for any question.
BATCH_PRIORITY = -10
REPLY_GRACE_S = 5.0  # after its deadline a question is answered "timeout"; that answer gets this long to come
PUBLISH_RETRY_S = 1.0  # the broker refused a publish: the line waits this long and tries again


async def ask_line(gateway: Gateway, batch: BatchRecord, line: BatchLine, stop: anyio.Event) -> LineRecord | None:
    """The line's settled result; None when it was not answered (the batch stopped, or its deadline passed)."""
    caller = caller_of(batch.tenant, gateway.cfg.gateway)
    try:
        question, model = await _question(gateway, batch, line, caller)
    except ApiError as error:  # refused as the endpoint would refuse it: an error line
        return _line(batch, line, "failed", error.status, None, error.body())
    try:
        answers = await _answers(gateway, question, batch, stop)
    except ApiError as error:  # a question the broker refuses for its size
        return _line(batch, line, "failed", error.status, question.question_id, error.body())
    if answers is None or any(answer.finish_reason == "cancelled" for answer in answers):
        return None
    try:
        for answer in answers:
            raise_for_error(answer)
    except ApiError as error:
        return _line(batch, line, "failed", error.status, question.question_id, error.body())
    chat = isinstance(line.request, ChatRequest)
    body = (chat_completion if chat else text_completion)(answers, id_=question.question_id, model=model,
                                                          created=int(time.time()), show_cached=not caller.anonymous)
    if chat:  # a line that offered tools gets its calls as a single request does
        body = with_tool_calls(body, line.request)
    return _line(batch, line, "completed", 200, question.question_id, body)


def not_run_line(batch: BatchRecord, line: BatchLine, reason: str) -> LineRecord:
    """The error line of a request the batch never answered: it was cancelled or its window passed first."""
    why = "the batch was cancelled" if reason == "cancelled" else "the batch's completion_window passed"
    error = {"code": f"batch_{reason}", "message": f"This request was not answered: {why} first."}
    return LineRecord(batch_id=batch.id, index=line.index, outcome="failed",
                      line={"id": _request_id(), "custom_id": line.custom_id, "response": None, "error": error})


async def _question(gateway: Gateway, batch: BatchRecord, line: BatchLine,
                    caller: Caller) -> tuple[QuestionEvent, str]:
    request = line.request
    model = request.model or gateway.catalog.model
    adapter = gateway.catalog.resolve(model)
    chat = isinstance(request, ChatRequest)
    timeout_ms = max(1, int((batch.expires_at - time.time()) * 1000))
    question = to_question(request, question_id=new_question_id("chatcmpl" if chat else "cmpl"), tenant=caller.tenant,
                           cache_salt=caller.cache_salt(), reply_topic=gateway.replies.topic, timeout_ms=timeout_ms,
                           adapter=adapter, max_prompt_chars=gateway.cfg.gateway.max_prompt_chars)
    question = msgspec.structs.replace(question, priority=BATCH_PRIORITY, request_id=batch.id)
    if question.params.response_format is not None:
        await gateway.check_response_format(question)
    return question, model


async def _answers(gateway: Gateway, question: QuestionEvent, batch: BatchRecord,
                   stop: anyio.Event) -> list[AnswerEvent] | None:
    """Publish (again while the broker refuses), then wait for every sample's answer, the stop, or the deadline;
    a question left unanswered is cancelled."""
    with gateway.replies.expect(question.question_id, samples=question.params.n) as pending:
        while not await _published(gateway, question):
            if stop.is_set() or time.time() >= batch.expires_at:
                return None
            await anyio.sleep(PUBLISH_RETRY_S)
        stopped = asyncio.ensure_future(stop.wait())
        try:
            wait_s = max(0.0, batch.expires_at - time.time()) + REPLY_GRACE_S
            await asyncio.wait((pending.answered, stopped), timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if pending.answer is None:  # stopped, past its deadline, or this gateway stopping: free its worker
                await gateway.cancel(question.question_id)
        return pending.ordered() if pending.answer is not None else None


async def _published(gateway: Gateway, question: QuestionEvent) -> bool:
    try:
        await gateway.publish(question)
    except BrokerUnavailable:
        return False
    return True


def _line(batch: BatchRecord, line: BatchLine, outcome: str, status: int, request_id: str | None,
          body: dict) -> LineRecord:
    response = {"status_code": status, "request_id": request_id, "body": body}
    return LineRecord(batch_id=batch.id, index=line.index, outcome=outcome,
                      line={"id": _request_id(), "custom_id": line.custom_id, "response": response, "error": None})


def _request_id() -> str:
    return f"batch_req_{secrets.token_hex(16)}"
