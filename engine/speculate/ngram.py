"""Prompt lookup: drafts copied from what follows an earlier occurrence of the question's last tokens.

Pure (no torch, no engine state): a drafter is handed one question's own tokens (its prompt and its
output so far) and nothing else, so a draft can only ever repeat that question's text, never a
neighbour's. The search runs in C: the tokens become an int32 byte string and `bytes.rfind` looks
for the tail n-gram, keeping only matches that start on a token boundary.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = 4  # bytes per token id in the search string ("i" is 32-bit on every platform torch runs on)


class NgramDrafter:
    method = "ngram"  # the metrics' and the audit's name for it

    def __init__(self, max_draft_tokens: int, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"speculative.ngram_min ({ngram_min}) must be >= 1 and <= ngram_max ({ngram_max})")
        if max_draft_tokens < 1:
            raise ValueError(f"speculative.max_draft_tokens must be >= 1, got {max_draft_tokens}")
        self.max_draft_tokens = max_draft_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """Up to min(limit, max_draft_tokens) tokens likely to follow `tokens`; [] when nothing matches."""
        return self.propose_at(tokens, limit)[0]

    def propose_at(self, tokens: Sequence[int], limit: int | None = None) -> tuple[list[int], int, int]:
        """`propose`, with where the draft was copied from: (draft, its first token's index in `tokens`,
        the matched n-gram's length); (draft, 0, 0) when nothing matches. For the audit (engine/audit.py)."""
        k = self.max_draft_tokens if limit is None else min(limit, self.max_draft_tokens)
        if k < 1:
            return [], 0, 0
        follow, n = ngram_match(tokens, self.ngram_min, self.ngram_max)
        return list(tokens[follow : follow + k]) if n else [], follow, n


def ngram_draft(tokens: Sequence[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """The k tokens after the most recent earlier occurrence of the last n tokens, n tried from
    `ngram_max` down to `ngram_min`; fewer when the match sits near the end, [] when none matches."""
    if k < 1:
        return []
    follow, n = ngram_match(tokens, ngram_min, ngram_max)
    return list(tokens[follow : follow + k]) if n else []


def ngram_match(tokens: Sequence[int], ngram_min: int, ngram_max: int) -> tuple[int, int]:
    """(index of the token after the match, n) for the most recent earlier occurrence of the last n
    tokens, the longest n first; (0, 0) when none matches."""
    if len(tokens) < ngram_min + 1:
        return 0, 0
    data = array("i", tokens).tobytes()
    # An earlier occurrence must end before the last token, so at least one token follows it.
    haystack_end = (len(tokens) - 1) * _WIDTH
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        start = _rfind_aligned(data, data[-n * _WIDTH:], haystack_end)
        if start is not None:
            return start + n, n
    return 0, 0


def _rfind_aligned(data: bytes, pattern: bytes, end: int) -> int | None:
    """The token index of the last occurrence of `pattern` in data[:end] on a token boundary."""
    while True:
        at = data.rfind(pattern, 0, end)
        if at < 0:
            return None
        if at % _WIDTH == 0:
            return at // _WIDTH
        end = at + len(pattern) - 1  # a misaligned hit: look again strictly before it
