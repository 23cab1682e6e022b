"""A batch input file: JSONL, one OpenAI request per line, checked whole before anything is asked.

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...]}}

Every line is checked at upload (`POST /v1/files`) and again when the batch starts: valid JSON with
exactly these four keys, method POST, a url Kev answers (chat or completions, one url for the whole
file), a custom_id no other line has, and a body the endpoint itself would accept (its own parser,
so a batch line is refused for what a single request is refused for). The first bad line is a 400
that names it; a batch never starts half-valid.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from kev_async.gateway.errors import ApiError, bad_request
from kev_async.gateway.openai_requests import ChatRequest, CompletionRequest, parse_request

ENDPOINTS: dict[str, type[ChatRequest] | type[CompletionRequest]] = {
    "/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest}
CustomId = Annotated[str, Meta(min_length=1, max_length=512)]


class _Line(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    custom_id: CustomId
    method: str
    url: str
    body: msgspec.Raw


class BatchLine(msgspec.Struct, frozen=True):
    index: int  # the line's place among the file's requests, from 0
    custom_id: str
    url: str
    request: ChatRequest | CompletionRequest


_LINE = msgspec.json.Decoder(_Line)


def parse_lines(content: bytes, *, max_lines: int) -> list[BatchLine]:
    """Every request of the file, in order; a 400 naming the first bad line."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as error:
        raise bad_request(f"The file is not UTF-8 text (byte {error.start}).", param="file",
                          code="invalid_file") from None
    lines, seen, url = [], set(), None
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(lines) == max_lines:
            raise bad_request(f"The file has more than {max_lines} requests (gateway.max_batch_lines).",
                              param="file", code="too_many_requests_in_file")
        line = _parse_line(raw, number)
        if line.custom_id in seen:
            raise bad_request(f"Line {number}: custom_id {line.custom_id[:80]!r} is used by an earlier line; "
                              f"each request needs its own.", param="custom_id", code="duplicate_custom_id")
        if url is not None and line.url != url:
            raise bad_request(f"Line {number}: url {line.url!r} differs from the earlier lines' {url!r}; a batch "
                              f"goes to one endpoint.", param="url", code="mixed_urls")
        seen.add(line.custom_id)
        url = line.url
        lines.append(BatchLine(len(lines), line.custom_id, line.url, _request(line, number)))
    if not lines:
        raise bad_request("The file holds no requests: one JSON object per line is expected.", param="file",
                          code="empty_file")
    return lines


def _parse_line(raw: str, number: int) -> _Line:
    try:
        line = _LINE.decode(raw)
    except msgspec.ValidationError as error:
        raise bad_request(f"Line {number}: {error} (each line is an object with custom_id, method, url and body).",
                          param="file", code="invalid_request_line") from None
    except (msgspec.DecodeError, RecursionError):
        raise bad_request(f"Line {number} is not valid JSON: the file must be JSONL, one request object per line.",
                          param="file", code="invalid_jsonl") from None
    if line.method != "POST":
        raise bad_request(f"Line {number}: method {line.method[:20]!r} is not supported; batch requests are POST.",
                          param="method", code="invalid_method")
    if line.url not in ENDPOINTS:
        raise bad_request(f"Line {number}: url {line.url[:80]!r} is not supported; Kev's batches take "
                          f"{' or '.join(ENDPOINTS)}.", param="url", code="invalid_url")
    return line


def _request(line: _Line, number: int) -> ChatRequest | CompletionRequest:
    try:
        request = parse_request(bytes(line.body), ENDPOINTS[line.url])
    except ApiError as error:
        raise bad_request(f"Line {number} (custom_id {line.custom_id[:80]!r}): {error.message}",
                          param=error.param, code=error.code) from None
    if request.stream:
        raise bad_request(f"Line {number}: stream=true has no meaning in a batch; its answer goes to the output file.",
                          param="stream", code="unsupported_value")
    return request
