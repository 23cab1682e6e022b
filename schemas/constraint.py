"""A question's response_format as llguidance grammar text, with the hash it is cached and audited by.

Turning a format into grammar text needs no tokenizer, so a bad schema, regex or grammar is found here,
by the engine before it compiles (engine/constrain/) and by the gateway before it publishes (a 400
instead of an error answer later). What is said is the library's own reason, under the field it
belongs to, e.g. `params.response_format.json_schema.schema: Unimplemented keys: ["not"]`.
Not imported by `schemas/__init__`: only those who check formats load llguidance (~40 ms, no torch).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import llguidance
import msgspec
from llguidance.gbnf_to_lark import any_to_lark

from schemas.response_format import (
    GrammarFormat,
    JsonObjectFormat,
    JsonSchemaFormat,
    RegexFormat,
    ResponseFormat,
    TextFormat,
)

# Compact JSON: no whitespace between tokens. A small model left free to emit whitespace can spend its
# whole max_new_tokens on it; compact answers are what OpenAI's structured outputs look like too.
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_REASON_CHARS = 500  # the library's message can quote the grammar: keep the answer's error short
_FIELD = "params.response_format"


class InvalidConstraint(Exception):
    """A response_format that cannot be compiled; `where` is the field, `reason` the library's words."""

    def __init__(self, where: str, reason: str):
        reason = reason.strip() or "invalid"
        reason = reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS - 3] + "..."
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


@dataclass(frozen=True)
class ConstraintSpec:
    kind: str  # json_object | json_schema | regex | grammar
    grammar: str  # llguidance's grammar text
    digest: str  # SHA-256 of kind and canonical source: the cache key, and the audit's name for it
    where: str  # the field a compile error is reported under

    @property
    def label(self) -> str:
        """What the answer's audit says: kind and the first 16 hex digits of the hash."""
        return f"{self.kind}:{self.digest[:16]}"


def spec_of(fmt: ResponseFormat | None) -> ConstraintSpec | None:
    """The grammar text of a response_format; None for none or `text`. Raises InvalidConstraint."""
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, JsonObjectFormat):
        return _spec("json_object", {"type": "object"}, f"{_FIELD}.type")
    if isinstance(fmt, JsonSchemaFormat):
        return _spec("json_schema", fmt.json_schema.schema, f"{_FIELD}.json_schema.schema")
    if isinstance(fmt, RegexFormat):
        return _text_spec("regex", fmt.pattern, llguidance.LLMatcher.grammar_from_regex(fmt.pattern),
                          f"{_FIELD}.pattern")
    if isinstance(fmt, GrammarFormat):
        where = f"{_FIELD}.grammar"
        try:
            lark = any_to_lark(fmt.grammar)  # GBNF (`name ::= ...`) is translated; Lark passes through
        except Exception as exc:  # noqa: BLE001 - the converter's own error type, or any slip in it
            raise InvalidConstraint(where, f"GBNF: {exc}") from None
        return _text_spec("grammar", fmt.grammar, llguidance.LLMatcher.grammar_from_lark(lark), where)
    raise TypeError(f"not a response_format: {fmt!r}")


def check(fmt: ResponseFormat | None) -> ConstraintSpec | None:
    """`spec_of`, and the grammar validated by the library (no tokenizer needed); raises InvalidConstraint."""
    spec = spec_of(fmt)
    if spec is not None:
        error = llguidance.LLMatcher.validate_grammar(spec.grammar)
        if error:
            raise InvalidConstraint(spec.where, error)
    return spec


def _spec(kind: str, schema: dict, where: str) -> ConstraintSpec:
    # Hashed as written, key order included: the library keeps properties in the schema's order, so two
    # orders are two grammars (one cache entry for both would make an answer's order depend on the cache).
    try:
        source = msgspec.json.encode(schema)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(source.decode(), defaults=JSON_OPTIONS)
    except ValueError as exc:  # e.g. llguidance's own depth limit: "recursion limit exceeded at line 1 ..."
        raise InvalidConstraint(where, str(exc)) from None
    except RecursionError:
        raise InvalidConstraint(where, "nested too deeply") from None
    return ConstraintSpec(kind, grammar, _digest(kind, source), where)


def _text_spec(kind: str, source: str, grammar: str, where: str) -> ConstraintSpec:
    return ConstraintSpec(kind, grammar, _digest(kind, source.encode()), where)


def _digest(kind: str, source: bytes) -> str:
    return hashlib.sha256(kind.encode() + b"\0" + source).hexdigest()
