"""Keys a question sent that no field of the wire types takes (`intake.unknown_fields`): listed in its
answer's audit, ignored, or refused with the closest known key as a hint."""

from __future__ import annotations

import difflib

from engine.rejection import QuestionRejected
from schemas import Params, QuestionEvent

QUESTION_KEYS = frozenset(QuestionEvent.__struct_encode_fields__) - {"unknown_fields"}
PARAMS_KEYS = frozenset(Params.__struct_encode_fields__)


def unknown_fields(question: QuestionEvent, policy: str) -> tuple[str, ...]:
    """The keys to list in the answer's audit: all of them when reporting, none when ignoring; rejecting
    raises QuestionRejected (invalid_field) naming them."""
    names = question.unknown_fields
    if not names or policy == "ignore":
        return ()
    if policy == "reject":
        raise QuestionRejected("invalid_field", "unknown keys (intake.unknown_fields: reject): " + ", ".join(
            _with_hint(name) for name in names))
    return names


def _with_hint(name: str) -> str:
    prefix, _, key = name.rpartition(".")
    known = PARAMS_KEYS if prefix == "params" else QUESTION_KEYS
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f"{name} (did you mean {(prefix + '.' if prefix else '') + close[0]!r}?)" if close else name
