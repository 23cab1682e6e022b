"""The Batch API's routes, in OpenAI's shapes (`client.files.*`, `client.batches.*` work unchanged):

    POST /v1/files                   GET /v1/files/{id}            GET /v1/files/{id}/content
    POST /v1/batches                 GET /v1/batches               GET /v1/batches/{id}
    POST /v1/batches/{id}/cancel

A caller sees only its own tenant's files and batches; anyone else's are a 404, as unknown ids are.
An upload takes one of the tenant's slots while its body is read (up to gateway.max_file_bytes), and
its lines are checked then (batch_input.py), so a bad file is refused before any batch names it.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kev_async.gateway.batch_input import ENDPOINTS, parse_lines
from kev_async.gateway.batch_store import TERMINAL, BatchRecord, CancelRecord
from kev_async.gateway.batches import Batches, new_batch_id, window_seconds
from kev_async.gateway.bodies import ClientGone, read_body
from kev_async.gateway.callers import Caller
from kev_async.gateway.errors import ApiError, bad_request
from kev_async.gateway.files import parse_upload
from kev_async.gateway.read_routes import json_response
from kev_async.gateway.state import Gateway

LIST_LIMIT = 100  # most batches one GET /v1/batches returns, as OpenAI's


class _NewBatch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


_NEW_BATCH = msgspec.json.Decoder(_NewBatch)


def batch_routes() -> list[Route]:
    return [Route("/v1/files", upload_file, methods=["POST"]),
            Route("/v1/files/{file_id}", file_object, methods=["GET"]),
            Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
            Route("/v1/batches", create_batch, methods=["POST"]),
            Route("/v1/batches", list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", batch_object, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"])]


def _context(request: Request) -> tuple[Gateway, Batches, Caller]:
    gateway: Gateway = request.app.state.gateway
    return gateway, gateway.batches, gateway.caller(request.headers.get("authorization"))


async def upload_file(request: Request) -> Response:
    gateway, batches, caller = _context(request)
    with gateway.slots.take(caller.tenant):
        body = await _body(request, gateway, gateway.cfg.gateway.max_file_bytes)
    filename, purpose, content = parse_upload(body, request.headers.get("content-type"))
    await anyio.to_thread.run_sync(lambda: parse_lines(content, max_lines=batches.max_lines))
    stored = await batches.files.save(content, filename=filename, purpose=purpose, tenant=caller.tenant)
    return json_response(stored.openai())


async def file_object(request: Request) -> Response:
    _, batches, caller = _context(request)
    return json_response((await batches.files.get(request.path_params["file_id"], caller.tenant)).openai())


async def file_content(request: Request) -> Response:
    _, batches, caller = _context(request)
    content = await batches.files.read(request.path_params["file_id"], caller.tenant)
    return Response(content, media_type="application/jsonl")


async def create_batch(request: Request) -> Response:
    gateway, batches, caller = _context(request)
    new = _parse_new_batch(await _body(request, gateway))
    if new.endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint={new.endpoint[:80]!r} is not supported; Kev's batches take "
                          f"{' or '.join(ENDPOINTS)}.", param="endpoint", code="invalid_value")
    window = window_seconds(new.completion_window)
    stored = await batches.files.get(new.input_file_id, caller.tenant)
    if stored.purpose != "batch":
        raise bad_request(f"File {stored.id} is a batch's {stored.purpose}, not a batch input.",
                          param="input_file_id", code="invalid_file")
    content = await batches.files.read(stored.id, caller.tenant)
    lines = await anyio.to_thread.run_sync(lambda: parse_lines(content, max_lines=batches.max_lines))
    if lines[0].url != new.endpoint:
        raise bad_request(f"The file's requests go to {lines[0].url}, the batch's endpoint is {new.endpoint}.",
                          param="endpoint", code="endpoint_mismatch")
    now = int(time.time())
    record = BatchRecord(id=new_batch_id(), tenant=caller.tenant, endpoint=new.endpoint, input_file_id=stored.id,
                         completion_window=new.completion_window, created_at=now, expires_at=now + window,
                         status="validating", total=len(lines), metadata=new.metadata)
    record = await batches.store.update(record)
    return json_response(batches.store.view(record.id))


async def batch_object(request: Request) -> Response:
    _, batches, caller = _context(request)
    return json_response(batches.store.view(_own_batch(batches, request, caller).id))


async def cancel_batch(request: Request) -> Response:
    _, batches, caller = _context(request)
    batch = _own_batch(batches, request, caller)
    if batch.status in TERMINAL:
        raise ApiError(409, f"Batch {batch.id} is {batch.status}: it cannot be cancelled.", code="invalid_status")
    if batch.id not in batches.store.cancels:
        await batches.store.put(CancelRecord(batch_id=batch.id, at=int(time.time())))
    return json_response(batches.store.view(batch.id))


async def list_batches(request: Request) -> Response:
    _, batches, caller = _context(request)
    limit = _limit(request.query_params.get("limit"))
    after = request.query_params.get("after")
    own = sorted((b for b in batches.store.batches.values() if b.tenant == caller.tenant),
                 key=lambda b: (b.created_at, b.id), reverse=True)
    if after is not None:
        ids = [b.id for b in own]
        own = own[ids.index(after) + 1:] if after in ids else []
    page = [batches.store.view(b.id) for b in own[:limit]]
    return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None, "has_more": len(own) > limit})


def _own_batch(batches: Batches, request: Request, caller: Caller) -> BatchRecord:
    batch_id = request.path_params["batch_id"]
    batch = batches.store.batches.get(batch_id)
    if batch is None or batch.tenant != caller.tenant:
        raise ApiError(404, f"No batch found with id {batch_id[:80]!r}.", param="batch_id", code="not_found")
    return batch


async def _body(request: Request, gateway: Gateway, limit: int | None = None) -> bytes:
    try:
        return await read_body(request, gateway.cfg.gateway, limit)
    except ClientGone as gone:  # nobody is left to read this answer
        raise ApiError(400, f"The client {gone}.", code="client_gone") from None


def _parse_new_batch(body: bytes) -> _NewBatch:
    try:
        return _NEW_BATCH.decode(body)
    except msgspec.ValidationError as error:
        raise bad_request(str(error), code="invalid_request") from None
    except (msgspec.DecodeError, RecursionError):
        raise bad_request("We could not parse the JSON body of your request.", code="invalid_json") from None


def _limit(value: Any) -> int:
    if value is None:
        return 20
    if not (isinstance(value, str) and value.isdigit() and 1 <= int(value) <= LIST_LIMIT):
        raise bad_request(f"limit: expected 1 to {LIST_LIMIT}, got {str(value)[:20]!r}", param="limit",
                          code="invalid_value")
    return int(value)
