"""From a question to its prompt token ids, the same way whether it runs alone or packed.

`as_question` is the Python path's intake: keys it does not know (a dict's, its params', or a keyword's)
are never dropped silently, but dealt with as `intake.unknown_fields` says, as the Kafka path's are.
"""

from __future__ import annotations

import msgspec
import structlog

from engine.unknown_fields import unknown_fields
from schemas import Params, QuestionEvent
from schemas.questions import MAX_UNKNOWN_FIELDS

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
        messages += [{"role": m.role, "content": m.content} for m in question.messages]
    else:
        messages.append({"role": "user", "content": question.prompt or ""})
    return messages


def encode_prompt(tokenizer, question: QuestionEvent) -> list[int]:
    """A raw question's prompt as the tokenizer encodes it (special tokens such as BOS as the model wants);
    otherwise the chat template with a generation prompt, or plain tokens where the tokenizer has none."""
    if question.raw:
        return list(tokenizer.encode(question.prompt or ""))
    messages = chat_messages(question)
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)
    text = "\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text))
