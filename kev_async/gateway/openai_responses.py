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
from schemas import AnswerEvent, TokenLogprob

_JSON = msgspec.json.Encoder()

# Kev's finish_reason -> OpenAI's. "error" never gets here (it becomes an HTTP error); "cancelled"
# only reaches a client whose question someone else cancelled.
FINISH_REASONS = {"stop": "stop", "length": "length", "timeout": "length", "cancelled": "stop"}
# An error answer's code -> HTTP status (anything else: 500).
ERROR_STATUS = {"invalid_field": 400, "empty_prompt": 400, "too_large": 400, "prompt_too_long": 400,
                "bad_prompt": 400, "unsupported_schema": 400, "duplicate_question_id": 409,
                "unknown_adapter": 404, "adapter_error": 500, "overloaded": 429, "answer_too_large": 500}


def usage(answers: AnswerEvent | list[AnswerEvent], *, show_cached: bool = True) -> dict[str, Any]:
    """The prompt once, the completions of every sample (params.n) summed, as OpenAI counts n choices.
    `show_cached=False` (anonymous callers): cached_tokens 0, so nobody learns about anyone's prefixes."""
    answers = answers if isinstance(answers, list) else [answers]
    prompt = answers[0].usage.prompt_tokens
    completion = sum(answer.usage.completion_tokens for answer in answers)
    cached = answers[0].usage.cached_prompt_tokens if show_cached else 0
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


def chat_completion(answers: list[AnswerEvent], *, id_: str, model: str, created: int,
                    show_cached: bool = True) -> dict[str, Any]:
    """One choice per sample (params.n), by index."""
    choices = [{"index": a.index, "message": {"role": "assistant", "content": a.text, "refusal": None},
                "logprobs": chat_logprobs(a.logprobs), "finish_reason": finish_reason(a)} for a in answers]
    return {"id": id_, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(answers, show_cached=show_cached), "system_fingerprint": None}


def text_completion(answers: list[AnswerEvent], *, id_: str, model: str, created: int,
                    show_cached: bool = True) -> dict[str, Any]:
    choices = [{"index": a.index, "text": a.text, "logprobs": completion_logprobs(a.logprobs),
                "finish_reason": finish_reason(a)} for a in answers]
    return {"id": id_, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(answers, show_cached=show_cached), "system_fingerprint": None}


def chat_logprobs(entries: tuple[TokenLogprob, ...] | None) -> dict[str, Any] | None:
    """OpenAI's chat shape: per token its text, logprob, UTF-8 bytes and top_logprobs alike."""
    if entries is None:
        return None
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
                         "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}
                                          for t in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: tuple[TokenLogprob, ...] | None, offset: int = 0) -> dict[str, Any] | None:
    """The legacy completions shape: parallel lists, top_logprobs a {token text: logprob} dict per token, and
    each token's character offset in the text (from `offset`: a stream's characters sent before)."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries], "text_offset": offsets}


class ChunkMaker:
    """The chunks of one streamed answer, in one of the two streaming shapes; a choice per sample (params.n)."""

    def __init__(self, *, chat: bool, id_: str, model: str, created: int) -> None:
        self.chat = chat
        self.head = {"id": id_, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model, "system_fingerprint": None}
        self._offsets: dict[int, int] = {}  # sample -> characters of token text sent (completions' text_offset)

    def first(self, index: int = 0) -> dict[str, Any] | None:
        """OpenAI opens a chat stream with the role and empty content; completions have no opener."""
        return self._choice(index, {"role": "assistant", "content": ""}, None) if self.chat else None

    def text(self, text: str, index: int = 0, logprobs: tuple[TokenLogprob, ...] | None = None) -> dict[str, Any]:
        return self._choice(index, {"content": text} if self.chat else text, None, logprobs)

    def delta(self, delta: dict[str, Any], index: int = 0,
              logprobs: tuple[TokenLogprob, ...] | None = None) -> dict[str, Any]:
        """A chat chunk of any delta: content, or tool_calls (tool_calls.py)."""
        return self._choice(index, delta, None, logprobs)

    def last(self, answer: AnswerEvent, reason: str | None = None,
             logprobs: tuple[TokenLogprob, ...] | None = None) -> dict[str, Any]:
        return self._choice(answer.index, {} if self.chat else "", reason or finish_reason(answer), logprobs)

    def usage(self, answers: list[AnswerEvent], *, show_cached: bool = True) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": usage(answers, show_cached=show_cached)}

    def _choice(self, index: int, delta: Any, reason: str | None,
                logprobs: tuple[TokenLogprob, ...] | None = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs), "finish_reason": reason}
        else:
            shown = completion_logprobs(logprobs, self._offsets.get(index, 0))
            if logprobs:
                self._offsets[index] = self._offsets.get(index, 0) + sum(len(e.token) for e in logprobs)
            choice = {"index": index, "text": delta, "logprobs": shown, "finish_reason": reason}
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
