"""The gateway's small GET routes: a restarted stream's kept answer, the models, health and metrics.

    GET /v1/chat/completions/{id}   GET /v1/completions/{id}   GET /v1/models   GET /health   GET /metrics
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kev_async.gateway.errors import ApiError
from kev_async.gateway.metrics import CONTENT_TYPE
from kev_async.gateway.openai_responses import chat_completion, kev_headers, text_completion
from kev_async.gateway.state import Gateway

_JSON = msgspec.json.Encoder()


def json_response(body: dict, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_JSON.encode(body), status_code=status, headers=headers, media_type="application/json")


async def kept_answer(request: Request) -> Response:
    """The whole answer of a stream that ended `stream_restarted`, for the tenant that asked (kept_answers.py)."""
    gateway: Gateway = request.app.state.gateway
    caller = gateway.caller(request.headers.get("authorization"))
    answer_id = request.path_params["answer_id"]
    chat = request.url.path.startswith("/v1/chat/")
    kept = gateway.kept.get(answer_id, caller.tenant)
    if kept is None or kept.chat != chat:
        raise ApiError(404, f"No kept answer {answer_id[:80]!r}: only the answers of restarted streams are kept, "
                            f"for a few minutes, for the API key's tenant.", code="not_found")
    shape = chat_completion if chat else text_completion
    return json_response(shape([kept.answer], id_=answer_id, model=kept.model, created=kept.created,
                               show_cached=not caller.anonymous), headers=kev_headers(kept.answer, audit=caller.audit))


async def models(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    gateway.auth.tenant(request.headers.get("authorization"))
    return json_response(gateway.catalog.listing())


async def health(request: Request) -> Response:
    """Healthy or not, and nothing more: no topic, host or process for anyone to aim at."""
    ok = request.app.state.gateway.publisher.healthy
    return json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)


async def metrics(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)
