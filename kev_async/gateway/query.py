"""POST /v1/query: several questions in one call, each answered as if it were alone (seed 002's HTTP API).

    {"queries": ["问题A", "问题B"], "isolation": "strict"}
    -> {"request_id": "query-…", "isolation": "strict",
        "results": [{"index": 0, "question_id": "query-….0", "text": "…", "finish_reason": "stop", …}, …]}

Each query becomes one QuestionEvent, published as the chat endpoint publishes its one: signed, answered
on this gateway's reply topic, its tenant from the API key, checked by the workers' own gate before anything
is published. The request takes one of its tenant's slots per query: the first from its headers, as every
answer request does, the rest once the body says how many, all before anything is published, or a 429 for
the whole request. The answers are awaited together and returned in query order; a query that gets an
error answer, or no answer by the deadline, carries its own `error` and leaves the others alone.

Isolation: whether a worker caches prefixes at all is its isolation.level, but which questions may share
a cached prefix is each question's cache_salt. "strict" gives every query a salt of its own, so it shares
no prefix block with anyone whatever the workers' level; "shared" lets the request's queries share their
tenant's prefix cache (an anonymous caller's queries share one salt, for this request only) and needs
workers at isolation.level shared: asked of a gateway configured strict it is a 400 naming that key,
rather than answers that silently shared nothing.
"""

from __future__ import annotations

import asyncio
import secrets
from contextlib import ExitStack
from typing import Any, Literal

import msgspec
from msgspec import Struct

from kev_async.gateway.callers import Caller, TenantSlots, new_question_id
from kev_async.gateway.errors import ApiError, bad_request
from kev_async.gateway.openai_responses import usage
from kev_async.gateway.replies import Pending
from kev_async.gateway.streaming import watch_disconnect
from schemas import AnswerEvent, InvalidQuestion, KevConfig, QuestionEvent, UndecodableEvent, decode_question

Isolation = Literal["strict", "shared"]
# What the x-kev-audit header carries: shown in a result only to gateway.audit_tenants (a channel, a routing
# bucket or an admission time tells a caller how busy the worker was with other tenants' questions).
AUDIT_FIELDS = ("channel_id", "hash_bucket", "started_ms", "finished_ms")


