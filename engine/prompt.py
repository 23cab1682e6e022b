"""From a question to its prompt token ids, the same way whether it runs alone or packed.

`as_question` is the Python path's intake: keys it does not know (a dict's, its params', or a keyword's)
are never dropped silently, but dealt with as `intake.unknown_fields` says, as the Kafka path's are.
"""

from __future__ import annotations

import json

import msgspec
import structlog

from engine.unknown_fields import unknown_fields
from schemas import Message, Params, QuestionEvent
from schemas.questions import MAX_UNKNOWN_FIELDS
from schemas.tools import CalledFunction, tool_dict

_QUESTION_KEYS = frozenset(QuestionEvent.__struct_encode_fields__)
_PARAMS_KEYS = frozenset(Params.__struct_encode_fields__)
log = structlog.get_logger("kev.engine")


def as_question(item, index: int = 0, *, on_unknown: str = "report", **params) -> QuestionEvent:
    """Accept a string, a dict or a QuestionEvent; `params` fill in what the question leaves unset.

    Keys Kev does not know, in a dict (`max_tokens`, `params.temprature`) or among `params`
    (`params.max_tokens`), go as `on_unknown` (intake.unknown_fields) says: "report" logs them and records
    them in the question's `unknown_fields` (its answer lists them in audit.ignored_fields), "reject" raises
    QuestionRejected (invalid_field) naming them, "ignore" records them for the engine's own policy only.
    Names a QuestionEvent already carries (the Kafka intake's) are left to the engine.
    """
    question = _with_params(_converted(item, index), {k: v for k, v in params.items() if k in _PARAMS_KEYS})
    unknown = _unknown_keys(item, params)
    if not unknown:
        return question
    _refuse_or_report(question, unknown, on_unknown)
    names = list(dict.fromkeys([*question.unknown_fields, *unknown]))
    if len(names) > MAX_UNKNOWN_FIELDS:  # as the Kafka intake bounds them
        names = names[:MAX_UNKNOWN_FIELDS - 1] + ["..."]
    return msgspec.structs.replace(question, unknown_fields=tuple(names))


def _converted(item, index: int) -> QuestionEvent:
    if isinstance(item, QuestionEvent):
        return item
    if isinstance(item, str):
        return QuestionEvent(question_id=f"q{index}", prompt=item)
    if isinstance(item, dict):
        return msgspec.convert({"question_id": f"q{index}", **item}, QuestionEvent)
    raise TypeError(f"a question is a str, dict or QuestionEvent, not {type(item).__name__}")


def _with_params(question: QuestionEvent, params: dict) -> QuestionEvent:
    """`params` fill in what the question's own params leave unset."""
    if not params:
        return question
    own = {k: v for k, v in msgspec.structs.asdict(question.params).items() if v not in (None, ())}
    return msgspec.structs.replace(question, params=msgspec.convert({**params, **own}, Params))


def _unknown_keys(item, params: dict) -> list[str]:
    """Keys of a dict question, of its params, and keyword params that no field of the wire types takes,
    named as the Kafka intake names them."""
    names = []
    if isinstance(item, dict):
        names += [str(k) for k in item if k not in _QUESTION_KEYS]
        if isinstance(item.get("params"), dict):
            names += [f"params.{k}" for k in item["params"] if k not in _PARAMS_KEYS]
    names += [f"params.{k}" for k in params if k not in _PARAMS_KEYS]
    return list(dict.fromkeys(name if len(name) <= 80 else name[:77] + "..." for name in names))


def _refuse_or_report(question: QuestionEvent, names: list[str], policy: str) -> None:
    found = msgspec.structs.replace(question, unknown_fields=tuple(names))
    if unknown_fields(found, policy):  # raises QuestionRejected when the policy is reject
        log.warning("question.unknown_fields", question_id=question.question_id, fields=names, policy=policy)


def chat_messages(question: QuestionEvent) -> list[dict]:
    messages: list[dict] = []
    if question.system:
        messages.append({"role": "system", "content": question.system})
    if question.messages:
        messages += [_message_dict(m) for m in question.messages]
    else:
        messages.append({"role": "user", "content": question.prompt or ""})
    return messages


def _message_dict(message: Message) -> dict:
    """A message as chat templates read it; a call's arguments as an object (templates write them with
    `tojson`: the JSON text OpenAI carries would come out quoted twice)."""
    out: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": _arguments(call.function)}}
                             for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _arguments(function: CalledFunction):
    try:
        return json.loads(function.arguments)
    except ValueError:
        raise ValueError(f"tool call {function.name!r}: its arguments are not JSON") from None


def uses_tools(question: QuestionEvent) -> bool:
    return bool(question.tools) or any(m.role == "tool" or m.tool_calls for m in question.messages or ())


def tool_format_missing(tokenizer) -> str | None:
    """Why this tokenizer's chat template cannot take tools, or None when it can: Kev reads Hermes-style
    calls (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, Qwen2.5's and Qwen3's), so the template
    must render `tools` and write calls that way."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):  # none, or one per name (a dict): none of them is known to be Hermes
        return "the model has no chat template"
    if "tools" not in template or "<tool_call>" not in template:
        return ("the model's chat template has no tool-call format (Kev reads Hermes-style <tool_call> blocks, "
                "as Qwen2.5's template writes them)")
    return None


def encode_prompt(tokenizer, question: QuestionEvent) -> list[int]:
    """A raw question's prompt as the tokenizer encodes it (special tokens such as BOS as the model wants);
    otherwise the chat template with a generation prompt, or plain tokens where the tokenizer has none."""
    if question.raw:
        return list(tokenizer.encode(question.prompt or ""))
    messages = chat_messages(question)
    if uses_tools(question) and (missing := tool_format_missing(tokenizer)):
        raise ValueError(f"tools: {missing}")
    if getattr(tokenizer, "chat_template", None):
        tools = [tool_dict(tool) for tool in question.tools] or None
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)
    text = "\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text))
