"""Question events, the input side of the wire: a prompt or messages plus per-question sampling.

`decode_question` is the one gate for untrusted input; its two exceptions split bad events into
those that go to the dead-letter topic (`UndecodableEvent`) and those that get an error answer
(`InvalidQuestion`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from schemas._validation import (
    MaxNewTokens,
    RepetitionPenalty,
    Seed,
    StopStrings,
    Temperature,
    TopK,
    TopP,
    explain,
    show,
)
from schemas.wire import (
    ANY_DECODER,
    SCHEMA_VERSION,
    SUPPORTED_SCHEMAS,
    UndecodableEvent,
    as_utf8_bytes,
    json_kind,
    unparseable,
)

QuestionId = Annotated[str, Meta(min_length=1, max_length=256)]
Priority = Annotated[int, Meta(ge=-100, le=100)]
TimeoutMs = Annotated[int, Meta(ge=1, le=86_400_000)]


class Message(Struct, frozen=True):
    role: Literal["system", "user", "assistant"]
    content: str


class Params(Struct, frozen=True, omit_defaults=True):
    """Per-question sampling; None means "use the engine's default"."""

    max_new_tokens: MaxNewTokens | None = None
    temperature: Temperature | None = None  # 0 = greedy
    top_p: TopP | None = None
    top_k: TopK | None = None  # 0 = off
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    stop: StopStrings = ()


class QuestionEvent(Struct, frozen=True, omit_defaults=True):
    question_id: QuestionId
    prompt: str | None = None  # exactly one of prompt / messages
    messages: tuple[Message, ...] | None = None
    request_id: str | None = None
    tenant: str | None = None
    cache_salt: str | None = None  # prefix cache scope within the tenant: only equal salts share a prefix
    system: str | None = None
    params: Params = Params()
    adapter: str | None = None
    priority: Priority = 0  # higher first
    timeout_ms: TimeoutMs | None = None
    stream: bool = False
    reply_topic: str | None = None
    schema: int = SCHEMA_VERSION


class InvalidQuestion(Exception):
    """A question we can name but not run; the asker gets an error answer."""

    def __init__(self, question_id: str, request_id: str | None, code: str, message: str) -> None:
        super().__init__(message)
        self.question_id = question_id
        self.request_id = request_id
        self.code = code  # invalid_field | empty_prompt | unsupported_schema | too_large
        self.message = message


_QUESTION_DECODER = msgspec.json.Decoder(QuestionEvent)


class _Envelope(Struct):
    """Just enough of a question to address a reply; parses events too large to trust."""

    question_id: Any = None
    request_id: Any = None


_ENVELOPE_DECODER = msgspec.json.Decoder(_Envelope)


def decode_question(
    raw: bytes | str, *, max_bytes: int = 1_000_000, max_prompt_chars: int = 200_000
) -> QuestionEvent:
    """Decode and validate one question event; raise UndecodableEvent or InvalidQuestion."""
    data = as_utf8_bytes(raw)
    if len(data) > max_bytes:
        _reject_oversized(data, max_bytes)
    try:
        question = _QUESTION_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise _classify_failure(data, error) from None
    _check_schema(question.schema, question.question_id, question.request_id)
    _check_prompt(question, max_prompt_chars)
    return question


def _reject_oversized(data: bytes, max_bytes: int) -> None:
    # Still find the question_id if we can: an error answer beats a silent dead letter.
    message = f"event is {len(data)} bytes, at most {max_bytes} allowed"
    try:
        envelope = _ENVELOPE_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise UndecodableEvent("too_large", message) from None
    if not _usable_id(envelope.question_id):
        raise UndecodableEvent("too_large", message)
    raise InvalidQuestion(envelope.question_id, _str_or_none(envelope.request_id), "too_large", message)


def _classify_failure(data: bytes, error: Exception) -> Exception:
    """Re-read a failed event loosely to tell a dead letter from an answerable mistake."""
    try:
        tree = ANY_DECODER.decode(data)
    except msgspec.DecodeError as parse_error:
        return unparseable(data, parse_error)
    if not isinstance(tree, dict):
        return UndecodableEvent("not_object", f"expected a JSON object, got {json_kind(tree)}")
    question_id, request_id = _address(tree)
    _check_schema(tree.get("schema", SCHEMA_VERSION), question_id, request_id)
    path, reason = explain(error, tree, QuestionEvent)
    return InvalidQuestion(question_id, request_id, "invalid_field", f"{path}: {reason}")


def _address(tree: dict) -> tuple[str, str | None]:
    question_id = tree.get("question_id")
    if question_id is None:
        raise UndecodableEvent("missing_question_id", "question_id: missing required field")
    if not _usable_id(question_id):
        raise UndecodableEvent(
            "missing_question_id", f"question_id: expected a non-empty string, got {show(question_id)}"
        )
    return question_id, _str_or_none(tree.get("request_id"))


def _check_schema(schema: Any, question_id: str, request_id: str | None) -> None:
    if isinstance(schema, bool) or schema not in SUPPORTED_SCHEMAS:
        supported = ", ".join(str(v) for v in sorted(SUPPORTED_SCHEMAS))
        raise InvalidQuestion(
            question_id, request_id, "unsupported_schema",
            f"schema: version {show(schema)} is not supported (supported: {supported})",
        )


def _check_prompt(question: QuestionEvent, max_prompt_chars: int) -> None:
    def invalid(code: str, message: str) -> InvalidQuestion:
        return InvalidQuestion(question.question_id, question.request_id, code, message)

    if question.prompt is None and question.messages is None:
        raise invalid("empty_prompt", "prompt: missing; give prompt or messages")
    if question.prompt is not None and question.messages is not None:
        raise invalid("invalid_field", "prompt, messages: give one of them, not both")
    if question.prompt is not None and not question.prompt.strip():
        raise invalid("empty_prompt", "prompt: empty" if not question.prompt else "prompt: only whitespace")
    if question.messages is not None and not any(m.content.strip() for m in question.messages):
        raise invalid("empty_prompt", "messages: empty; need at least one message with content")
    size = _prompt_chars(question)
    if size > max_prompt_chars:
        raise invalid("too_large", f"prompt: {size} characters, at most {max_prompt_chars} allowed")


def _prompt_chars(question: QuestionEvent) -> int:
    messages = question.messages or ()
    return len(question.prompt or "") + len(question.system or "") + sum(len(m.content) for m in messages)


def _usable_id(value: Any) -> bool:
    return isinstance(value, str) and value != ""


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None
