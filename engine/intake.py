"""Checks a question passes before the scheduler sees it: its prompt rendered, tokenized and within
limits, the keys it sent that Kev does not know dealt with, and the adapter it names resident.

`prepare_prompt` only reads the tokenizer and fixed limits, so `Engine` runs it on a worker thread:
a huge prompt's chat template and tokenizer never hold up the device thread's next step.
"""

from __future__ import annotations

import difflib

from engine.adapters.files import AdapterError, LoraAdapter
from engine.adapters.pool import AdapterPoolFull, LoraPool, UnknownAdapter
from engine.prompt import encode_prompt
from schemas import Params, QuestionEvent

_QUESTION_KEYS = frozenset(QuestionEvent.__struct_encode_fields__) - {"unknown_fields"}
_PARAMS_KEYS = frozenset(Params.__struct_encode_fields__)

# A token is rarely more than a few characters; a prompt with more than this many per token of the
# engine's limit is refused before tokenizing, so tokenizing time stays bounded whatever arrives.
CHARS_PER_TOKEN = 8


class QuestionRejected(Exception):
    """The question cannot run; it gets an error answer with this code."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


def prompt_chars(question: QuestionEvent) -> int:
    """Characters the chat template will be given: the system text, the prompt or every message."""
    parts = [question.system or "", question.prompt or ""]
    parts += [m.content for m in question.messages or ()]
    return sum(len(p) for p in parts)


def prepare_prompt(tokenizer, question: QuestionEvent, max_tokens: int) -> list[int]:
    """The prompt's token ids, or QuestionRejected (prompt_too_long, bad_prompt, empty_prompt).

    `max_tokens` is the most tokens one question may reach (context, KV capacity); the prompt must
    leave room for at least one new token.
    """
    most_prompt_tokens = max_tokens - 1
    chars = prompt_chars(question)
    if chars > CHARS_PER_TOKEN * max_tokens:
        raise QuestionRejected("prompt_too_long", f"the prompt has {chars} characters; this engine takes at most "
                               f"{most_prompt_tokens} prompt tokens, so at most {CHARS_PER_TOKEN * max_tokens} "
                               f"characters are tokenized")
    try:
        prompt_ids = encode_prompt(tokenizer, question)
    except Exception as exc:  # e.g. a chat template that raises on this message order
        raise QuestionRejected("bad_prompt", f"the prompt could not be encoded: {exc}") from None
    if not prompt_ids:
        raise QuestionRejected("empty_prompt", "the prompt has no tokens")
    if len(prompt_ids) > most_prompt_tokens:
        raise QuestionRejected("prompt_too_long", f"the prompt has {len(prompt_ids)} tokens; this engine allows "
                               f"at most {most_prompt_tokens} (a context of {max_tokens} tokens, one kept for "
                               f"the answer)")
    return prompt_ids


def unknown_fields(question: QuestionEvent, policy: str) -> tuple[str, ...]:
    """The keys to list in the answer's audit (`intake.unknown_fields`): all of them when reporting, none
    when ignoring; rejecting raises QuestionRejected (invalid_field) naming them."""
    names = question.unknown_fields
    if not names or policy == "ignore":
        return ()
    if policy == "reject":
        raise QuestionRejected("invalid_field", "unknown keys (intake.unknown_fields: reject): " + ", ".join(
            _with_hint(name) for name in names))
    return names


def _with_hint(name: str) -> str:
    prefix, _, key = name.rpartition(".")
    known = _PARAMS_KEYS if prefix == "params" else _QUESTION_KEYS
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f"{name} (did you mean {(prefix + '.' if prefix else '') + close[0]!r}?)" if close else name


def acquire_adapter(loras: LoraPool, name: str | None) -> LoraAdapter | None:
    """The adapter version a question named, held for it until its answer; None when it names none, or
    while every resident slot is held (it then waits in the scheduler for one: `Sequence.awaits_adapter`)."""
    if not name:
        return None
    try:
        return loras.acquire(name)
    except UnknownAdapter:
        raise QuestionRejected("unknown_adapter", f"adapter {name!r} is not loaded") from None
    except AdapterPoolFull:
        return None
    except AdapterError as exc:  # evicted, and its files changed or went away since it was loaded
        raise QuestionRejected("adapter_error", str(exc)) from None
