"""Incremental detokenizing with stop strings: text grows token by token, never with half a character."""

from __future__ import annotations

import bisect

REPLACEMENT = "\ufffd"  # what a tokenizer prints for an unfinished UTF-8 sequence
CONTEXT_TOKENS = 5  # earlier tokens decoded alongside the new ones, so leading spaces come out right
# Tokens to wait for the rest of an unfinished character. A UTF-8 character is at most 4 bytes, so
# its bytes come within 4 tokens or never (a model can draw stray continuation bytes forever): then
# the text is shown as it decodes, "\ufffd" and all, and decoding starts afresh after it, so each
# decode spans a bounded number of tokens and the whole answer decodes in linear time.
MAX_PENDING_TOKENS = 4


class TextStream:
    """Decodes one question's output; `push` returns the new text that is safe to show."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far, a stop string cut off
        self.emitted = 0  # chars of `text` already handed out
        self.stopped = False
        self._ends: list[int] = []  # len(text) after each token, before any cut
        self._prefix = 0  # ids[_prefix:_read] were decoded last time, as context
        self._read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        window = self._decode(self.ids[self._prefix :])
        unfinished = window.endswith(REPLACEMENT)
        if unfinished and len(self.ids) - self._read < MAX_PENDING_TOKENS:  # wait for the rest of the character
            self._ends.append(len(self.text))
            return ""
        previous = self._decode(self.ids[self._prefix : self._read])
        self.text += window[len(previous) :]
        # After giving up, no context: a later byte that completes the shown "\ufffd" must not be
        # decoded with it again (the text shown so far would no longer be a prefix of the window).
        self._prefix = len(self.ids) if unfinished else max(0, len(self.ids) - CONTEXT_TOKENS)
        self._read = len(self.ids)
        self._ends.append(len(self.text))
        self._cut_stop_string(len(window) - len(previous))
        return self._take(final=self.stopped)

    @property
    def kept_tokens(self) -> int:
        """How many of `ids` produced the text that is kept: all of them, until a stop string cuts.

        After a cut, the tokens whose text lies wholly before the cut: the stop string's tokens, and one
        that straddles the cut (" STOP" after "calm."), leave token_ids and completion_tokens.
        """
        if not self.stopped:
            return len(self.ids)
        return bisect.bisect_right(self._ends, len(self.text))

    def finish(self) -> str:
        """The rest of the text, once the question has ended."""
        return self._take(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _cut_stop_string(self, added: int) -> None:
        longest = max((len(s) for s in self.stop), default=0)
        if not longest:
            return
        start = max(0, len(self.text) - added - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _take(self, final: bool) -> str:
        # Hold back a possible start of a stop string until the next token settles it.
        hold = 0 if final else max((len(s) - 1 for s in self.stop), default=0)
        end = max(self.emitted, len(self.text) - hold)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta
