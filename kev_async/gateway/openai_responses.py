"""Kev's AnswerEvents and AnswerDeltas in OpenAI's response shapes: `chat.completion`,
`chat.completion.chunk`, `text_completion` (whole and streamed), `usage`, and `x-kev-*` headers.

OpenAI's finish_reason has no `timeout`: an answer cut by its deadline ends with `length` (a limit
cut it), and the header `x-kev-finish-reason` keeps Kev's own reason. Kev's audit never enters the
body: it rides in the `x-kev-audit` header (whole responses) or an SSE comment (streams), both of
which OpenAI clients ignore, and only for tenants that opted in (gateway.audit_tenants).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kev_async.gateway.errors import ApiError
from schemas import AnswerEvent

_JSON = msgspec.json.Encoder()

# Kev's finish_reason -> OpenAI's. "error" never gets here (it becomes an HTTP error); "cancelled"
# only reaches a client whose question someone else cancelled.
FINISH_REASONS = {"stop": "stop", "length": "length", "timeout": "length", "cancelled": "stop"}
# An error answer's code -> HTTP status (anything else: 500).
ERROR_STATUS = {"invalid_field": 400, "empty_prompt": 400, "too_large": 400, "prompt_too_long": 400,
                "bad_prompt": 400, "unsupported_schema": 400, "duplicate_question_id": 409,
                "unknown_adapter": 404, "adapter_error": 500, "overloaded": 429, "answer_too_large": 500}


def usage(answer: AnswerEvent, *, show_cached: bool = True) -> dict[str, Any]:
    """`show_cached=False` (anonymous callers): cached_tokens 0, so nobody learns about anyone's prefixes."""
    prompt, completion = answer.usage.prompt_tokens, answer.usage.completion_tokens
    cached = answer.usage.cached_prompt_tokens if show_cached else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_reason(answer: AnswerEvent) -> str:
    return FINISH_REASONS.get(answer.finish_reason, "stop")


def raise_for_error(answer: AnswerEvent) -> None:
    """An error answer becomes the HTTP error its code stands for."""
    if answer.finish_reason != "error":
        return
    code = answer.error.code if answer.error else "error"
    message = answer.error.message if answer.error else "the worker could not answer"
    if code == "prompt_too_long":
        raise ApiError(400, message, param="messages", code="context_length_exceeded")
    if code == "unknown_adapter":
        raise ApiError(404, message, param="model", code="model_not_found")
    raise ApiError(ERROR_STATUS.get(code, 500), message, code=code)


def chat_completion(answer: AnswerEvent, *, id_: str, model: str, created: int,
                    show_cached: bool = True) -> dict[str, Any]:
    return {"id": id_, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.text, "refusal": None},
                         "logprobs": None, "finish_reason": finish_reason(answer)}],
            "usage": usage(answer, show_cached=show_cached), "system_fingerprint": None}


def text_completion(answer: AnswerEvent, *, id_: str, model: str, created: int,
                    show_cached: bool = True) -> dict[str, Any]:
    return {"id": id_, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": answer.text, "logprobs": None, "finish_reason": finish_reason(answer)}],
            "usage": usage(answer, show_cached=show_cached), "system_fingerprint": None}


class ChunkMaker:
    """The chunks of one streamed answer, in one of the two streaming shapes."""

    def __init__(self, *, chat: bool, id_: str, model: str, created: int) -> None:
        self.chat = chat
        self.head = {"id": id_, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model, "system_fingerprint": None}

    def first(self) -> dict[str, Any] | None:
        """OpenAI opens a chat stream with the role and empty content; completions have no opener."""
        return self._choice({"role": "assistant", "content": ""}, None) if self.chat else None

    def text(self, text: str) -> dict[str, Any]:
        return self._choice({"content": text} if self.chat else text, None)

    def last(self, answer: AnswerEvent) -> dict[str, Any]:
        return self._choice({} if self.chat else "", finish_reason(answer))

    def usage(self, answer: AnswerEvent, *, show_cached: bool = True) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": usage(answer, show_cached=show_cached)}

    def _choice(self, delta: Any, reason: str | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
        return {**self.head, "choices": [choice]}


def kev_headers(answer: AnswerEvent, *, audit: bool) -> dict[str, str]:
    """Kev's own view of the answer, as ASCII header values; the audit (worker, blocks, batch sizes) only when
    the caller's tenant opted in (gateway.audit_tenants)."""
    headers = {"x-kev-finish-reason": answer.finish_reason}
    if audit:
        headers["x-kev-audit"] = audit_json(answer)
    return headers


def audit_json(answer: AnswerEvent) -> str:
    return ascii_json({"finish_reason": answer.finish_reason, "audit": msgspec.to_builtins(answer.audit),
                       "timings": msgspec.to_builtins(answer.timings)})


def ascii_json(data: Any) -> str:
    # msgspec is ~5x faster than json; it writes non-ASCII as UTF-8, which a header value cannot carry.
    raw = _JSON.encode(data)
    if raw.isascii():
        return raw.decode()
    return json.dumps(data, ensure_ascii=True, separators=(",", ":"))


def sse(data: Any) -> bytes:
    return b"data: " + _JSON.encode(data) + b"\n\n"  # an event stream is UTF-8


SSE_DONE = b"data: [DONE]\n\n"