class QueryRequest(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    queries: list[str]
    isolation: Isolation = "strict"
    model: str | None = None  # the served model (default) or a LoRA adapter loaded through kev.control
    system: str | None = None  # one system prompt for every query
    max_new_tokens: int | None = None  # per query; `max_tokens` is the same, spelled as OpenAI spells it
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None  # every query draws with this seed, as it would alone
    stop: str | list[str] | None = None


_DECODER = msgspec.json.Decoder(QueryRequest)
# The question's fields, named as the body names them.
_PARAM_NAMES = {"params.max_new_tokens": "max_new_tokens", "params.temperature": "temperature",
                "params.top_p": "top_p", "params.top_k": "top_k", "params.seed": "seed",
                "params.repetition_penalty": "repetition_penalty", "params.stop": "stop", "system": "system"}


def parse_query(body: bytes, cfg: KevConfig) -> QueryRequest:
    """Decode a body and check what can be checked without building questions; a 400 naming the field."""
    try:
        request = _DECODER.decode(body)
    except msgspec.ValidationError as error:  # a subclass of DecodeError: first
        raise _invalid_field(str(error)) from None
    except msgspec.DecodeError as error:
        raise bad_request(f"We could not parse the JSON body of your request. ({error})", code="invalid_json") from None
    except RecursionError:
        raise bad_request("The JSON body of your request is nested too deeply.", code="invalid_json") from None
    _check_count(len(request.queries), cfg)
    if request.isolation == "shared" and cfg.isolation.level != "shared":
        raise bad_request(f'isolation: "shared" needs workers that share cached prefixes, and this service runs '
                          f'isolation.level: {cfg.isolation.level}; ask for "strict", or set isolation.level: shared '
                          'on the workers and the gateway', param="isolation", code="unsupported_value")
    if None not in (request.max_tokens, request.max_new_tokens) and request.max_tokens != request.max_new_tokens:
        raise bad_request("max_tokens and max_new_tokens are the same limit; give one of them",
                          param="max_tokens", code="invalid_field")
    return request


def _check_count(count: int, cfg: KevConfig) -> None:
    limit, slots = cfg.gateway.max_queries_per_request, cfg.gateway.max_concurrent_per_tenant
    if not count:
        raise bad_request("queries: empty; give at least one question", param="queries", code="invalid_field")
    if count > limit:
        raise bad_request(f"queries: {count} queries, at most {limit} per request (gateway.max_queries_per_request)",
                          param="queries", code="too_many_queries")
    if count > slots:  # a 429 would never clear: say so once
        raise bad_request(f"queries: {count} queries need {count} of your tenant's slots, and it may hold at most "
                          f"{slots} (gateway.max_concurrent_per_tenant)", param="queries", code="too_many_queries")


def to_questions(request: QueryRequest, *, request_id: str, caller: Caller, reply_topic: str, timeout_ms: int,
                 adapter: str | None, max_prompt_chars: int) -> list[QuestionEvent]:
    """One QuestionEvent per query, in query order, each checked by the workers' own gate."""
    shared_salt = caller.cache_salt()  # "shared": the tenant's cache, or this request's for an anonymous caller
    questions = []
    for index, text in enumerate(request.queries):
        salt = secrets.token_hex(16) if request.isolation == "strict" else shared_salt
        event: dict[str, Any] = {"question_id": f"{request_id}.{index}", "request_id": request_id, "prompt": text,
                                 "params": _params(request), "timeout_ms": timeout_ms, "reply_topic": reply_topic}
        for name, value in (("tenant", caller.tenant), ("cache_salt", salt), ("adapter", adapter),
                            ("system", request.system)):
            if value is not None:
                event[name] = value
        try:
            questions.append(decode_question(msgspec.json.encode(event), max_prompt_chars=max_prompt_chars))
        except InvalidQuestion as bad:
            raise _refused(bad, index) from None
        except UndecodableEvent as bad:  # only a gateway bug gets here
            raise ApiError(500, f"the gateway built an undecodable question: {bad}", code="internal_error") from None
    return questions


def new_request_id() -> str:
    return new_question_id("query")


def take_slots(slots: TenantSlots, tenant: str | None, count: int) -> ExitStack:
    """`count` more of the tenant's slots, given back when the returned stack closes; a 429 (and none kept)
    when they are not all free."""
    held = ExitStack()
    try:
        for _ in range(count):
            held.enter_context(slots.take(tenant))
    except ApiError as refused:
        held.close()
        raise ApiError(refused.status, f"{refused.message} This request's {count + 1} queries need {count + 1} "
                                       "slots at once; none of them was asked.", code=refused.code,
                       headers=refused.headers) from None
    return held


async def wait_for_all(pendings: list[Pending], receive, wait_s: float) -> bool:
    """Until every question is answered, `wait_s` has passed, or the client hangs up (then True)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    waiting = {pending.answered for pending in pendings}  # never cancelled here: the reply reader sets them
    hangup = asyncio.ensure_future(watch_disconnect(receive, None))
    try:
        while waiting and not hangup.done() and (left := deadline - loop.time()) > 0:
            done, _ = await asyncio.wait(waiting | {hangup}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            waiting -= done
        return hangup.done()
    finally:
        hangup.cancel()


def query_response(request: QueryRequest, request_id: str, questions: list[QuestionEvent],
                   answers: list[AnswerEvent | None], caller: Caller, wait_s: float) -> dict:
    results = [_result(i, q, a, caller, wait_s) for i, (q, a) in enumerate(zip(questions, answers))]
    return {"request_id": request_id, "isolation": request.isolation, "results": results}


def _result(index: int, question: QuestionEvent, answer: AnswerEvent | None, caller: Caller, wait_s: float) -> dict:
    result: dict[str, Any] = {"index": index, "question_id": question.question_id}
    if answer is None:
        return {**result, "text": "", "finish_reason": "timeout", "tokens": 0, "usage": None, "elapsed_ms": None,
                **dict.fromkeys(AUDIT_FIELDS[:2]),
                "error": {"code": "timeout", "message": f"No answer within {wait_s:g} s; the question was cancelled."}}
    error = {"code": answer.error.code, "message": answer.error.message} if answer.error else None
    result.update(text=answer.text, finish_reason=answer.finish_reason, tokens=answer.usage.completion_tokens,
                  usage=usage(answer, show_cached=not caller.anonymous), elapsed_ms=answer.timings.e2e_ms)
    result.update(_audit_fields(answer, caller.audit))
    result["error"] = error
    return result


def _audit_fields(answer: AnswerEvent, audit: bool) -> dict:
    """channel_id and hash_bucket always as keys (null unless the caller may see Kev's audit); started_ms
    and finished_ms only where the worker stamps them."""
    fields = {"channel_id": answer.audit.channel, "hash_bucket": answer.audit.routing_bucket}
    for name in ("started_ms", "finished_ms"):
        value = getattr(answer.timings, name, None)  # workers older than these fields send neither
        if value is not None:
            fields[name] = value
    return fields if audit else {name: None for name in fields}


def _params(request: QueryRequest) -> dict[str, Any]:
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    params = {"max_new_tokens": request.max_new_tokens if request.max_new_tokens is not None else request.max_tokens,
              "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k,
              "repetition_penalty": request.repetition_penalty, "seed": request.seed, "stop": stop}
    return {key: value for key, value in params.items() if value is not None}


def _invalid_field(message: str) -> ApiError:
    reason, _, path = message.partition(" - at `$")
    path = path.rstrip("`").lstrip(".") or None
    if reason.startswith("Object contains unknown field `"):
        name = reason.split("`")[1]
        return bad_request(f"Unrecognized request argument supplied: {name}", param=name,
                           code="unrecognized_argument")
    return bad_request(f"{path}: {reason}" if path else reason, param=path, code="invalid_type")


def _refused(bad: InvalidQuestion, index: int) -> ApiError:
    """A question the workers' gate refused, named as the body names it: a shared field (temperature, system)
    by its name, anything about one query's text as queries[i]."""
    field, _, reason = bad.message.partition(": ")
    param = _PARAM_NAMES.get(field, f"queries[{index}]")
    code = "context_length_exceeded" if bad.code == "too_large" else bad.code
    return bad_request(f"{param}: {reason or bad.message}", param=param, code=code)
