"""What every wire event shares: the schema version, JSON encoding, and reading raw bytes
(UTF-8, JSON) before an event family's own decoder takes over."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

SCHEMA_VERSION = 1
SUPPORTED_SCHEMAS = frozenset({1})

_ENCODER = msgspec.json.Encoder()
ANY_DECODER = msgspec.json.Decoder()


class UndecodableEvent(Exception):
    """No usable question_id: nobody can be answered, so the raw event goes to the DLQ."""

    def __init__(self, reason: str, message: str) -> None:
        message = message if len(message) <= 1000 else message[:997] + "..."  # it goes into a DLQ header
        super().__init__(f"{reason}: {message}")
        # not_utf8 | not_json | not_object | missing_question_id | unusable_question_id | too_large | too_deep
        self.reason = reason
        self.message = message


def encode(obj: Struct) -> bytes:
    return _ENCODER.encode(obj)


def as_utf8_bytes(raw: bytes | str) -> bytes:
    if isinstance(raw, bytes):
        return raw
    try:
        return raw.encode("utf-8")
    except UnicodeEncodeError as error:  # lone surrogates in a str
        raise UndecodableEvent("not_utf8", f"not valid UTF-8: {error.reason}") from None


def unparseable(data: bytes, error: msgspec.DecodeError) -> UndecodableEvent:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as utf8_error:
        return UndecodableEvent("not_utf8", f"not valid UTF-8 at byte {utf8_error.start}")
    return UndecodableEvent("not_json", f"not valid JSON: {error}")


def json_kind(value: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")
