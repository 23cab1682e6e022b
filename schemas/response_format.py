"""`params.response_format`: the shape a question's answer must take, in the OpenAI API's words.

    {"type": "json_object"}                                   any JSON object
    {"type": "json_schema", "json_schema": {"name": "review", "schema": {...}, "strict": true}}
    {"type": "regex", "pattern": "[0-9]{3}-[0-9]{4}"}
    {"type": "grammar", "grammar": "start: ..."}               Lark, or GBNF (rules written `name ::= ...`)
    {"type": "text"}                                          no constraint (OpenAI's default)

These types check the shape and the sizes only. Whether a schema, regex or grammar can be compiled is
the engine's question (engine/constrain/): a bad one ends that question with an `invalid_field` error
answer naming the problem.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from schemas._validation import CONSTRAINT_CHARS_CEILING

ConstraintText = Annotated[str, Meta(min_length=1, max_length=CONSTRAINT_CHARS_CEILING)]
SchemaName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]  # as OpenAI's


class TextFormat(Struct, frozen=True, tag_field="type", tag="text"):
    """Free text: no constraint."""


class JsonObjectFormat(Struct, frozen=True, tag_field="type", tag="json_object"):
    """Any JSON object."""


class JsonSchema(Struct, frozen=True, omit_defaults=True):
    name: SchemaName
    schema: dict[str, Any]
    strict: bool | None = None  # accepted for OpenAI's clients: Kev always holds the answer to the schema
    description: Annotated[str, Meta(max_length=4096)] | None = None


class JsonSchemaFormat(Struct, frozen=True, tag_field="type", tag="json_schema"):
    json_schema: JsonSchema


class RegexFormat(Struct, frozen=True, tag_field="type", tag="regex"):
    pattern: ConstraintText  # the whole answer matches it


class GrammarFormat(Struct, frozen=True, tag_field="type", tag="grammar"):
    grammar: ConstraintText


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat | GrammarFormat


def constraint_chars(fmt: ResponseFormat | None) -> int:
    """The size of what must be compiled: the schema as JSON, the pattern or the grammar."""
    if isinstance(fmt, JsonSchemaFormat):
        try:
            return len(msgspec.json.encode(fmt.json_schema.schema))
        except RecursionError:  # deeper than encoding allows: too large to compile either way
            return CONSTRAINT_CHARS_CEILING + 1
    if isinstance(fmt, RegexFormat):
        return len(fmt.pattern)
    if isinstance(fmt, GrammarFormat):
        return len(fmt.grammar)
    return 0
