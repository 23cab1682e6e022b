"""OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` on chat completions: checked, turned into the
question's tools and, for `required` or a named function, a grammar that admits only calls to them.

The model's own tool-call format is what its chat template writes: Kev reads Hermes-style blocks,
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5's and Qwen3's templates); the
worker refuses tools for a template without it (engine/prompt.py), and the gateway waits for that refusal
before it opens a stream, so it is a 400 either way. The grammar quotes `<tool_call>` as the tokenizer's
own token, as the model writes it, and holds each call's arguments to its function's JSON schema with the
separators the template uses. `tool_choice: none` leaves the tools out of the prompt (vLLM's
`--exclude-tools-when-tool-choice-none`): the answer is text, and any model can give it.
Parsing the answer back into `tool_calls` is tool_calls.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from kev_async.gateway.errors import bad_request
from kev_async.gateway.tool_calls import message_with_calls
from schemas.constraint import InvalidConstraint, check
from schemas.response_format import GrammarFormat
from schemas.tools import Tool, Tools

# How Qwen2.5's template writes a call (Jinja's tojson: json.dumps' default separators), held by the grammar.
_CALL_JSON = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI's reading


@dataclass(frozen=True)
class ToolUse:
    """What a chat request asked of tools, once checked; `choice` is auto, required or a function's name."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool

    @property
    def names(self) -> frozenset[str]:
        return frozenset(tool.function.name for tool in self.tools)

    @property
    def constrained(self) -> bool:
        return self.choice != "auto"

    def grammar(self) -> str:
        """The Lark grammar of the calls allowed: one or (parallel) several blocks, each a call to one of the
        tools (only the named one for a named choice) with arguments valid under its schema."""
        tools = [t for t in self.tools if self.choice == "required" or t.function.name == self.choice]
        rules = ["start: call" + (' ("\\n" call)*' if self.parallel else ""),
                 'call: <tool_call> "\\n" body "\\n" </tool_call>',
                 "body: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        rules += [f"fn_{i}: %json {json.dumps(_call_schema(tool))}" for i, tool in enumerate(tools)]
        return "\n".join(rules)


def tool_use(request: Any) -> ToolUse | None:
    """The tools a chat request offers and how it lets the model use them; None when it offers none or says
    `tool_choice: none`. Anything malformed is a 400 naming the field."""
    tools = _tools(request.tools)
    choice = _choice(request.tool_choice, tools)
    if choice == "none" or not tools:
        return None
    if choice != "auto" and request.response_format is not None \
            and request.response_format.get("type", "text") != "text":
        raise bad_request(f"tool_choice: {choice!r} constrains the answer to tool calls, and response_format "
                          f"would constrain it too; give one of them", param="tool_choice", code="invalid_value")
    use = ToolUse(tools, choice, request.parallel_tool_calls is not False)
    if use.constrained:
        _check_grammar(use.grammar())
    return use


def question_fields(request: Any) -> dict[str, Any]:
    """The question's `tools` and, for a constrained choice, the response_format holding it to calls."""
    use = tool_use(request)
    if use is None:
        return {}
    fields: dict[str, Any] = {"tools": [msgspec.to_builtins(tool) for tool in use.tools]}
    if use.constrained:
        fields["response_format"] = {"type": "grammar", "grammar": use.grammar()}
    return fields


def _tools(raw: list[Any] | None) -> tuple[Tool, ...]:
    if not raw:
        return ()
    try:
        tools = msgspec.convert(raw, Tools)
    except RecursionError:
        raise bad_request("tools: nested too deeply", param="tools", code="invalid_value") from None
    except msgspec.ValidationError as error:
        message, _, where = str(error).partition(" - at `$")
        where = where.rstrip("`")
        raise bad_request(f"tools{where}: {message}", param=f"tools{where}", code="invalid_value") from None
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise bad_request(f"tools: the function {twice!r} is given twice", param="tools", code="invalid_value")
    return tools


def _choice(raw: Any, tools: tuple[Tool, ...]) -> str:
    """none, auto, required or a function's name; OpenAI's default is auto with tools and none without."""
    if raw is None:
        return "auto" if tools else "none"
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        name = raw["function"].get("name")
        if not isinstance(name, str) or name not in {tool.function.name for tool in tools}:
            raise bad_request(f"tool_choice: the function {_short(name)} is not among the request's tools",
                              param="tool_choice", code="invalid_value")
        return name
    if raw not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice: expected 'none', 'auto', 'required' or {{\"type\": \"function\", "
                          f"\"function\": {{\"name\": ...}}}}, got {_short(raw)}", param="tool_choice",
                          code="invalid_value")
    if raw == "required" and not tools:
        raise bad_request("tool_choice: 'required' needs tools", param="tool_choice", code="invalid_value")
    return raw


def _call_schema(tool: Tool) -> dict[str, Any]:
    """One call to this tool as the template writes it: the name, then the arguments under their schema."""
    parameters = tool.function.parameters if tool.function.parameters is not None else _NO_PARAMETERS
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": _CALL_JSON}


def _check_grammar(grammar: str) -> None:
    try:
        check(GrammarFormat(grammar))
    except InvalidConstraint as bad:
        raise bad_request(f"tools: a function's parameters do not compile as a JSON schema: {bad.reason}",
                          param="tools", code="invalid_value") from None


def _short(value: Any) -> str:
    try:
        return msgspec.json.encode(value).decode()[:100]
    except (RecursionError, TypeError, ValueError):
        return type(value).__name__


def with_tool_calls(body: dict[str, Any], request: Any) -> dict[str, Any]:
    """A chat.completion body with each choice's calls read out of its text, for a request that offered
    tools; finish_reason `tool_calls` where an answer that stopped by itself made calls."""
    use = tool_use(request)
    if use is None:
        return body
    for choice in body["choices"]:
        message, called = message_with_calls(choice["message"]["content"], use.names, use.parallel)
        choice["message"] = message
        if called and choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"
    return body
