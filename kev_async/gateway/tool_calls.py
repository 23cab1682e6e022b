"""A chat answer's Hermes-style `<tool_call>` blocks as OpenAI's `tool_calls`, whole or streamed.

One reader serves both: `CallReader` takes the answer's text as it comes and gives chat deltas, text as
`content` and each finished block as one `tool_calls` entry (index, id, type, and the function's name with
its whole arguments as a JSON string, in one delta). A whole answer is the same reader fed at once, so a
stream assembles to exactly the whole answer's message.

A block is a call when its body is a JSON object with a `name` of one of the request's tools and object
`arguments`; anything else stays text, as written (an unclosed block too: an answer cut by max_tokens).
An answer that is nothing but such an object, without the tags, is a call too: small models (Qwen2.5-Coder-
0.5B under `auto`) often leave them out. So an answer that begins with `{` is held until it ends.
Whitespace between calls and around the text is not content. With `parallel_tool_calls: false` only the
first call is kept (under `required` or a named function the grammar already allows one).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


class CallReader:
    def __init__(self, names: frozenset[str], parallel: bool = True) -> None:
        self.names, self.parallel = names, parallel
        self.calls = 0
        self._pending = ""  # text not given out yet: a block being read, or what may be the start of one
        self._in_block = False
        self._space = ""  # whitespace held back: content only if more text follows it
        self._started = False  # some content given out
        self._bare: bool | None = None  # whether the answer begins with `{` (None: only whitespace so far)
        self._held = ""  # the answer so far, while it may be a call without tags

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas this much more text completes (possibly none)."""
        if self._bare is False:
            return self._scan(text)
        self._held += text
        if self._bare is None and self._held.strip():
            self._bare = self._held.lstrip().startswith("{")
            if not self._bare:
                held, self._held = self._held, ""
                return self._scan(held)
        return []

    def end(self) -> list[dict[str, Any]]:
        """The deltas of what is left once the answer is complete: an unclosed block is text."""
        held, self._held = self._held, ""
        if self._bare:
            self._bare = False
            call = _call(held.strip(), self.names)
            return self._called(call) if call is not None else self._scan(held) + self.end()
        rest = (OPEN if self._in_block else "") + self._pending
        self._pending, self._in_block = "", False
        return self._text(rest)

    def _scan(self, text: str) -> list[dict[str, Any]]:
        self._pending += text
        out: list[dict[str, Any]] = []
        while True:
            marker = CLOSE if self._in_block else OPEN
            at = self._pending.find(marker)
            if at < 0:
                break
            before, self._pending = self._pending[:at], self._pending[at + len(marker):]
            if self._in_block:
                out += self._block(before)
            else:
                out += self._text(before)
            self._in_block = not self._in_block
        if not self._in_block:
            keep = _partial_marker(self._pending)
            out += self._text(self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
        return out

    def _text(self, text: str) -> list[dict[str, Any]]:
        if not text.strip():
            self._space += text
            return []
        if not self._started:
            text, self._started = text.lstrip(), True
        else:
            text = self._space + text
        stripped = text.rstrip()
        self._space = text[len(stripped):]
        return [{"content": stripped}]

    def _block(self, body: str) -> list[dict[str, Any]]:
        call = _call(body, self.names)
        if call is None:
            return self._text(OPEN + body + CLOSE)
        if self.calls and not self.parallel:
            return []
        return self._called(call)

    def _called(self, call: dict[str, str]) -> list[dict[str, Any]]:
        self._space = ""
        entry = {"index": self.calls, "id": call_id(), "type": "function", "function": call}
        self.calls += 1
        return [{"tool_calls": [entry]}]


def message_with_calls(text: str, names: frozenset[str], parallel: bool) -> tuple[dict[str, Any], bool]:
    """A whole answer's assistant message (content, tool_calls) and whether it made calls."""
    reader = CallReader(names, parallel)
    deltas = reader.feed(text) + reader.end()
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls = [call for d in deltas for call in d.get("tool_calls", ())]
    for call in calls:
        del call["index"]  # a whole message's calls are a list: index is the streams' field
    message = {"role": "assistant", "content": content or None, "refusal": None}
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls)


def _call(body: str, names: frozenset[str]) -> dict[str, str] | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or parsed.get("name") not in names:
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": parsed["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}


def _partial_marker(text: str) -> int:
    """How many of the text's last characters could begin `<tool_call>`: held until the next text tells."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


class StreamedCalls:
    """A stream's readers, one per sample; a delta's logprobs ride with the next chunk given out (a delta
    inside a block gives none until the block closes)."""

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        self.names, self.parallel = names, parallel
        self._readers: dict[int, CallReader] = {}
        self._held: dict[int, tuple] = {}

    def feed(self, index: int, text: str, logprobs: tuple | None) -> list[tuple[dict[str, Any], tuple | None]]:
        """(delta, logprobs) pairs to send for this much more of sample `index`'s text."""
        self._hold(index, logprobs)
        return self._paired(index, self._reader(index).feed(text))

    def end(self, index: int, tail: str, logprobs: tuple | None = None) -> tuple[list[tuple[dict[str, Any], tuple | None]],
                                                                             tuple | None, bool]:
        """Sample `index`'s last deltas (`tail`, its tokens' `logprobs`), the logprobs still held (for the
        closing chunk), and whether it made calls."""
        self._hold(index, logprobs)
        reader = self._reader(index)
        pairs = self._paired(index, reader.feed(tail) + reader.end())
        return pairs, self._held.pop(index, None), reader.calls > 0

    def _hold(self, index: int, logprobs: tuple | None) -> None:
        if logprobs:
            self._held[index] = self._held.get(index, ()) + tuple(logprobs)

    def _reader(self, index: int) -> CallReader:
        if index not in self._readers:
            self._readers[index] = CallReader(self.names, self.parallel)
        return self._readers[index]

    def _paired(self, index: int, deltas: list[dict[str, Any]]) -> list[tuple[dict[str, Any], tuple | None]]:
        if not deltas:
            return []
        return [(deltas[0], self._held.pop(index, None))] + [(delta, None) for delta in deltas[1:]]
