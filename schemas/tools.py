"""Tools on the wire: the functions a question offers the model (`QuestionEvent.tools`) and the calls an
assistant message made (`Message.tool_calls`), in OpenAI's shapes.

The worker renders them through the model's chat template (engine/prompt.py); a template without a
tool-call format refuses them. Which calls the model may make is a `response_format` grammar the asker
builds (the gateway does so for `tool_choice: required` and a named function): the event carries the
tools, not a choice.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from schemas._validation import ID_CHARS_CEILING, TEXT_CHARS_CEILING

MAX_TOOLS = 128  # OpenAI's own limit on a request's tools
# OpenAI's rule for a function's name; it is also what a grammar may quote without escaping
FunctionName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
Description = Annotated[str, Meta(max_length=TEXT_CHARS_CEILING)]
Arguments = Annotated[str, Meta(max_length=TEXT_CHARS_CEILING)]  # JSON text, as OpenAI carries it
CallId = Annotated[str, Meta(max_length=ID_CHARS_CEILING)]


class ToolFunction(Struct, frozen=True, omit_defaults=True):
    name: FunctionName
    description: Description | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # accepted for OpenAI's clients: constrained calls always follow the schema


class Tool(Struct, frozen=True, omit_defaults=True):
    function: ToolFunction
    type: Literal["function"] = "function"


class CalledFunction(Struct, frozen=True):
    name: Annotated[str, Meta(min_length=1, max_length=ID_CHARS_CEILING)]
    arguments: Arguments


class ToolCall(Struct, frozen=True, omit_defaults=True):
    id: CallId
    function: CalledFunction
    type: Literal["function"] = "function"


Tools = Annotated[tuple[Tool, ...], Meta(max_length=MAX_TOOLS)]
ToolCalls = Annotated[tuple[ToolCall, ...], Meta(max_length=MAX_TOOLS)]


def tool_dict(tool: Tool) -> dict[str, Any]:
    """A tool as chat templates read it: OpenAI's `{"type": "function", "function": {...}}`."""
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    if tool.function.parameters is not None:
        function["parameters"] = tool.function.parameters
    return {"type": "function", "function": function}
