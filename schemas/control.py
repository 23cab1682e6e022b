"""Control events: runtime commands on the control topic (adapters, engine-wide sampling defaults).

`decode_control` is the gate for control commands; it raises `InvalidControl`, and the reader skips
such records. Commands are signed (schemas/signing.py, purpose CONTROL) and keyed by what they
change (`control_key`), so the topic can be compacted: the latest command per key is all a replay needs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from schemas._validation import (
    ID_CHARS_CEILING,
    MaxNewTokens,
    RepetitionPenalty,
    Seed,
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

ControlAction = Literal["load_adapter", "unload_adapter", "update_defaults", "cancel"]
AdapterName = Annotated[str, Meta(min_length=1, max_length=ID_CHARS_CEILING)]
AdapterPath = Annotated[str, Meta(min_length=1, max_length=4096)]
QuestionId = Annotated[str, Meta(min_length=1, max_length=ID_CHARS_CEILING)]  # as on QuestionEvent
DefaultsKey = Annotated[str, Meta(max_length=64)]
Defaults = Annotated[dict[DefaultsKey, float | int], Meta(max_length=16)]


class ControlEvent(Struct, frozen=True, omit_defaults=True):
    """A runtime command on the control topic, applied by every worker while it serves.

    - load_adapter: `name` and `path` (a PEFT LoRA directory as the worker sees it); loading a name
      again replaces it (a new version; questions in flight keep theirs)
    - unload_adapter: `name`; new questions naming it get `unknown_adapter`
    - update_defaults: `defaults`, e.g. {"temperature": 0.7}: new engine-wide sampling defaults for
      questions admitted from now on (keys: see DEFAULTS_KEYS)
    - cancel: `question_id`: the worker holding that question ends it now (finish_reason "cancelled")
      and frees its KV blocks; the others ignore it. A cancel only means something while its
      question may be running, so a worker replaying the topic at start skips the cancels
    """

    action: ControlAction
    name: AdapterName | None = None
    path: AdapterPath | None = None
    defaults: Defaults | None = None
    question_id: QuestionId | None = None
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
# Which of name / path / defaults / question_id each action needs; the others must be left out.
_CONTROL_FIELDS = {"load_adapter": ("name", "path"), "unload_adapter": ("name",), "update_defaults": ("defaults",),
                   "cancel": ("question_id",)}


class InvalidControl(Exception):
    """A control record that cannot be applied; the reader logs it and skips it."""

    def __init__(self, reason: str, message: str) -> None:
        message = message if len(message) <= 1000 else message[:997] + "..."  # it goes into a DLQ header
        super().__init__(f"{reason}: {message}")
        # not_utf8 | not_json | not_object | invalid_field | unsupported_schema | too_large | too_deep
        self.reason = reason
        self.message = message


_CONTROL_DECODER = msgspec.json.Decoder(ControlEvent)


def decode_control(raw: bytes | str, *, max_bytes: int = 65_536) -> ControlEvent:
    """Decode and validate one control command; raise InvalidControl saying what is wrong.

    The defaults of update_defaults come back checked and normalised (temperature 1 -> 1.0).
    """
    try:
        data = as_utf8_bytes(raw)
    except UndecodableEvent as bad:
        raise InvalidControl(bad.reason, bad.message) from None
    if len(data) > max_bytes:
        raise InvalidControl("too_large", f"event is {len(data)} bytes, at most {max_bytes} allowed")
    try:
        event = _CONTROL_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise _classify_control_failure(data, error) from None
    except RecursionError:
        raise InvalidControl("too_deep", "JSON nested too deeply to decode") from None
    _check_control_schema(event.schema)
    return _check_control_fields(event)


def control_key(event: ControlEvent) -> bytes:
    """The record key: what the command changes. On a compacted topic only the latest command per key
    is kept, so update_defaults is keyed by the set of defaults it changes: the latest command naming
    a default is always kept, and a replay in offset order still ends at every default's last value."""
    if event.action in ("load_adapter", "unload_adapter"):
        return f"adapter:{event.name}".encode()
    if event.action == "cancel":
        return f"cancel:{event.question_id}".encode()
    return ("defaults:" + ",".join(sorted(event.defaults or {}))).encode()


def _classify_control_failure(data: bytes, error: Exception) -> InvalidControl:
    try:
        tree = ANY_DECODER.decode(data)
    except msgspec.DecodeError as parse_error:
        bad = unparseable(data, parse_error)
        return InvalidControl(bad.reason, bad.message)
    except RecursionError:
        return InvalidControl("too_deep", "JSON nested too deeply to decode")
    if not isinstance(tree, dict):
        return InvalidControl("not_object", f"expected a JSON object, got {json_kind(tree)}")
    _check_control_schema(tree.get("schema", SCHEMA_VERSION))
    if isinstance(tree.get("defaults"), dict):
        _check_defaults(tree["defaults"])  # names the key at fault, which the dict's own error cannot
    path, reason = explain(error, tree, ControlEvent)
    return InvalidControl("invalid_field", f"{path}: {reason}")


def _check_control_schema(schema: Any) -> None:
    if isinstance(schema, (bool, list, dict)) or schema not in SUPPORTED_SCHEMAS:  # lists: unhashable
        supported = ", ".join(str(v) for v in sorted(SUPPORTED_SCHEMAS))
        raise InvalidControl("unsupported_schema",
                             f"schema: version {show(schema)} is not supported (supported: {supported})")


def _check_control_fields(event: ControlEvent) -> ControlEvent:
    """Each action's fields present, the others absent; defaults checked against their limits."""
    needed = _CONTROL_FIELDS[event.action]
    for field_name in ("name", "path", "defaults", "question_id"):
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
