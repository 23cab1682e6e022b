"""`decode_question`: the one gate for untrusted input on the questions topic.

Its two exceptions split bad events into those that go to the dead-letter topic (`UndecodableEvent`)
and those that get an error answer (`InvalidQuestion`). Besides the types' hard ceilings
(schemas/questions.py), `kafka.limits` (LimitsConfig) holds tighter, configured ones. A question_id is
usable for an error answer only within its ceiling, so an answer never carries an unbounded id.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from schemas._validation import ID_CHARS_CEILING, TOPIC_CHARS_CEILING, explain, show
from schemas.kafka_config import LimitsConfig
from schemas.questions import MAX_UNKNOWN_FIELDS, Params, QuestionEvent
from schemas.response_format import constraint_chars
from schemas.wire import (
    ANY_DECODER,
    SCHEMA_VERSION,
    SUPPORTED_SCHEMAS,
    UndecodableEvent,
    as_utf8_bytes,
    json_kind,
    unparseable,
)

class InvalidQuestion(Exception):
    """A question we can name but not run; the asker gets an error answer."""

    def __init__(self, question_id: str, request_id: str | None, code: str, message: str,
                 reply_topic: Any = None) -> None:
        message = message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS - 3] + "..."
        super().__init__(message)
        self.question_id = question_id
        self.request_id = request_id
        self.code = code  # invalid_field | empty_prompt | unsupported_schema | too_large | not_utf8 | not_json
        self.message = message
        # The reply_topic the event named, if a string within the ceiling (None otherwise): where a signed
        # asker waits for this error answer (the intake checks the signature and the pattern).
        self.reply_topic = reply_topic if isinstance(reply_topic, str) and len(reply_topic) <= TOPIC_CHARS_CEILING \
            else None


MAX_ERROR_CHARS = 1000  # an error message goes into an answer: never an unbounded echo of the input
_DEFAULT_LIMITS = LimitsConfig()
_BOUNDED_IDS = ("question_id", "request_id", "tenant", "cache_salt", "adapter")


_QUESTION_DECODER = msgspec.json.Decoder(QuestionEvent)
# A second, shallow read of a decoded event for the keys msgspec skipped: values stay raw, unparsed.
_KEYS_DECODER = msgspec.json.Decoder(dict[str, msgspec.Raw])
_QUESTION_KEYS = frozenset(QuestionEvent.__struct_encode_fields__)
_PARAMS_KEYS = frozenset(Params.__struct_encode_fields__)


class _Envelope(Struct):
    """Just enough of a question to address a reply; parses events too large to trust."""

    question_id: Any = None
    request_id: Any = None
    reply_topic: Any = None


_ENVELOPE_DECODER = msgspec.json.Decoder(_Envelope)


def decode_question(
    raw: bytes | str,
    *,
    limits: LimitsConfig = _DEFAULT_LIMITS,
    max_bytes: int | None = None,  # overrides limits.max_event_bytes
    max_prompt_chars: int | None = None,  # overrides limits.max_prompt_chars
) -> QuestionEvent:
    """Decode and validate one question event; raise UndecodableEvent or InvalidQuestion.

    Nothing else escapes: not even JSON nested deeper than the decoder's recursion limit."""
    data = as_utf8_bytes(raw)
    max_bytes = limits.max_event_bytes if max_bytes is None else max_bytes
    if len(data) > max_bytes:
        _reject_oversized(data, max_bytes, limits)
    try:
        question = _QUESTION_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise _classify_failure(data, error, limits) from None
    except RecursionError:
        raise _too_deep() from None
    _check_schema(question.schema, question.question_id, _bounded(question.request_id, limits), question.reply_topic)
    _check_bounds(question, limits)
    _check_prompt(question, limits.max_prompt_chars if max_prompt_chars is None else max_prompt_chars)
    try:
        return _with_unknown_fields(question, data)
    except msgspec.DecodeError as error:
        # The question decoder skips unknown keys unread; the key reader checks them, and an unknown key
        # with bytes that are not UTF-8 fails only here. The question is named: an error answer.
        bad = unparseable(data, error)
        raise InvalidQuestion(question.question_id, _bounded(question.request_id, limits), bad.reason,
                              bad.message, question.reply_topic) from None


def _reject_oversized(data: bytes, max_bytes: int, limits: LimitsConfig) -> None:
    # Still find the question_id if we can: an error answer beats a silent dead letter.
    message = f"event is {len(data)} bytes, at most {max_bytes} allowed"
    try:
        envelope = _ENVELOPE_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        raise UndecodableEvent("too_large", message) from None
    if not _usable_id(envelope.question_id):
        raise UndecodableEvent("too_large", message)
    raise InvalidQuestion(envelope.question_id, _bounded(envelope.request_id, limits), "too_large", message,
                          envelope.reply_topic)


def _classify_failure(data: bytes, error: Exception, limits: LimitsConfig) -> Exception:
    """Re-read a failed event loosely to tell a dead letter from an answerable mistake."""
    try:
        tree = ANY_DECODER.decode(data)
    except msgspec.DecodeError as parse_error:
        return unparseable(data, parse_error)
    except RecursionError:
        return _too_deep()
    if not isinstance(tree, dict):
        return UndecodableEvent("not_object", f"expected a JSON object, got {json_kind(tree)}")
    question_id, request_id = _address(tree, limits)
    _check_schema(tree.get("schema", SCHEMA_VERSION), question_id, request_id, tree.get("reply_topic"))
    path, reason = explain(error, tree, QuestionEvent)
    return InvalidQuestion(question_id, request_id, "invalid_field", f"{path}: {reason}", tree.get("reply_topic"))


