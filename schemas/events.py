"""Wire events: questions in, answers and streaming deltas out, runtime commands on the control topic
(JSON, frozen msgspec Structs).

`decode_question` is the one gate for untrusted input; its two exceptions split bad events into
those that go to the dead-letter topic and those that get an error answer. `decode_control` is the
gate for control commands; it raises `InvalidControl`, and the reader skips such records.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

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

FinishReason = Literal["stop", "length", "timeout", "cancelled", "error"]
SCHEMA_VERSION = 1
SUPPORTED_SCHEMAS = frozenset({1})

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
    system: str | None = None
    params: Params = Params()
    adapter: str | None = None
    priority: Priority = 0  # higher first
    timeout_ms: TimeoutMs | None = None
    stream: bool = False
    reply_topic: str | None = None
    schema: int = SCHEMA_VERSION


class ErrorInfo(Struct, frozen=True):
    code: str
    message: str


class Usage(Struct, frozen=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Timings(Struct, frozen=True):
    queued_ms: float = 0.0
    ttft_ms: float | None = None
    e2e_ms: float = 0.0


class Audit(Struct, frozen=True):
    """Where and how an answer was computed, for debugging isolation after the fact."""

    worker: str = ""
    channel: int | None = None
    blocks: tuple[int, ...] = ()
    steps: int = 0
    batch_sizes: tuple[int, ...] = ()
    routing_bucket: int | None = None
    adapter: str | None = None
    defaults_version: int = 0


class AnswerEvent(Struct, frozen=True):
    question_id: str
    request_id: str | None = None
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason = "stop"
    error: ErrorInfo | None = None
    usage: Usage = Usage()
    timings: Timings = Timings()
    audit: Audit = Audit()
    schema: int = SCHEMA_VERSION


class AnswerDelta(Struct, frozen=True):
    question_id: str
    seq: int
    text: str
    done: bool = False


ControlAction = Literal["load_adapter", "unload_adapter", "update_defaults"]
AdapterName = Annotated[str, Meta(min_length=1, max_length=256)]
AdapterPath = Annotated[str, Meta(min_length=1, max_length=4096)]


class ControlEvent(Struct, frozen=True, omit_defaults=True):
    """A runtime command on the control topic, applied by every worker while it serves.

    - load_adapter: `name` and `path` (a PEFT LoRA directory as the worker sees it); loading a name
      again replaces it (a new version; questions in flight keep theirs)
    - unload_adapter: `name`; new questions naming it get `unknown_adapter`
    - update_defaults: `defaults`, e.g. {"temperature": 0.7}: new engine-wide sampling defaults for
      questions admitted from now on (keys: see DEFAULTS_KEYS)
    """

    action: ControlAction
    name: AdapterName | None = None
    path: AdapterPath | None = None
    defaults: dict[str, float | int] | None = None
    schema: int = SCHEMA_VERSION


class _DefaultsChanges(Struct, forbid_unknown_fields=True):
    """The keys `update_defaults` may change, with the limits per-question Params have."""

    max_new_tokens: MaxNewTokens | UnsetType = UNSET  # UNSET, not None: a null is not a default to set
    temperature: Temperature | UnsetType = UNSET
    top_p: TopP | UnsetType = UNSET
    top_k: TopK | UnsetType = UNSET
    repetition_penalty: RepetitionPenalty | UnsetType = UNSET
    seed: Seed | UnsetType = UNSET


DEFAULTS_KEYS = tuple(_DefaultsChanges.__struct_fields__)
# Which of name / path / defaults each action needs; the others must be left out.
_CONTROL_FIELDS = {"load_adapter": ("name", "path"), "unload_adapter": ("name",), "update_defaults": ("defaults",)}


class UndecodableEvent(Exception):
    """No usable question_id: nobody can be answered, so the raw event goes to the DLQ."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason  # not_utf8 | not_json | not_object | missing_question_id | too_large
        self.message = message


class InvalidQuestion(Exception):
    """A question we can name but not run; the asker gets an error answer."""

    def __init__(self, question_id: str, request_id: str | None, code: str, message: str) -> None:
        super().__init__(message)
        self.question_id = question_id
        self.request_id = request_id
        self.code = code  # invalid_field | empty_prompt | unsupported_schema | too_large
        self.message = message


