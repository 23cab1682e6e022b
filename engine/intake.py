"""Checks a question passes before the scheduler sees it: its prompt rendered, tokenized and within
limits, the keys it sent that Kev does not know dealt with, and the adapter it names resident.

`prepare_prompt` only reads the tokenizer and fixed limits, so `Engine` runs it on a worker thread:
a huge prompt's chat template and tokenizer never hold up the device thread's next step.
"""

from __future__ import annotations

import msgspec

from engine.adapters.files import AdapterError, LoraAdapter
from engine.adapters.pool import AdapterPoolFull, LoraPool, UnknownAdapter
from engine.prompt import encode_prompt
from engine.rejection import QuestionRejected
from engine.unknown_fields import unknown_fields
from schemas import QuestionEvent

__all__ = ["QuestionRejected", "acquire_adapter", "prepare_prompt", "prompt_chars", "unknown_fields"]

# A token is rarely more than a few characters; a prompt with more than this many per token of the
# engine's limit is refused before tokenizing, so tokenizing time stays bounded whatever arrives.
CHARS_PER_TOKEN = 8


def prompt_chars(question: QuestionEvent) -> int:
    """Characters the chat template will be given: the system text, the prompt or every message, and the
    tools and calls as JSON."""
    parts = [question.system or "", question.prompt or ""]
    parts += [m.content for m in question.messages or ()]
    calls = [call for m in question.messages or () for call in m.tool_calls]
    return sum(len(p) for p in parts) + sum(len(msgspec.json.encode(x)) for x in (*question.tools, *calls))


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
