"""From a question to its prompt token ids, the same way whether it runs alone or packed."""

from __future__ import annotations

import msgspec

from schemas import Params, QuestionEvent


def as_question(item, index: int = 0, **params) -> QuestionEvent:
    """Accept a string, a dict or a QuestionEvent; `params` fill in what the question leaves unset."""
    if isinstance(item, QuestionEvent):
        question = item
    elif isinstance(item, str):
        question = QuestionEvent(question_id=f"q{index}", prompt=item)
    elif isinstance(item, dict):
        question = msgspec.convert({"question_id": f"q{index}", **item}, QuestionEvent)
    else:
        raise TypeError(f"a question is a str, dict or QuestionEvent, not {type(item).__name__}")
    if not params:
        return question
    merged = {**params, **{k: v for k, v in msgspec.structs.asdict(question.params).items() if v not in (None, ())}}
    return msgspec.structs.replace(question, params=msgspec.convert(merged, Params))


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