def _too_deep() -> UndecodableEvent:
    # msgspec gives up on nesting deeper than Python's recursion limit, even inside an unknown key,
    # and then no question_id can be read reliably: nobody to answer.
    return UndecodableEvent("too_deep", "JSON nested too deeply to decode")


def _address(tree: dict, limits: LimitsConfig) -> tuple[str, str | None]:
    question_id = tree.get("question_id")
    if question_id is None:
        raise UndecodableEvent("missing_question_id", "question_id: missing required field")
    if isinstance(question_id, str) and len(question_id) > ID_CHARS_CEILING:
        raise UndecodableEvent("unusable_question_id", f"question_id: {len(question_id)} characters, "
                                                       f"at most {ID_CHARS_CEILING} allowed")
    if not _usable_id(question_id):
        raise UndecodableEvent(
            "missing_question_id", f"question_id: expected a non-empty string, got {show(question_id)}"
        )
    return question_id, _bounded(tree.get("request_id"), limits)


def _check_bounds(question: QuestionEvent, limits: LimitsConfig) -> None:
    """The configured bounds, tighter than the types' ceilings."""
    request_id, reply_topic = _bounded(question.request_id, limits), question.reply_topic
    for name in _BOUNDED_IDS:
        value = getattr(question, name)
        if value is not None and len(value) > limits.max_id_chars:
            raise InvalidQuestion(question.question_id, request_id, "invalid_field",
                                  f"{name}: {len(value)} characters, at most {limits.max_id_chars} allowed",
                                  reply_topic)
    if question.messages is not None and len(question.messages) > limits.max_messages:
        raise InvalidQuestion(question.question_id, request_id, "invalid_field",
                              f"messages: {len(question.messages)} items, at most {limits.max_messages} allowed",
                              reply_topic)
    _check_samples(question, request_id, reply_topic)
    size = constraint_chars(question.params.response_format)
    if size > limits.max_constraint_chars:
        raise InvalidQuestion(question.question_id, request_id, "invalid_field",
                              f"params.response_format: {size} characters, at most {limits.max_constraint_chars} "
                              f"allowed", reply_topic)


def _check_samples(question: QuestionEvent, request_id: str | None, reply_topic: str | None) -> None:
    """logprobs' and n's rules between fields; a greedy n > 1 left to the defaults is the engine's to refuse."""
    params = question.params
    problem = None
    if params.top_logprobs and not params.logprobs:
        problem = "params.top_logprobs: needs params.logprobs: true"
    elif params.logprobs_mode != "raw" and not params.logprobs:
        problem = "params.logprobs_mode: needs params.logprobs: true"
    elif params.n > 1 and params.temperature == 0 and not params.allow_identical_samples:
        problem = identical_samples_message(params.n)
    if problem is not None:
        raise InvalidQuestion(question.question_id, request_id, "invalid_field", problem, reply_topic)


def identical_samples_message(n: int) -> str:
    return (f"params.n: {n} samples at temperature 0 are {n} identical answers; give a temperature above 0, "
            f"or params.allow_identical_samples: true if that is what is meant")


def _with_unknown_fields(question: QuestionEvent, data: bytes) -> QuestionEvent:
    """The question with the keys it sent that Kev does not know: `max_tokens` at the top, `params.max_tokens`."""
    top = _KEYS_DECODER.decode(data)
    unknown = [name for name in top if name not in _QUESTION_KEYS]
    params = top.get("params")
    if params is not None:
        unknown += [f"params.{name}" for name in _KEYS_DECODER.decode(params) if name not in _PARAMS_KEYS]
    if not unknown:
        return question
    names = list(dict.fromkeys([*question.unknown_fields, *(_short(name) for name in unknown)]))
    if len(names) > MAX_UNKNOWN_FIELDS:
        names = names[:MAX_UNKNOWN_FIELDS - 1] + ["..."]
    return msgspec.structs.replace(question, unknown_fields=tuple(names))


def _short(name: str) -> str:
    return name if len(name) <= 80 else name[:77] + "..."


def _check_schema(schema: Any, question_id: str, request_id: str | None, reply_topic: Any) -> None:
    if isinstance(schema, (bool, list, dict)) or schema not in SUPPORTED_SCHEMAS:  # lists: unhashable
        supported = ", ".join(str(v) for v in sorted(SUPPORTED_SCHEMAS))
        raise InvalidQuestion(
            question_id, request_id, "unsupported_schema",
            f"schema: version {show(schema)} is not supported (supported: {supported})", reply_topic,
        )


def _check_prompt(question: QuestionEvent, max_prompt_chars: int) -> None:
    def invalid(code: str, message: str) -> InvalidQuestion:
        return InvalidQuestion(question.question_id, question.request_id, code, message, question.reply_topic)

    if question.prompt is None and question.messages is None:
        raise invalid("empty_prompt", "prompt: missing; give prompt or messages")
    if question.prompt is not None and question.messages is not None:
        raise invalid("invalid_field", "prompt, messages: give one of them, not both")
    if question.raw and (question.messages is not None or question.system is not None or question.tools):
        raise invalid("invalid_field", "raw: a raw prompt is continued as given; give prompt alone, "
                                       "without messages, system or tools")
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
    """An id an error answer can be addressed to: a string within the ceiling every answer relies on."""
    return isinstance(value, str) and 0 < len(value) <= ID_CHARS_CEILING


def _bounded(request_id: Any, limits: LimitsConfig) -> str | None:
    """The request_id to echo on an error answer: a string within the limit, else none at all."""
    return request_id if isinstance(request_id, str) and len(request_id) <= limits.max_id_chars else None
