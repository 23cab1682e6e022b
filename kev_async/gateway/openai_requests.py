"""OpenAI request bodies (chat and legacy completions) as frozen msgspec Structs, and their translation
into Kev's QuestionEvent.

Unknown fields are rejected, as OpenAI does ("Unrecognized request argument supplied"). Fields OpenAI
has and Kev cannot honour (penalties, best_of, echo, tools, ...) are accepted only at their neutral
value; anything else is a 400 naming the field, so a client never gets an answer that silently
ignored what it asked for. `tools` and `tool_choice` are tools.py's, and the conversation's tool calls and
tool messages travel as the question's own. The finished question goes through `decode_question`, the same gate a
worker applies, so whatever a worker would refuse is refused here, before anything is published.
`response_format` (chat and completions, as vLLM takes it) becomes the question's own, and
`check_response_format` compiles its grammar text (no tokenizer) so a bad schema is a 400 too.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec
from msgspec import Struct

from kev_async.gateway.errors import ApiError, bad_request
from kev_async.gateway.tools import question_fields, tool_use
from schemas import InvalidQuestion, QuestionEvent, UndecodableEvent, decode_question
from schemas.constraint import InvalidConstraint, check

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat uses Kev's own default


class StreamOptions(Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool = False


class ChatMessage(Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class _Common(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None  # None: the served model (as vLLM and llama.cpp's server take it)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Kev extensions, spelled as vLLM spells them; OpenAI clients send them through `extra_body`.
    top_k: int | None = None
    repetition_penalty: float | None = None
    allow_identical_samples: bool | None = None  # n > 1 at temperature 0: n identical answers, if that is meant
    logprobs_mode: Literal["raw", "processed"] | None = None  # raw (the model's, the default) or processed
    # Accepted and ignored: they change nothing about the answer (`user` is NOT the tenant).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # text | json_object | json_schema, and Kev's regex | grammar (docs/structured.md)
    response_format: dict[str, Any] | None = None


class ChatRequest(_Common, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None


class CompletionRequest(_Common, frozen=True, kw_only=True):
    prompt: str | list[Any]
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None


# field -> is this value one Kev honours by doing nothing?
_NEUTRAL = {
    "best_of": lambda v: v in (None, 1),
    "frequency_penalty": lambda v: not v,
    "presence_penalty": lambda v: not v,
    "logit_bias": lambda v: not v,
    "echo": lambda v: not v,
    "suffix": lambda v: not v,
    "functions": lambda v: not v,  # the deprecated spelling of tools: give `tools`
    "function_call": lambda v: v in (None, "none", "auto"),
    "reasoning_effort": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
}
_DECODERS = {ChatRequest: msgspec.json.Decoder(ChatRequest), CompletionRequest: msgspec.json.Decoder(CompletionRequest)}
_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]+)`$")
_MISSING = re.compile(r"Object missing required field `(?P<name>[^`]+)`")
# Kev's question fields, named as the OpenAI request names them.
_PARAM_NAMES = {"params.max_new_tokens": "max_tokens", "params.temperature": "temperature", "params.top_p": "top_p",
                "params.top_k": "top_k", "params.seed": "seed", "params.repetition_penalty": "repetition_penalty",
                "params.stop": "stop", "adapter": "model", "params.n": "n", "params.logprobs": "logprobs",
                "params.top_logprobs": "top_logprobs", "params.logprobs_mode": "logprobs_mode",
                "params.allow_identical_samples": "allow_identical_samples"}


def parse_request(body: bytes, kind: type[ChatRequest] | type[CompletionRequest]) -> ChatRequest | CompletionRequest:
    """Decode a request body; any problem is a 400 in OpenAI's words, naming the field."""
    try:
        request = _DECODERS[kind].decode(body)
    except msgspec.ValidationError as error:  # a subclass of DecodeError: first
        raise _invalid_field(str(error)) from None
    except msgspec.DecodeError as error:
        raise bad_request(f"We could not parse the JSON body of your request. ({error})", code="invalid_json") from None
    except RecursionError:  # msgspec's own depth limit, on the free-form fields (tools, content parts, ...)
        raise bad_request("The JSON body of your request is nested too deeply.", code="invalid_json") from None
    for field, neutral in _NEUTRAL.items():
        value = getattr(request, field, None)
        if not neutral(value):
            raise bad_request(f"{field}={_shown(value)} is not supported by Kev", param=field, code="unsupported_value")
    if isinstance(request, ChatRequest):
        tool_use(request)  # a 400 now for malformed tools or a tool_choice naming none of them
    return request


def to_question(request: ChatRequest | CompletionRequest, *, question_id: str, tenant: str | None,
                reply_topic: str, timeout_ms: int, adapter: str | None, max_prompt_chars: int,
                cache_salt: str | None = None) -> QuestionEvent:
    """The QuestionEvent a worker will answer, checked by the workers' own gate."""
    event: dict[str, Any] = {"question_id": question_id, "params": _params(request), "timeout_ms": timeout_ms,
                             "stream": bool(request.stream), "reply_topic": reply_topic}
    if tenant is not None:
        event["tenant"] = tenant
    if cache_salt is not None:
        event["cache_salt"] = cache_salt
    if adapter is not None:
        event["adapter"] = adapter
    if isinstance(request, ChatRequest):
        event["messages"] = [_message(i, m) for i, m in enumerate(request.messages)]
        tools = question_fields(request)
        if "response_format" in tools:
            event["params"]["response_format"] = tools.pop("response_format")
        event.update(tools)
    else:  # a plain continuation of the prompt, as OpenAI's and llama.cpp's /v1/completions are
        event["prompt"], event["raw"] = _prompt(request.prompt), True
    try:
        return decode_question(msgspec.json.encode(event), max_prompt_chars=max_prompt_chars)
    except InvalidQuestion as bad:
        raise _refused(bad, chat=isinstance(request, ChatRequest)) from None
    except UndecodableEvent as bad:  # only a gateway bug gets here
        raise ApiError(500, f"the gateway built an undecodable question: {bad}", code="internal_error") from None