class InvalidControl(Exception):
    """A control record that cannot be applied; the reader logs it and skips it."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason  # not_utf8 | not_json | not_object | invalid_field | unsupported_schema | too_large
        self.message = message


_ENCODER = msgspec.json.Encoder()
_QUESTION_DECODER = msgspec.json.Decoder(QuestionEvent)
_ANSWER_DECODER = msgspec.json.Decoder(AnswerEvent)
_DELTA_DECODER = msgspec.json.Decoder(AnswerDelta)
_ANY_DECODER = msgspec.json.Decoder()
_CONTROL_DECODER = msgspec.json.Decoder(ControlEvent)


class _Envelope(Struct):
    """Just enough of a question to address a reply; parses events too large to trust."""

    question_id: Any = None
    request_id: Any = None


_ENVELOPE_DECODER = msgspec.json.Decoder(_Envelope)


def encode(obj: Struct) -> bytes:
    return _ENCODER.encode(obj)


def decode_answer(raw: bytes | str) -> AnswerEvent:
    return _ANSWER_DECODER.decode(raw)


def decode_delta(raw: bytes | str) -> AnswerDelta:
    return _DELTA_DECODER.decode(raw)


def error_answer(question_id: str, request_id: str | None, code: str, message: str) -> AnswerEvent:
    return AnswerEvent(
        question_id=question_id,
        request_id=request_id,
        finish_reason="error",
        error=ErrorInfo(code=code, message=message),
    )


def decode_question(
    raw: bytes | str, *, max_bytes: int = 1_000_000, max_prompt_chars: int = 200_000
) -> QuestionEvent:
    """Decode and validate one question event; raise UndecodableEvent or InvalidQuestion."""
    data = _as_utf8_bytes(raw)
    if len(data) > max_bytes:
        _reject_oversized(data, max_bytes)
    try:
        question = _QUESTION_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise _classify_failure(data, error) from None
    _check_schema(question.schema, question.question_id, question.request_id)
    _check_prompt(question, max_prompt_chars)
    return question


def decode_control(raw: bytes | str, *, max_bytes: int = 65_536) -> ControlEvent:
    """Decode and validate one control command; raise InvalidControl saying what is wrong.

    The defaults of update_defaults come back checked and normalised (temperature 1 -> 1.0).
    """
    try:
        data = _as_utf8_bytes(raw)
    except UndecodableEvent as bad:
        raise InvalidControl(bad.reason, bad.message) from None
    if len(data) > max_bytes:
        raise InvalidControl("too_large", f"event is {len(data)} bytes, at most {max_bytes} allowed")
    try:
        event = _CONTROL_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise _classify_control_failure(data, error) from None
    _check_control_schema(event.schema)
    return _check_control_fields(event)


def _classify_control_failure(data: bytes, error: Exception) -> InvalidControl:
    try:
        tree = _ANY_DECODER.decode(data)
    except msgspec.DecodeError as parse_error:
        bad = _unparseable(data, parse_error)
        return InvalidControl(bad.reason, bad.message)
    if not isinstance(tree, dict):
        return InvalidControl("not_object", f"expected a JSON object, got {_json_kind(tree)}")
    _check_control_schema(tree.get("schema", SCHEMA_VERSION))
    if isinstance(tree.get("defaults"), dict):
        _check_defaults(tree["defaults"])  # names the key at fault, which the dict's own error cannot
    path, reason = explain(error, tree, ControlEvent)
    return InvalidControl("invalid_field", f"{path}: {reason}")


def _check_control_schema(schema: Any) -> None:
    if isinstance(schema, bool) or schema not in SUPPORTED_SCHEMAS:
        supported = ", ".join(str(v) for v in sorted(SUPPORTED_SCHEMAS))
        raise InvalidControl("unsupported_schema",
                             f"schema: version {show(schema)} is not supported (supported: {supported})")


def _check_control_fields(event: ControlEvent) -> ControlEvent:
    """Each action's fields present, the others absent; defaults checked against their limits."""
    needed = _CONTROL_FIELDS[event.action]
    for field_name in ("name", "path", "defaults"):
        given = getattr(event, field_name) is not None
        if field_name in needed and not given:
            raise InvalidControl("invalid_field", f"{field_name}: missing; {event.action} needs "
                                                  f"{' and '.join(needed)}")
        if field_name not in needed and given:
            raise InvalidControl("invalid_field", f"{field_name}: not used by {event.action} "
                                                  f"(it takes {' and '.join(needed)})")
    if event.defaults is None:
        return event
    return msgspec.structs.replace(event, defaults=_check_defaults(event.defaults))


def _check_defaults(defaults: dict) -> dict[str, float | int]:
    """The changes checked against the limits per-question Params have, floats as floats."""
    if not defaults:
        raise InvalidControl("invalid_field", f"defaults: empty; give at least one of {', '.join(DEFAULTS_KEYS)}")
    try:
        checked = msgspec.convert(defaults, _DefaultsChanges)
    except msgspec.ValidationError as error:
        path, reason = explain(error, defaults, _DefaultsChanges)
        raise InvalidControl("invalid_field", f"defaults.{path}: {reason}") from None
    return {key: getattr(checked, key) for key in DEFAULTS_KEYS if key in defaults}


def _as_utf8_bytes(raw: bytes | str) -> bytes:
    if isinstance(raw, bytes):
        return raw
    try:
        return raw.encode("utf-8")
    except UnicodeEncodeError as error:  # lone surrogates in a str
        raise UndecodableEvent("not_utf8", f"not valid UTF-8: {error.reason}") from None


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
        tree = _ANY_DECODER.decode(data)
    except msgspec.DecodeError as parse_error:
        return _unparseable(data, parse_error)
    if not isinstance(tree, dict):
        return UndecodableEvent("not_object", f"expected a JSON object, got {_json_kind(tree)}")
    question_id, request_id = _address(tree)
    _check_schema(tree.get("schema", SCHEMA_VERSION), question_id, request_id)
    path, reason = explain(error, tree, QuestionEvent)
    return InvalidQuestion(question_id, request_id, "invalid_field", f"{path}: {reason}")


def _unparseable(data: bytes, error: msgspec.DecodeError) -> UndecodableEvent:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as utf8_error:
        return UndecodableEvent("not_utf8", f"not valid UTF-8 at byte {utf8_error.start}")
    return UndecodableEvent("not_json", f"not valid JSON: {error}")


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


def _json_kind(value: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")
