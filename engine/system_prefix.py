"""A prompt's system part: its leading tokens that only the system messages and the chat template decide.

`isolation.level: system_prefix` shares the cached KV blocks wholly inside this part, never one that
holds a user's (or an assistant's) turn. The part is found without parsing any template: the question's
system messages are rendered twice, each time followed by a different one-letter user turn, and the
tokens both renderings share are the part (the template's boilerplate before the user's text included).
A question's own tokens then share it only as far as they agree with it token by token.

Rendering costs two tokenizations, so each distinct system part is rendered once and kept (LRU).
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from engine.prompt import encode_prompt
from schemas import Message, QuestionEvent

_PROBES = ("a", "b")  # two user turns that differ from their first character


class SystemPrefix:
    """How many leading prompt tokens lie in a question's system part, per tokenizer, with a small cache."""

    def __init__(self, tokenizer, cache_size: int = 256) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._rendered: OrderedDict[tuple, list[int]] = OrderedDict()

    def length(self, question: QuestionEvent, prompt_ids: list[int]) -> int:
        """Leading tokens of `prompt_ids` that are its system part; 0 for a raw prompt (it has none)."""
        if question.raw:
            return 0
        system = _system_messages(question)
        key = (question.system, system)
        part = self._rendered.get(key)
        if part is None:
            part = self._render(question, system)
            self._rendered[key] = part
            if len(self._rendered) > self.cache_size:
                self._rendered.popitem(last=False)
        self._rendered.move_to_end(key)
        return _common_length(part, prompt_ids)

    def _render(self, question: QuestionEvent, system: tuple[Message, ...]) -> list[int]:
        try:
            a, b = (encode_prompt(self.tokenizer, _probe(question, system, text)) for text in _PROBES)
        except Exception:  # noqa: BLE001 - a template that refuses the probe: then nothing is the system part
            return []
        return a[:_common_length(a, b)]


def _system_messages(question: QuestionEvent) -> tuple[Message, ...]:
    """The leading system messages of `messages` (`system` is rendered ahead of them either way)."""
    leading = []
    for message in question.messages or ():
        if message.role != "system":
            break
        leading.append(message)
    return tuple(leading)


def _probe(question: QuestionEvent, system: tuple[Message, ...], text: str) -> QuestionEvent:
    if question.messages is None:
        return msgspec.structs.replace(question, prompt=text)
    return msgspec.structs.replace(question, messages=(*system, Message(role="user", content=text)))


def _common_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