def check_response_format(question: QuestionEvent) -> None:
    """A 400 when the question's response_format does not compile (milliseconds for a typical schema:
    the app runs it on a worker thread)."""
    try:
        check(question.params.response_format)
    except InvalidConstraint as bad:
        where = bad.where.removeprefix("params.")
        raise bad_request(f"Invalid {where}: {bad.reason}", param="response_format", code="invalid_field") from None


def wants_usage_in_stream(request: ChatRequest | CompletionRequest) -> bool:
    return request.stream_options is not None and request.stream_options.include_usage


def _params(request: ChatRequest | CompletionRequest) -> dict[str, Any]:
    max_tokens = request.max_tokens
    if isinstance(request, ChatRequest) and request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
    if isinstance(request, CompletionRequest) and max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    params = {"max_new_tokens": max_tokens, "temperature": request.temperature, "top_p": request.top_p,
              "seed": request.seed, "top_k": request.top_k, "repetition_penalty": request.repetition_penalty,
              "stop": stop, "response_format": request.response_format, "n": request.n,
              "allow_identical_samples": request.allow_identical_samples, "logprobs_mode": request.logprobs_mode,
              **_logprobs(request)}
    return {key: value for key, value in params.items() if value is not None}


def _logprobs(request: ChatRequest | CompletionRequest) -> dict[str, Any]:
    """Chat: logprobs (bool) and top_logprobs (0..20); completions: logprobs, the number of alternatives."""
    if isinstance(request, ChatRequest):
        return {"logprobs": request.logprobs or None, "top_logprobs": request.top_logprobs}
    if request.logprobs is None:
        return {}
    return {"logprobs": True, "top_logprobs": request.logprobs}


def _message(index: int, message: ChatMessage) -> dict[str, Any]:
    where = f"messages[{index}]"
    if message.role == "function":
        raise bad_request(f"{where}: function messages (the deprecated form) are not supported by Kev; use tool "
                          f"messages", param=where, code="unsupported_value")
    if message.tool_calls and message.role != "assistant":
        raise bad_request(f"{where}.tool_calls: only assistant messages make calls", param=f"{where}.tool_calls")
    if message.role == "tool" and not message.tool_call_id:
        raise bad_request(f"{where}.tool_call_id: missing: a tool message answers a call",
                          param=f"{where}.tool_call_id", code="missing_required_parameter")
    if message.content is None and not message.tool_calls:
        raise bad_request(f"{where}.content: missing", param=f"{where}.content")
    role = "system" if message.role == "developer" else message.role  # OpenAI's new name for the same thing
    out: dict[str, Any] = {"role": role, "content": _text(message.content or "", f"{where}.content")}
    if message.tool_calls:
        out["tool_calls"] = message.tool_calls
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
    return out


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{i}]: only text parts are supported by Kev (got type "
                              f"{_shown(part.get('type'), 40)})", param=f"{where}[{i}]", code="unsupported_value")
        texts.append(part["text"])
    return "\n".join(texts)


def _prompt(prompt: str | list[Any]) -> str:
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise bad_request("prompt: give one string; batches of prompts and token-id prompts are not supported by Kev",
                      param="prompt", code="unsupported_value")


def _shown(value: Any, limit: int = 100) -> str:
    """A short JSON rendering of a client's value for an error message; never fails on odd input."""
    try:
        return msgspec.json.encode(value).decode()[:limit]
    except (RecursionError, TypeError, ValueError):
        return type(value).__name__


def _invalid_field(message: str) -> ApiError:
    match = _AT.match(message)
    reason, path = match["msg"], match["path"] or None
    unknown = _UNKNOWN.match(reason)
    if unknown:
        name = f"{path}.{unknown['name']}" if path else unknown["name"]
        return bad_request(f"Unrecognized request argument supplied: {name}", param=name,
                           code="unrecognized_argument")
    if missing := _MISSING.match(reason):
        name = f"{path}.{missing['name']}" if path else missing["name"]
        return bad_request(f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")
    return bad_request(f"{path}: {reason}" if path else reason, param=path, code="invalid_type")


def _refused(bad: InvalidQuestion, *, chat: bool) -> ApiError:
    field, _, reason = bad.message.partition(": ")
    if field.startswith("params.response_format"):  # the request's own field, with the path inside it
        return bad_request(f"{field.removeprefix('params.')}: {reason}", param="response_format", code=bad.code)
    param = _PARAM_NAMES.get(field, field.split(".")[0].split("[")[0] or None)
    if chat and param == "prompt":  # the worker's gate counts the messages as the prompt
        param = "messages"
    if not chat and param == "top_logprobs":  # /v1/completions names the count `logprobs`
        param = "logprobs"
    reason = reason.replace("params.", "")  # the request's own names
    message = f"{param}: {reason}" if reason and param != field else bad.message
    code = "context_length_exceeded" if bad.code == "too_large" else bad.code
    return bad_request(message, param=param, code=code)
